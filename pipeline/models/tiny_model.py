"""The embedded default model: a tiny Gemma-4 text checkpoint generated locally and deterministically.

It is a real ``transformers`` checkpoint (``Gemma4TextConfig`` / ``Gemma4ForCausalLM``, safetensors) with a
tokenizer trained here on the shipped corpus and a Gemma-4 style chat template, so every stage runs on it exactly as
on the real E4B. Its configuration exercises every E4B mechanism at toy size: per-layer embeddings, sliding and full
attention layers with different head sizes, a sliding window shorter than the test prompts, KV-shared layers, two KV
heads under four query heads, a final logit soft-cap and tied embeddings. It takes E2B's shape too
(``use_double_wide_mlp``, one KV head, a period of five layers, the unused K/V of the KV-shared layers:
tests/helpers.py ``E2B_SHAPE``). Its ``layer_scalar`` buffers are not 1, so a loader that copies parameters only
produces a visibly different model.

Writes into the target directory: ``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``. Same configuration, same bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID, TURN_START_ID, TURN_END_ID = range(len(SPECIAL_TOKENS))

# Gemma-4's turn format (<|turn>role ... <turn|>), written for this project.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\n' + (message['content'] | trim) + '<turn|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}"
)


@dataclass
class TinyModelConfig:
    """Architecture of the generated model. Its defaults are the embedded model, written only here: the pipeline (the
    model conf adds nothing) and the tests build the same one; tests may shrink or reshape it."""

    seed: int = 20261130
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    global_head_dim: int = 64
    num_kv_shared_layers: int = 3
    sliding_window: int = 16
    hidden_size_per_layer_input: int = 16
    layer_types: list[str] = field(default_factory=lambda: [
        "sliding_attention", "sliding_attention", "sliding_attention", "full_attention",
        "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
    final_logit_softcapping: float = 30.0
    max_position_embeddings: int = 4096
    # E2B's MLP: the KV-shared layers twice as wide (transformers' Gemma4TextMLP). Off by default, and then absent from
    # config.json, so that the embedded model's bytes are what they were before E2B's shape could be asked for.
    use_double_wide_mlp: bool = False
    # The E2B release's checkpoint still carries k_proj/v_proj/k_norm of its KV-shared layers, which the model never
    # uses (transformers builds no such modules and skips them at load): true writes them too, so that CI reads past
    # them as a build of the release must.
    unused_shared_kv: bool = False
    # Standard deviation of the projections is weight_gain / sqrt(fan_in); large enough that greedy choices are
    # decided by clear margins (bf16 parity would mean nothing on near-ties), small enough not to saturate the cap.
    weight_gain: float = 0.5
    embedding_std: float = 2.0
    # (low, high) of the layer_scalar buffers; a list, as the config schema hands it back, so that the composed
    # config's model.tiny equals TinyModelConfig().
    layer_scalar_range: list[float] = field(default_factory=lambda: [0.4, 0.9])
    # The final norm's scale sets the spread of the logits (the head is tied to the input embedding, whose scale
    # must stay comparable to the layers' outputs or the model would ignore its context).
    final_norm_scale: float = 2.5


def hf_text_config(cfg: TinyModelConfig) -> dict:
    """The ``config.json`` content (before transformers adds its defaults)."""
    e2b = {"use_double_wide_mlp": True} if cfg.use_double_wide_mlp else {}
    return e2b | {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "global_head_dim": cfg.global_head_dim,
        "num_kv_shared_layers": cfg.num_kv_shared_layers,
        "sliding_window": cfg.sliding_window,
        "hidden_size_per_layer_input": cfg.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": cfg.vocab_size,
        "layer_types": list(cfg.layer_types),
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "pad_token_id": PAD_ID,
        "eos_token_id": [EOS_ID, TURN_END_ID],
        "bos_token_id": BOS_ID,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
    }


def _generator(seed: int, name: str):
    import torch

    # One generator per tensor, seeded from its name: the bytes never depend on module construction order.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _init_tensor(name: str, shape: tuple[int, ...], cfg: TinyModelConfig):
    import torch

    gen = _generator(cfg.seed, name)
    if name.endswith("layer_scalar"):
        low, high = cfg.layer_scalar_range
        return low + (high - low) * torch.rand(shape, generator=gen)
    if "norm" in name:
        # Norm scales near 1 with visible variation, so a mis-mapped norm changes the output.
        scale = 1.0
        if name == "model.norm.weight":
            scale = cfg.final_norm_scale
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            # Gemma-4 attends with scaling 1.0: the q/k norm scales set the attention temperature. d**-0.25 each
            # gives scores of unit spread, as in a trained model; 1.0 would make attention brittle (near one-hot).
            scale = shape[0] ** -0.25
        return scale * (1.0 + 0.2 * torch.randn(shape, generator=gen))
    if name.endswith("embed_tokens.weight") or name.endswith("embed_tokens_per_layer.weight"):
        width = shape[1]
        weight = cfg.embedding_std / width**0.5 * torch.randn(shape, generator=gen)
        if name.endswith("embed_tokens.weight"):
            # Tied head: tiny rows for the stop and control tokens keep their logits near 0, so a random model never
            # stops early and every validation prompt produces its full budget of new tokens.
            weight[list(range(len(SPECIAL_TOKENS)))] *= 0.01
        return weight
    fan_in = shape[1]
    return cfg.weight_gain / fan_in**0.5 * torch.randn(shape, generator=gen)


def unused_shared_kv_shapes(text: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """The K/V projections and key norm of each KV-shared layer of the text config ``text`` (``hf_text_config``'s
    keys), shaped as a producer's, under ``prefix``: what E2B's checkpoint holds beyond transformers' model (which
    builds no such modules and skips them at load)."""
    shapes = {}
    layers, hidden = text["num_hidden_layers"], text["hidden_size"]
    for index in range(layers - text["num_kv_shared_layers"], layers):
        full = text["layer_types"][index] == "full_attention"
        head_dim = text["global_head_dim"] if full and text.get("global_head_dim") else text["head_dim"]
        width = text["num_key_value_heads"] * head_dim
        pre = f"{prefix}layers.{index}.self_attn."
        shapes.update({pre + "k_proj.weight": (width, hidden), pre + "v_proj.weight": (width, hidden),
                       pre + "k_norm.weight": (head_dim,)})
    return shapes


def _add_unused_shared_kv(weights: Path, cfg: TinyModelConfig) -> None:
    """Add to ``weights`` the K/V projections and key norm of every KV-shared layer (``unused_shared_kv_shapes``)."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(weights)
    for name, shape in unused_shared_kv_shapes(hf_text_config(cfg), "model.").items():
        state[name] = _init_tensor(name, shape, cfg).to(torch.float32)
    save_file(state, weights, metadata={"format": "pt"})


