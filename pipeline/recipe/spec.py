"""The architecture of a Gemma-4 text decoder, read from a checkpoint's ``config.json``.

``ModelSpec`` is the one description every other part of the recipe works from: layer types, head dimensions,
which layers produce a KV cache and which reuse another layer's, RoPE parameters, the embedding tables kept on the
host. Scalar settings and their defaults come from ``transformers``' own ``Gemma4TextConfig``; the per-layer head
sizes and the KV sharing are derived from the fields every supported transformers release has, exactly as the
installed one builds its model (the reference), and a config.json it would read differently is refused. Features the
recipe does not implement are refused here, with the key that asks for them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.errors import CheckpointError, UnsupportedModelError

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer type: ``inv_freq`` covers ``rotated_pairs`` pairs, the rest are zeros."""

    theta: float
    head_dim: int
    rotated_pairs: int
    factor: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    index: int
    layer_type: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    intermediate_size: int
    kv_source: int  # the layer whose KV cache this layer attends over; itself for a producer

    @property
    def is_producer(self) -> bool:
        return self.kv_source == self.index

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    hidden_size: int
    num_heads: int
    layers: tuple[LayerSpec, ...]
    sliding_window: int
    rms_norm_eps: float
    final_logit_softcapping: float | None
    ple_dim: int  # hidden_size_per_layer_input; 0 when the model has no per-layer embeddings
    ple_vocab_size: int
    tie_word_embeddings: bool
    ropes: dict[str, RopeSpec]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int
    max_positions: int | None = None
    """``max_position_embeddings``: the longest sequence the model was trained for (None: config.json gives none)."""

    def positions_problem(self, kv_max: int) -> str | None:
        """Why a cache of ``kv_max`` positions is beyond the model (None when it is not)."""
        if self.max_positions is None or kv_max <= self.max_positions:
            return None
        return (f"variant.kv_max={kv_max} is beyond the model's {self.max_positions} positions "
                f"(max_position_embeddings in its config.json): choose variant.kv_max={self.max_positions} or less")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def producers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.is_producer)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """The distinct layer types in a fixed order (a set's order would make traced graphs differ)."""
        return tuple(sorted({layer.layer_type for layer in self.layers}))

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5

    @property
    def ple_embed_scale(self) -> float:
        return self.ple_dim**0.5

    # -- checkpoint tensor layout (names relative to the text prefix, as in Gemma4TextModel) --------------------

    def text_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the recipe reads from the checkpoint, with its full (unsharded) shape."""
        h, p = self.hidden_size, self.ple_dim
        shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens.weight": (self.vocab_size, h),
            "norm.weight": (h,),
        }
        if p:
            shapes["embed_tokens_per_layer.weight"] = (self.ple_vocab_size, self.num_layers * p)
            shapes["per_layer_model_projection.weight"] = (self.num_layers * p, h)
            shapes["per_layer_projection_norm.weight"] = (p,)
        for layer in self.layers:
            pre = f"layers.{layer.index}."
            q_width = self.num_heads * layer.head_dim
            shapes[pre + "self_attn.q_proj.weight"] = (q_width, h)
            shapes[pre + "self_attn.q_norm.weight"] = (layer.head_dim,)
            shapes[pre + "self_attn.o_proj.weight"] = (h, q_width)
            if layer.is_producer:
                kv_width = layer.num_kv_heads * layer.head_dim
                shapes[pre + "self_attn.k_proj.weight"] = (kv_width, h)
                shapes[pre + "self_attn.v_proj.weight"] = (kv_width, h)
                shapes[pre + "self_attn.k_norm.weight"] = (layer.head_dim,)
            shapes[pre + "mlp.gate_proj.weight"] = (layer.intermediate_size, h)
            shapes[pre + "mlp.up_proj.weight"] = (layer.intermediate_size, h)
            shapes[pre + "mlp.down_proj.weight"] = (h, layer.intermediate_size)
            for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                shapes[pre + norm + ".weight"] = (h,)
            shapes[pre + "layer_scalar"] = (1,)
            if p:
                shapes[pre + "per_layer_input_gate.weight"] = (p, h)
                shapes[pre + "per_layer_projection.weight"] = (h, p)
                shapes[pre + "post_per_layer_input_norm.weight"] = (h,)
        return shapes

    def ignorable_text_tensors(self) -> set[str]:
        """Tensors some checkpoints carry that the model never uses (KV projections of KV-shared layers)."""
        names = set()
        for layer in self.layers:
            if not layer.is_producer:
                for part in ("k_proj.weight", "v_proj.weight", "k_norm.weight", "v_norm.weight"):
                    names.add(f"layers.{layer.index}.self_attn.{part}")
        return names


# -- parsing -----------------------------------------------------------------------------------------------------

_UNSUPPORTED = {
    # key: (value that is supported, why)
    "attention_k_eq_v": (False, "keys doubling as values"),
    "enable_moe_block": (False, "mixture-of-experts blocks"),
    "use_bidirectional_attention": (None, "bidirectional attention"),
    "attention_bias": (False, "biased attention projections"),
    "hidden_activation": ("gelu_pytorch_tanh", "activations other than tanh-GELU"),
}


def text_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: ``text_config`` of a multimodal checkpoint, or the whole file of a text one."""
    model_type = config.get("model_type")
    if model_type == "gemma4":
        if not isinstance(config.get("text_config"), dict):
            raise CheckpointError("config.json has model_type 'gemma4' but no 'text_config' section")
        text = dict(config["text_config"])
        # A multimodal config keeps tie_word_embeddings at the top level; the text section may omit it.
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", True))
        return text
    if model_type == "gemma4_text":
        return dict(config)
    raise UnsupportedModelError(
        f"config.json has model_type {model_type!r}; the recipe builds Gemma-4 text decoders "
        "('gemma4' or 'gemma4_text'). Point model.path or model.hub_id at a Gemma-4 checkpoint."
    )


