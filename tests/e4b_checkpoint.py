"""A checkpoint laid out as the google/gemma-4-E4B-it release is, at the tiny model's widths.

The release is the multimodal model: config.json is a ``gemma4`` config (architectures
``Gemma4ForConditionalGeneration``) nesting ``text_config``, ``vision_config`` and ``audio_config``; the decoder's
tensors live under ``model.language_model.*`` beside ``model.vision_tower.*``, ``model.audio_tower.*`` and the
towers' embedders; the head is tied (no ``lm_head.weight``); the weights are sharded (``model-0000N-of-0000M``
with ``model.safetensors.index.json``); the tokenizer files and ``generation_config.json`` sit beside them. Here
the decoder is the embedded tiny model's (so its float reference is known to be sane) and the towers are one small
layer each, built by transformers' own ``Gemma4ForConditionalGeneration`` so every name and shape is the real one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.models.e4b_shaped import multimodal_config

TEXT_PREFIX = "model.language_model."
SHARDS = 2


def write(tiny_dir: Path, out: Path) -> Path:
    """The E4B-layout checkpoint of the tiny model in ``out`` (created)."""
    from transformers import Gemma4ForConditionalGeneration

    out.mkdir(parents=True)
    config = multimodal_config(json.loads((tiny_dir / "config.json").read_text()))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Gemma4ForConditionalGeneration(config).state_dict().items()}
    text = load_file(tiny_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(4)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name == "lm_head.weight":
            continue  # tied to the token embedding, as in the release
        if name.startswith(TEXT_PREFIX):
            tensors[name] = text["model." + name.removeprefix(TEXT_PREFIX)]
            assert tuple(tensors[name].shape) == shape, name
        else:
            tensors[name] = 0.02 * torch.randn(shape, generator=generator)
    assert {f"model.{k.removeprefix('model.')}" for k in text} == {
        "model." + k.removeprefix(TEXT_PREFIX) for k in tensors if k.startswith(TEXT_PREFIX)}
    names = sorted(tensors)
    weight_map = {}
    for i in range(SHARDS):
        shard = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        part = names[i::SHARDS]
        save_file({k: tensors[k].contiguous() for k in part}, out / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True))
    config.save_pretrained(out)
    for f in tiny_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "chat_template.jinja",
                                                        "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    return out