def build_tokenizer(cfg: TinyModelConfig):
    """A byte-level BPE tokenizer trained on the shipped corpus, wrapped for ``transformers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.models.texts import corpus

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def generate(cfg: TinyModelConfig, out_dir: str | Path) -> Path:
    """Write the tiny checkpoint into ``out_dir`` (created; existing files are overwritten)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = hf_text_config(cfg)
    config = Gemma4TextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config.architectures = raw["architectures"]
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    state = {}
    for name, tensor in sorted(model.state_dict().items()):
        if name == "lm_head.weight":
            continue  # tied to model.embed_tokens.weight
        state[name] = _init_tensor(name, tuple(tensor.shape), cfg).to(torch.float32)
    model = Gemma4ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(m != "lm_head.weight" for m in missing):
        raise RuntimeError(f"tiny model init does not match Gemma4ForCausalLM: missing={missing} "
                           f"unexpected={unexpected}")
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    if cfg.unused_shared_kv:
        _add_unused_shared_kv(out_dir / "model.safetensors", cfg)
    GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, TURN_END_ID], pad_token_id=PAD_ID, do_sample=False,
    ).save_pretrained(out_dir)
    build_tokenizer(cfg).save_pretrained(out_dir)
    (out_dir / MARKER).write_text(json.dumps(asdict(cfg), indent=2, sort_keys=True) + "\n")
    return out_dir


MARKER = "tiny_model.json"  # written beside the tiny checkpoint's files: what it was generated from
MEANINGLESS = ("the embedded tiny Gemma-4 (random weights, toy widths): its text is meaningless by design; what the "
               "demo shows is that the build decodes token for token what the CPU reference does. model=gemma4_e4b "
               "builds the real model")


def is_tiny(checkpoint: Path) -> bool:
    """Is ``checkpoint`` the generated tiny model (whose text means nothing)?"""
    return (Path(checkpoint) / MARKER).is_file()
