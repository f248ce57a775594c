"""A checkpoint shaped exactly as google/gemma-4-E4B-it's text decoder (or, with ``--model e2b``, E2B's), with random
weights, written locally.

For the full-size rehearsal (``make rehearse-e4b``): every figure at the scale the job runs at, with no download. The
decoder is the release's (``E4B_TEXT``: 42 layers, hidden 2560, vocabulary 262,144, per-layer width 256, 18 KV-shared
layers, tied head), stored in bf16 under ``model.language_model.*`` in sharded safetensors files with an index, beside
a multimodal ``config.json`` (``Gemma4ForConditionalGeneration``). The vision and audio towers are there by name,
one small layer each (the pipeline never reads them; the release's towers are about 1 GB more on disk). The tokenizer
has the release's 262,144 ids, with ``<pad>``, ``<eos>``, ``<bos>`` at 0, 1, 2 and the turn markers at 105 and 106, a
byte-level BPE trained on the shipped corpus and extended with merges up to the full vocabulary, and the tiny model's
Gemma-4 chat template.

Memory stays bounded whatever the size: each shard is written by hand (the safetensors header, then every tensor's
bytes in blocks of rows), so the per-layer embedding table (262,144 x 10,752 = 2.82 billion elements, more than 2^31)
is never whole in memory. The weights follow the tiny model's initialisation (pipeline/models/tiny_model.py) so
greedy choices are made by clear margins; each block of rows has its own seeded generator: same arguments, same bytes.

E2B's (``E2B_TEXT``: 35 layers in a period of five, hidden 1536, one KV head, 20 KV-shared layers with a double-wide
MLP) is one ``model.safetensors`` without an index, as the release stores it, and holds the release's unused K/V
projections of the KV-shared layers.

    python -m pipeline.models.e4b_shaped DIR [--model e4b|e2b] [--layers N]

Writes into DIR: ``config.json``, ``generation_config.json``, ``model-0000N-of-0000M.safetensors`` and
``model.safetensors.index.json`` (E4B) or ``model.safetensors`` (E2B), the tokenizer files and ``e4b_shaped.json``
(what made them).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.models.tiny_model import CHAT_TEMPLATE, TinyModelConfig, _generator, _init_tensor, unused_shared_kv_shapes

TEXT_PREFIX = "model.language_model."
SHARD_BYTES = 5 << 30  # the release's shards are about 5 GB
BLOCK_ELEMENTS = 32 << 20  # rows generated and written at a time: 64 MiB of bf16, 128 MiB of fp32 while made

# google/gemma-4-E4B-it's text decoder, as its config.json states it (tests/test_spec_and_plan.py reads the same).
E4B_TEXT = {
    "model_type": "gemma4_text",
    "vocab_size": 262144, "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 42,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
    "num_kv_shared_layers": 18, "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
    "use_double_wide_mlp": False, "sliding_window": 512, "final_logit_softcapping": 30.0,
    "attention_k_eq_v": False, "enable_moe_block": False, "hidden_activation": "gelu_pytorch_tanh",
    "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(42)],
    "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0,
}
# google/gemma-4-E2B-it's text decoder (docs/models.md): where it differs from E4B's.
E2B_TEXT = dict(
    E4B_TEXT, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_key_value_heads=1,
    num_kv_shared_layers=20, use_double_wide_mlp=True,
    layer_types=["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(35)])


@dataclass(frozen=True)
class Release:
    """One release's text decoder and how its checkpoint stores it."""

    text: dict
    period: int
    """Layers per repeat of the attention pattern (a cut keeps whole periods)."""
    shard_bytes: int | None
    """Files of about this size with an index (E4B), or None: one ``model.safetensors`` (E2B)."""
    unused_shared_kv: bool
    """The checkpoint keeps K/V projections of the KV-shared layers, which the model never uses (E2B's does)."""