def load_spec(checkpoint_dir: str | Path) -> ModelSpec:
    """Read ``config.json`` (and ``generation_config.json`` for the stop tokens) of a checkpoint directory."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {checkpoint_dir}: is model.path a Hugging Face checkpoint directory?")
    config = json.loads(path.read_text())
    generation = {}
    if (checkpoint_dir / "generation_config.json").is_file():
        generation = json.loads((checkpoint_dir / "generation_config.json").read_text())
    return spec_from_config(config, generation)


def spec_from_config(config: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelSpec:
    raw = text_config_dict(config)
    check_supported(raw)
    hf = hf_text_config(raw)
    layers = layer_specs(raw, hf)
    return ModelSpec(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_heads=hf.num_attention_heads,
        layers=layers,
        sliding_window=hf.sliding_window,
        rms_norm_eps=hf.rms_norm_eps,
        final_logit_softcapping=hf.final_logit_softcapping,
        ple_dim=hf.hidden_size_per_layer_input or 0,
        ple_vocab_size=hf.vocab_size_per_layer_input,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", hf.tie_word_embeddings)),
        ropes=rope_specs(hf, layers),
        eos_token_ids=eos_token_ids(generation or {}, hf),
        bos_token_id=hf.bos_token_id,
        pad_token_id=hf.pad_token_id if hf.pad_token_id is not None else 0,
        max_positions=getattr(hf, "max_position_embeddings", None),
    )


def check_supported(raw: dict[str, Any]) -> None:
    """Refuse a text config that sets a feature the recipe does not implement."""
    for key, (supported, what) in _UNSUPPORTED.items():
        if raw.get(key, supported) != supported:
            raise UnsupportedModelError(
                f"config.json sets {key}={raw[key]!r}: the recipe does not implement {what}. "
                "Build a Gemma-4 E2B/E4B-style checkpoint, or extend pipeline/recipe/model.py."
            )


def layer_specs(raw: dict[str, Any], hf) -> tuple[LayerSpec, ...]:
    """Each decoder layer's attention type, head shape, MLP width and the layer whose KV cache it attends over."""
    layer_types = list(hf.layer_types)
    # The base sizes as given, else the class's defaults (5.15+ refuse to read per-layer attributes off the config).
    base = {key: int(raw.get(key, getattr(type(hf), key))) for key in ("head_dim", "num_key_value_heads")}
    shapes = layer_shapes(raw, layer_types, base["head_dim"], base["num_key_value_heads"])
    shared = kv_shared_layers(hf.num_hidden_layers, hf.num_kv_shared_layers, layer_types)
    layers = []
    for i, layer_type in enumerate(layer_types):
        if layer_type not in (SLIDING, FULL):
            raise UnsupportedModelError(f"config.json layer_types[{i}] is {layer_type!r}; expected {SLIDING} or {FULL}")
        if shared[i]:
            # A KV-shared layer attends over the cache of the last non-shared layer of its type (transformers'
            # store_full_length_kv layer).
            source = max(j for j in range(len(layer_types)) if not shared[j] and layer_types[j] == layer_type)
        else:
            source = i
        head_dim, kv_heads = shapes[i]
        layers.append(LayerSpec(
            index=i,
            layer_type=layer_type,
            head_dim=head_dim,
            num_kv_heads=kv_heads,
            intermediate_size=hf.intermediate_size * (2 if hf.use_double_wide_mlp and shared[i] else 1),
            kv_source=source,
        ))
    for layer in layers:
        src = layers[layer.kv_source]
        if (src.head_dim, src.num_kv_heads) != (layer.head_dim, layer.num_kv_heads):
            raise UnsupportedModelError(
                f"layer {layer.index} reuses layer {src.index}'s KV but their head shapes differ")
    return tuple(layers)


