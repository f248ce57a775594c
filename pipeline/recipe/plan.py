"""How the decoder's tensors are split across tensor-parallel ranks, and what each rank loads.

Column-parallel (split by output rows): q/k/v projections (by head, so rank r owns query heads
``[r*h/tp, (r+1)*h/tp)`` and KV heads ``[r*kv/tp, (r+1)*kv/tp)``, which keeps Gemma's grouped-query mapping intact),
gate and up projections, and the tied output head (by vocabulary; its logits are gathered). A model with fewer KV
heads than ranks (E2B: one, at tp_degree 2) copies them instead: rank r holds KV head ``r*kv//tp``, the one its query
heads attend (NxD-Inference's ``REPLICATE_TO_TP_DEGREE``; the seed's E2B build at TP=2 copies its head to both cores),
and every rank keeps a cache of its own copy. ``tp_degree`` must then be a multiple of the KV heads. Row-parallel
(split by input columns, summed with an all-reduce before Gemma's post-norms): o and down projections. Everything else
is replicated. The token and per-layer embedding tables stay on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.core.errors import CheckpointError, ConfigError
from pipeline.recipe.checkpoint import HEAD, Checkpoint
from pipeline.recipe.spec import LayerSpec, ModelSpec

COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
ROW = ("o_proj.weight", "down_proj.weight")
KV_PROJECTIONS = ("k_proj.weight", "v_proj.weight")
HOST_ONLY = ("embed_tokens.weight", "embed_tokens_per_layer.weight")  # looked up on the host, never on a rank
FP32_SUFFIXES = ("norm.weight", "layer_scalar")  # small tensors kept in fp32 whatever the variant's dtype


@dataclass(frozen=True)
class ShardPlan:
    spec: ModelSpec
    tp_degree: int

    def check(self) -> None:
        """Refuse a tensor-parallel degree the model cannot be split by, naming the setting and the fix."""
        spec, tp = self.spec, self.tp_degree
        problems = []
        if tp < 1:
            problems.append(f"variant.tp_degree={tp} must be at least 1")
        else:
            if spec.num_heads % tp:
                problems.append(f"variant.tp_degree={tp} does not divide num_attention_heads={spec.num_heads}")
            for kv in sorted({layer.num_kv_heads for layer in spec.layers}):
                if not kv_heads_split(kv, tp):
                    problems.append(f"variant.tp_degree={tp} neither divides num_key_value_heads={kv} nor is a "
                                    "multiple of it (fewer KV heads than ranks are copied, whole)")
            for size in sorted({layer.intermediate_size for layer in spec.layers}):
                if size % tp:
                    problems.append(f"variant.tp_degree={tp} does not divide intermediate_size={size}")
        if problems:
            divisors = [d for d in range(1, spec.num_heads + 1)
                        if spec.num_heads % d == 0 and all(kv_heads_split(layer.num_kv_heads, d)
                                                           for layer in spec.layers)
                        and all(layer.intermediate_size % d == 0 for layer in spec.layers)]
            raise ConfigError([p + f" (choose variant.tp_degree from {divisors})" for p in problems])

    @property
    def shards_vocab(self) -> bool:
        """The output head is split by vocabulary when it divides evenly; otherwise every rank holds all of it."""
        return self.spec.vocab_size % self.tp_degree == 0

    def split(self, name: str) -> int | None:
        """The dimension ``name`` is split along on each rank, or None when replicated."""
        if self.tp_degree == 1:
            return None
        if name.endswith(COLUMN):
            return 0
        if name.endswith(ROW):
            return 1
        if name == HEAD and self.shards_vocab:
            return 0
        return None

    def rank_tensor_names(self) -> list[str]:
        """Every tensor a rank holds (recipe names: text-relative, and ``lm_head.weight``)."""
        names = [n for n in self.spec.text_tensor_shapes() if n not in HOST_ONLY]
        return sorted(names) + [HEAD]

    def full_shape(self, name: str) -> tuple[int, ...]:
        if name == HEAD:
            return (self.spec.vocab_size, self.spec.hidden_size)
        return self.spec.text_tensor_shapes()[name]

    def copied_kv_layer(self, name: str) -> LayerSpec | None:
        """The layer of ``name`` when it is a K/V projection whose heads are copied (fewer KV heads than ranks)."""
        if self.tp_degree == 1 or not name.endswith(KV_PROJECTIONS):
            return None
        layer = self.spec.layers[int(name.split(".")[1])]  # layers.<i>.self_attn.{k,v}_proj.weight
        return layer if layer.num_kv_heads < self.tp_degree else None

    def rank_shape(self, name: str) -> tuple[int, ...]:
        shape = list(self.full_shape(name))
        dim, copied = self.split(name), self.copied_kv_layer(name)
        if copied is not None:
            shape[0] = copied.head_dim  # one whole head
        elif dim is not None:
            shape[dim] //= self.tp_degree
        return tuple(shape)

    def rank_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the tensors one rank holds at ``dtype`` (the small fp32 tensors at fp32): what the preflight's
        memory and disk needs scale with."""
        return sum(math.prod(self.rank_shape(name)) * tensor_dtype(name, dtype).itemsize
                   for name in self.rank_tensor_names())

    def largest_tensor_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the largest tensor one rank holds at ``dtype`` (E4B at tp_degree 2: its head shard, 0.67 GB in
        bf16): what rewriting a rank file record by record holds at once (pipeline/backends/torchscript.py)."""
        return max(math.prod(self.rank_shape(name)) * tensor_dtype(name, dtype).itemsize
                   for name in self.rank_tensor_names())

    def rank_kv_bytes(self, kv_max: int, batch_size: int, dtype: torch.dtype) -> int:
        """Bytes of one rank's KV caches, as pipeline/recipe/model.py ``RankDecoder`` registers them: a key and a value
        tensor per producer layer, ``[batch_size, rank_kv_heads, kv_max, head_dim]`` at ``dtype`` (a copied head
        counted on every rank that holds it)."""
        return sum(2 * batch_size * rank_kv_heads(layer.num_kv_heads, self.tp_degree) * kv_max * layer.head_dim
                   * dtype.itemsize for layer in self.spec.producers)

    def rank_range(self, name: str, rank: int) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of rank ``rank``'s part of ``name``, or None when replicated."""
        dim = self.split(name)
        if dim is None:
            return None
        layer = self.copied_kv_layer(name)
        if layer is not None:
            start = kv_head_start(layer.num_kv_heads, self.tp_degree, rank) * layer.head_dim
            return 0, start, start + layer.head_dim
        width = self.full_shape(name)[dim] // self.tp_degree
        return dim, rank * width, (rank + 1) * width

    def builder_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``name``'s full tensor as a builder that cuts every column-parallel weight into ``tp_degree`` equal chunks
        (neuronx-distributed's ModelBuilder) must be given it: a copied K/V projection's heads each repeated
        ``tp_degree / kv_heads`` times, so that chunk r is rank r's head; every other tensor as it is."""
        layer = self.copied_kv_layer(name)
        if layer is None:
            return tensor
        copies = self.tp_degree // layer.num_kv_heads
        heads = tensor.view(layer.num_kv_heads, layer.head_dim, -1)
        return heads.repeat_interleave(copies, dim=0).reshape(self.tp_degree * layer.head_dim, -1)


def kv_heads_split(kv_heads: int, tp_degree: int) -> bool:
    """Can ``kv_heads`` KV heads be laid over ``tp_degree`` ranks: split evenly, or (fewer) each copied whole?"""
    return kv_heads % tp_degree == 0 or tp_degree % kv_heads == 0


def rank_kv_heads(kv_heads: int, tp_degree: int) -> int:
    """KV heads one rank holds: its share, or one copied head when there are fewer heads than ranks."""
    return max(1, kv_heads // tp_degree)


def kv_head_start(kv_heads: int, tp_degree: int, rank: int) -> int:
    """The first KV head rank ``rank`` holds: that of its query heads in both cases (query head j attends KV head
    ``j // (heads / kv_heads)``, and rank r's query heads start at ``r * heads / tp_degree``)."""
    return rank * kv_heads // tp_degree


def tensor_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_SUFFIXES) else dtype


def load_rank_state(checkpoint: Checkpoint, plan: ShardPlan, rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors, sliced straight from the safetensors files; the full model is never materialised."""
    if not 0 <= rank < plan.tp_degree:
        raise ValueError(f"rank {rank} outside tp_degree {plan.tp_degree}")
    state = {}
    for name in plan.rank_tensor_names():
        found = checkpoint.shape(name, plan.spec)
        if found != plan.full_shape(name):
            raise CheckpointError(
                f"tensor {checkpoint.key(name, plan.spec)!r} has shape {list(found)}, "
                f"expected {list(plan.full_shape(name))}")
        part = plan.rank_range(name, rank)
        if part is None:
            tensor = checkpoint.read(name, plan.spec)
        else:
            tensor = checkpoint.read(name, plan.spec, *part)
        state[name] = tensor.to(tensor_dtype(name, dtype))
    return state