RELEASES = {"e4b": Release(E4B_TEXT, 6, SHARD_BYTES, False), "e2b": Release(E2B_TEXT, 5, None, True)}
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
TURN_START_ID, TURN_END_ID = 105, 106  # <|turn> and <turn|>, where the release has them


@dataclass(frozen=True)
class Written:
    directory: Path
    shards: int
    weight_bytes: int
    seconds: float


def text_config(layers: int | None = None, model: str = "e4b") -> dict:
    """The release's text config, optionally cut to its first ``layers`` layers (the KV-shared ones cut in
    proportion)."""
    release = RELEASES[model]
    full = release.text["num_hidden_layers"]
    if layers is None or layers == full:
        return dict(release.text)
    if layers < 2 * release.period or layers % release.period:
        raise ValueError(f"--layers {layers}: use a multiple of {release.period} from {2 * release.period} (every "
                         f"{release.period}th layer is a full-attention one, and the KV-shared layers need one of each "
                         "kind before them)")
    shared = release.text["num_kv_shared_layers"] * layers // full
    return dict(release.text, num_hidden_layers=layers, num_kv_shared_layers=shared,
                layer_types=release.text["layer_types"][:layers])


def multimodal_config(text: dict):
    """The release's ``gemma4`` config nesting ``text``, with one-layer vision and audio towers."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4VisionConfig

    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version", "dtype")}
    vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=8, position_embedding_size=64)
    audio = Gemma4AudioConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=16)
    config = Gemma4Config(text_config=text, vision_config=vision.to_dict(), audio_config=audio.to_dict(),
                          tie_word_embeddings=True)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    return config


def release_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor transformers' own model stores, by name and shape, built on the meta device."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    with torch.device("meta"):
        model = Gemma4ForConditionalGeneration(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the token embedding, as in the release
    return shapes


# -- weights ----------------------------------------------------------------------------------------------------------

def tensor_blocks(name: str, shape: tuple[int, ...], cfg: TinyModelConfig):
    """The tensor ``name`` as bf16 blocks of rows, in order. Small tensors come whole from the tiny model's
    initialisation; large ones (the embedding tables) block by block with the same distribution."""
    import torch

    text_name = "model." + name.removeprefix(TEXT_PREFIX) if name.startswith(TEXT_PREFIX) else name
    numel = math.prod(shape)
    if not name.startswith(TEXT_PREFIX):
        yield (0.02 * torch.randn(shape, generator=_generator(cfg.seed, name))).to(torch.bfloat16)
        return
    if numel <= BLOCK_ELEMENTS or len(shape) != 2:
        yield _init_tensor(text_name, shape, cfg).to(torch.bfloat16)
        return
    rows, width = shape
    step = max(1, BLOCK_ELEMENTS // width)
    std = cfg.embedding_std / width**0.5 if "embed_tokens" in name else cfg.weight_gain / width**0.5
    for first in range(0, rows, step):
        block = std * torch.randn(min(step, rows - first), width, generator=_generator(cfg.seed, f"{name}@{first}"))
        if first == 0 and name.endswith("language_model.embed_tokens.weight"):
            # The tiny model's rule: small rows for the control tokens (0..106 here) keep a random model from
            # stopping early, so every validation prompt decodes its whole budget.
            block[:TURN_END_ID + 1] *= 0.01
        yield block.to(torch.bfloat16)


def write_shard(path: Path, tensors: dict[str, tuple[int, ...]], cfg: TinyModelConfig) -> int:
    """One safetensors file, written tensor by tensor and block by block (the format: an 8-byte little-endian header
    size, the JSON header with each tensor's byte range, then the data). Returns the data's bytes."""
    import torch

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape in tensors.items():
            written = 0
            for block in tensor_blocks(name, shape, cfg):
                data = block.contiguous().view(-1).view(torch.int16).numpy()  # bf16's bytes, as numpy has no bf16
                f.write(memoryview(data))
                written += data.nbytes
            if written != math.prod(shape) * 2:
                raise RuntimeError(f"{name}: wrote {written} bytes, expected {math.prod(shape) * 2}")
    tmp.replace(path)
    return offset


def plan_shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int = SHARD_BYTES) -> list[dict[str, tuple[int, ...]]]:
    """Tensors in name order, cut into files of about ``shard_bytes``."""
    shards, current, size = [], {}, 0
    for name in sorted(shapes):
        nbytes = math.prod(shapes[name]) * 2
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = shapes[name]
        size += nbytes
    return shards + [current] if current else shards


# -- the tokenizer ----------------------------------------------------------------------------------------------------

def special_tokens() -> list[str]:
    """Ids 0..106: the four basic ones, reserved ones, and the turn markers at the release's ids."""
    reserved = [f"<unused{i}>" for i in range(TURN_START_ID - 4)]
    return ["<pad>", "<eos>", "<bos>", "<unk>", *reserved, "<|turn>", "<turn|>"]


def build_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly ``vocab_size`` ids: trained on the shipped corpus, then extended with merges of
    the tokens it learned (deterministic), wrapped for ``transformers`` with the Gemma-4 chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.models.texts import corpus

    specials = special_tokens()
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    trained.train_from_iterator(corpus(), trainer)
    model = json.loads(trained.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    learned = sorted((t for t in vocab if t not in specials), key=vocab.__getitem__)
    # More ids: pairs of learned tokens, in a fixed order, each a merge of two tokens already in the vocabulary.
    for left in learned:
        for right in learned:
            if len(vocab) >= vocab_size:
                break
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                merges.append((left, right))
        if len(vocab) >= vocab_size:
            break
    if len(vocab) != vocab_size:
        raise RuntimeError(f"the tokenizer has {len(vocab)} ids, not {vocab_size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                      unk_token="<unk>")
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


# -- all of it --------------------------------------------------------------------------------------------------------

def write(out_dir: str | Path, layers: int | None = None, seed: int = 20261205, model: str = "e4b") -> Written:
    """The release-shaped checkpoint of ``model`` (``e4b`` or ``e2b``) in ``out_dir`` (created; files of an earlier
    run are replaced)."""
    from transformers import GenerationConfig

    started = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    release = RELEASES[model]
    text = text_config(layers, model)
    config = multimodal_config(text)
    cfg = TinyModelConfig(seed=seed, vocab_size=text["vocab_size"])
    shapes = release_shapes(config) | (unused_shared_kv_shapes(text, TEXT_PREFIX) if release.unused_shared_kv else {})
    if release.shard_bytes is None:  # one file, no index, as the release has it
        total, shards = write_shard(out / "model.safetensors", dict(sorted(shapes.items())), cfg), [shapes]
    else:
        shards = plan_shards(shapes, release.shard_bytes)
        weight_map, total = {}, 0
        for i, tensors in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            total += write_shard(out / name, tensors, cfg)
            weight_map.update(dict.fromkeys(tensors, name))
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, TURN_END_ID], pad_token_id=PAD_ID,
                     do_sample=False).save_pretrained(out)
    build_tokenizer(text["vocab_size"]).save_pretrained(out)
    took = time.monotonic() - started
    (out / "e4b_shaped.json").write_text(json.dumps(
        {"model": model, "layers": text["num_hidden_layers"], "seed": seed, "weight_bytes": total,
         "shards": len(shards)}, indent=2) + "\n")
    return Written(out, len(shards), total, took)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.models.e4b_shaped", description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--model", choices=sorted(RELEASES), default="e4b", help="the release whose shape to write")
    parser.add_argument("--layers", type=int, default=None,
                        help="fewer layers: a multiple of the attention period (6 for E4B, 5 for E2B) from two "
                             "periods (default: all of them, 42 for E4B, 35 for E2B)")
    parser.add_argument("--seed", type=int, default=20261205)
    args = parser.parse_args(argv)
    done = write(args.directory, args.layers, args.seed, args.model)
    print(f"wrote {done.weight_bytes / 1e9:.2f} GB of bf16 weights in {done.shards} files to {done.directory} "
          f"in {done.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