def rope_specs(hf, layers: tuple[LayerSpec, ...]) -> dict[str, RopeSpec]:
    """The rotary embedding of each attention type, over that type's head size."""
    ropes = {}
    for layer_type in sorted({layer.layer_type for layer in layers}):
        params = hf.rope_parameters[layer_type]
        rope_type = params.get("rope_type", "default")
        head_dim = next(layer.head_dim for layer in layers if layer.layer_type == layer_type)
        if rope_type == "default":
            pairs = head_dim // 2
        elif rope_type == "proportional":
            pairs = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        else:
            raise UnsupportedModelError(f"rope_parameters.{layer_type}.rope_type={rope_type!r} is not implemented")
        ropes[layer_type] = RopeSpec(theta=float(params["rope_theta"]), head_dim=head_dim, rotated_pairs=pairs,
                                     factor=float(params.get("factor", 1.0)) if rope_type != "default" else 1.0)
    return ropes


def eos_token_ids(generation: dict[str, Any], hf) -> tuple[int, ...]:
    """The tokens that end a generation: generation_config.json's, else the model config's."""
    eos = generation.get("eos_token_id", hf.eos_token_id)
    return tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())


def rope_inv_freq(rope: RopeSpec):
    """Inverse frequencies, computed with the same operations as transformers' default/proportional RoPE."""
    import torch

    if rope.rotated_pairs == rope.head_dim // 2 and rope.factor == 1.0:
        return 1.0 / (rope.theta ** (torch.arange(0, rope.head_dim, 2, dtype=torch.float) / rope.head_dim))
    steps = torch.arange(0, 2 * rope.rotated_pairs, 2, dtype=torch.int64).to(dtype=torch.float)
    rotated = 1.0 / (rope.theta ** (steps / rope.head_dim))
    unrotated = torch.zeros(rope.head_dim // 2 - rope.rotated_pairs, dtype=torch.float32)
    return torch.cat((rotated, unrotated)) / rope.factor


def is_power_of_two(n: int) -> bool:
    return n > 0 and math.log2(n).is_integer()


# -- reading the config the same way under every transformers release the pipeline supports ----------------------
#
# transformers 5.13 and 5.14 read a full-attention layer's head size from ``global_head_dim`` (default 512); 5.15 and
# later read ``per_layer_config`` (written into config.json by them; derived from ``global_head_dim`` when absent).
# 5.23 added ``Gemma4TextConfig.kv_sharing_modes``; every release makes the last ``num_kv_shared_layers`` layers
# reuse the cache of the last earlier layer of their type. (Read from each release's configuration_gemma4.py and
# modeling_gemma4.py.) The recipe derives all of it from the fields every release has, and refuses a config.json
# the installed transformers would read differently from what it says.
PER_LAYER_CONFIG_SINCE = "5.15.0"
DEFAULT_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's default in every release


def hf_text_config(raw: dict[str, Any]):
    """transformers' own ``Gemma4TextConfig`` of ``raw`` (its defaults, its checks), or a refusal naming the
    installed version when this transformers cannot read it."""
    try:
        from transformers import Gemma4TextConfig
    except ImportError as exc:
        raise CheckpointError(f"transformers {installed_transformers()} has no Gemma-4 support ({exc}): install "
                              f"the supported range, pip install 'transformers{supported_transformers()}'") from None
    try:
        return Gemma4TextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"config.json does not describe a Gemma-4 text decoder that transformers "
                              f"{installed_transformers()} can read: {exc}") from exc


