"""The host side of the recipe: embedding lookups, and the model that prefills for host-prefill variants.

The token and per-layer embedding tables never go to a rank (E4B's per-layer table alone is 5.6 GB in bf16); the
host reads only the rows of the tokens it embeds. For ``prefill=host`` the prompt runs through the recipe's own
model on the host (one rank, at the variant's dtype, as a device-prefill build prefills on its ranks), and its KV
caches seed the ranks: KV head ``r`` goes to rank ``r``. At the variant's dtype, not fp32: E4B's decoder is 18.9 GB
in fp32, more than an inf2.xlarge's 16 GiB and, beside the two ranks, more than a 24 GiB machine; in bf16 it is 9.5 GB.
"""

from __future__ import annotations

import torch

from pipeline.recipe.checkpoint import Checkpoint
from pipeline.recipe.model import StatefulRank, build_rank
from pipeline.recipe.parallel import Parallel
from pipeline.recipe.plan import ShardPlan, kv_head_start, kv_heads_split, load_rank_state, rank_kv_heads
from pipeline.recipe.spec import ModelSpec

TOKEN_TABLE = "embed_tokens.weight"
PER_LAYER_TABLE = "embed_tokens_per_layer.weight"
EMBEDDING_TABLES = (TOKEN_TABLE, PER_LAYER_TABLE)  # what the host reads; every other tensor lives on the ranks


class HostEmbeddings:
    """Looks up token embeddings (scaled by sqrt(hidden)) and per-layer token embeddings (scaled by sqrt(ple_dim))."""

    def __init__(self, checkpoint: Checkpoint, spec: ModelSpec):
        self.checkpoint = checkpoint
        self.spec = spec

    def __call__(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        bad = [t for t in token_ids if not 0 <= t < spec.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary of {spec.vocab_size}")
        rows = self.checkpoint.read_rows(TOKEN_TABLE, spec, list(token_ids)).float()
        embeds = (rows * spec.embed_scale).view(1, len(token_ids), spec.hidden_size)
        if not spec.ple_dim:
            return embeds, torch.zeros(0)
        ple_ids = [t if t < spec.ple_vocab_size else spec.pad_token_id for t in token_ids]
        ple_rows = self.checkpoint.read_rows(PER_LAYER_TABLE, spec, ple_ids).float()
        per_layer = (ple_rows * spec.ple_embed_scale).view(1, len(token_ids), spec.num_layers, spec.ple_dim)
        return embeds, per_layer


class HostPrefill:
    """The recipe's model on the host (one rank, at ``dtype``: the variant's): prefills a prompt and hands out its KV
    caches."""

    def __init__(self, checkpoint: Checkpoint, spec: ModelSpec, kv_max: int, dtype: torch.dtype):
        plan = ShardPlan(spec, 1)
        state = load_rank_state(checkpoint, plan, 0, dtype)
        self.model: StatefulRank = build_rank(spec, plan, Parallel(1), kv_max, dtype, state)
        self.embed = HostEmbeddings(checkpoint, spec)
        self.spec = spec

    @torch.no_grad()
    def prefill(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Logits and greedy token after the last prompt token, and the caches (``cache_names()`` order)."""
        for buf in self.model.decoder.caches():
            buf.zero_()
        embeds, per_layer = self.embed(token_ids)
        positions = torch.arange(len(token_ids)).view(1, -1)
        last = torch.tensor([len(token_ids) - 1])
        logits, token = self.model.prefill(embeds, per_layer, positions, last)
        return logits, token, [buf.clone() for buf in self.model.decoder.caches()]


def split_kv_for_ranks(caches: list[torch.Tensor], tp_degree: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Slice full-head caches ``[1, kv_heads, kv_max, d]`` into each rank's heads, as the rank's k/v projections are
    split (pipeline/recipe/plan.py): rank r gets heads ``[r * kv_heads / tp, (r + 1) * kv_heads / tp)``, or, with
    fewer heads than ranks, a copy of head ``r * kv_heads // tp``."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(tp_degree)]
    for cache in caches:
        heads = cache.shape[1]
        if not kv_heads_split(heads, tp_degree):
            raise ValueError(f"{heads} KV heads neither split over nor copy onto tp_degree={tp_degree} ranks")
        width = rank_kv_heads(heads, tp_degree)
        for rank in range(tp_degree):
            start = kv_head_start(heads, tp_degree, rank)
            per_rank[rank].append(cache[:, start:start + width].to(dtype).contiguous())
    return per_rank