def installed_transformers() -> str:
    import importlib.metadata

    return importlib.metadata.version("transformers")


def supported_transformers() -> str:
    from pipeline.core.versions import supported

    return str(supported("transformers"))


def reads_per_layer_config() -> bool:
    from packaging.version import Version

    return Version(installed_transformers()) >= Version(PER_LAYER_CONFIG_SINCE)


def layer_shapes(raw: dict[str, Any], layer_types: list[str], head_dim: int, kv_heads: int) -> list[tuple[int, int]]:
    """``(head_dim, num_key_value_heads)`` of every layer, as the installed transformers builds them (``head_dim``
    and ``kv_heads``: the config's base values, with transformers' defaults)."""
    global_head_dim = raw.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)
    by_global = [(int(global_head_dim) if t == FULL and global_head_dim else head_dim, kv_heads) for t in layer_types]
    per_layer = raw.get("per_layer_config")
    if not per_layer:
        return by_global
    # transformers writes the layer indices zero-padded to one width ("05" of 12 layers, "05" ... "41" of E4B's 42) and
    # reads them back with int() (integrations/heterogeneity/configuration_utils.py, 5.24): so do we.
    by_index = {int(k): v for k, v in per_layer.items()}
    said = []  # what config.json says: per_layer_config overrides the base head_dim / num_key_value_heads
    for i in range(len(layer_types)):
        override = by_index.get(i) or {}
        said.append((int(override.get("head_dim") or head_dim), int(override.get("num_key_value_heads") or kv_heads)))
    if reads_per_layer_config():
        return said
    if said != by_global:
        differ = [i for i, (a, b) in enumerate(zip(said, by_global)) if a != b]
        raise CheckpointError(
            f"config.json sets per_layer_config (head sizes of layers {differ[:6]}), which transformers "
            f"{installed_transformers()} does not read (it takes global_head_dim, default {DEFAULT_GLOBAL_HEAD_DIM}, "
            f"and reads per_layer_config from {PER_LAYER_CONFIG_SINCE} on): its float reference would not be this "
            f"model. Install a newer transformers: pip install 'transformers>={PER_LAYER_CONFIG_SINCE},<6'")
    return by_global


def kv_shared_layers(num_layers: int, num_kv_shared: int, layer_types: list[str]) -> list[bool]:
    """Which layers reuse an earlier layer's KV cache: the last ``num_kv_shared_layers`` (every release)."""
    if not 0 <= num_kv_shared < num_layers:
        raise UnsupportedModelError(
            f"config.json sets num_kv_shared_layers={num_kv_shared} of {num_layers} layers: the recipe needs at least "
            "one layer that computes its own KV cache (a checkpoint sharing every layer's cache is a draft model "
            "for another one's caches)")
    first = num_layers - num_kv_shared
    shared = [i >= first for i in range(num_layers)]
    missing = sorted({t for i, t in enumerate(layer_types) if shared[i]} - set(layer_types[:first]))
    if missing:
        raise UnsupportedModelError(f"config.json: KV-shared layers of type {missing} have no earlier layer of their "
                                    "type to take a cache from")
    return shared
