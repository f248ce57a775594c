"""One tensor-parallel rank of the Gemma-4 text decoder, written once for every backend.

``RankDecoder.step`` runs ``S`` tokens (a prefill bucket, or one decode token) whose embeddings were looked up on the
host, writes their keys and values into the resident KV caches with the one-hot masked update
``cache * (1 - onehot) + k * onehot``, attends, and returns the fp32 logits of one selected position, its greedy
token, and the updated caches (a backend either writes them back in place or aliases them to the graph's inputs).

Shapes are static: the caches hold ``kv_max`` positions, attention always spans all of them, and the masks (causal,
and the sliding window for sliding layers) are computed in the graph from the position ids, so one traced graph
serves every position. Only KV-producer layers own caches; KV-shared layers attend over their producer's cache.

Batch. The caches hold ``batch_size`` sequences (cache lines). At batch 1 a step is one sequence's, exactly the graph
every batch-1 build has always had. Above it every entry point takes a fifth input, ``seq_ids`` (NxDI's name): a
decode step runs one token of every line (``[batch, 1]`` tokens, each at a position of its own, each row masked by its
own position), and a line whose ``seq_ids`` entry is not its own index (-1: no sequence there) writes nothing; a
prefill step runs one sequence's bucket (``[1, S]``) into the line ``seq_ids[0]`` names and attends over that line
only, leaving the others' bytes untouched. Line selection is one-hot arithmetic, as the cache write is: no scatter,
no data-dependent indexing. Rows never mix: a row's logits and cache depend on that row alone.

Numerics. ``dtype`` is the weights', the matmuls' and the KV caches' type. The residual stream, norms, RoPE, softmax,
row-parallel reductions and logits stay in fp32: with bf16 weights this keeps the error of a deep stack from
compounding in the residual path. In fp32 every operation follows ``transformers``' Gemma-4 in the same order, so
the two agree to float rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.recipe.parallel import Parallel
from pipeline.recipe.plan import ShardPlan, rank_kv_heads
from pipeline.recipe.spec import LayerSpec, ModelSpec, rope_inv_freq

GELU_TANH_COEFF = 0.7978845608028654  # sqrt(2 / pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU, written out (the compiler lowers it without a special kernel)."""
    return 0.5 * x * (1.0 + torch.tanh(GELU_TANH_COEFF * (x + 0.044715 * torch.pow(x, 3.0))))


class RMSNorm(nn.Module):
    """Gemma-4's RMSNorm: ``x * (mean(x^2) + eps)^-0.5 * weight``, in fp32 (no ``1 + weight``)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight
        return y


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [rows, S, heads, d]; cos/sin: [rows, S, d]
    return x * cos.unsqueeze(2) + rotate_half(x) * sin.unsqueeze(2)


def written_rows(new: torch.Tensor, onehot: torch.Tensor, line: torch.Tensor | None) -> torch.Tensor:
    """This step's keys or values ``new`` ``[rows, heads, S, d]`` placed at their positions of the cache: ``onehot``
    is ``[S, kv_max]`` (one sequence) or ``[rows, S, kv_max]`` (a row each); ``line`` (``[batch, 1, 1, 1]``, a one-hot
    of one cache line) puts one sequence's into that line of a batch's caches."""
    equation = "bhsd,sm->bhmd" if onehot.dim() == 2 else "bhsd,bsm->bhmd"
    update = torch.einsum(equation, new, onehot)
    return update if line is None else update * line


def line_of(caches: tuple[torch.Tensor, torch.Tensor], line: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The keys and values a step attends over: every line (a decode step's rows are the lines), or only ``line``'s
    (one sequence's prefill): a one-hot sum, exact, since every other line is multiplied by zero."""
    if line is None:
        return caches
    return tuple((cache * line).sum(0, keepdim=True) for cache in caches)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, par: Parallel, dtype: torch.dtype):
        super().__init__()
        h, d = spec.hidden_size, layer.head_dim
        self.head_dim = d
        self.heads = spec.num_heads // par.tp_degree
        self.kv_heads = rank_kv_heads(layer.num_kv_heads, par.tp_degree)
        self.dtype = dtype
        self.q_proj = par.column(h, spec.num_heads * d, dtype)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        if layer.is_producer:
            # Column-parallel over every rank's heads: the model's, or one copy per rank when it has fewer than ranks
            # (ShardPlan.builder_tensor lays a full checkpoint out so for builders that cut equal chunks).
            kv_width = self.kv_heads * par.tp_degree * d
            self.k_proj = par.column(h, kv_width, dtype)
            self.v_proj = par.column(h, kv_width, dtype)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
            self.v_norm = RMSNorm(d, spec.rms_norm_eps, with_scale=False)
        self.o_proj = par.row(spec.num_heads * d, h, dtype)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's keys and values, ``[rows, kv_heads, S, d]`` in the cache dtype."""
        s = x.shape[1]
        k = self.k_norm(self.k_proj(x).view(rows, s, self.kv_heads, self.head_dim))
        k = apply_rope(k, cos, sin).transpose(1, 2)
        v = self.v_norm(self.v_proj(x).view(rows, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        return k.to(self.dtype), v.to(self.dtype)

    def forward(self, x, cos, sin, mask, keys, values, rows: int = 1) -> torch.Tensor:
        """``rows`` (a Python int, a constant of the graph): the sequences in ``x``, each attending its own line."""
        s = x.shape[1]
        q = self.q_norm(self.q_proj(x).view(rows, s, self.heads, self.head_dim))
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [rows, heads, S, d]
        groups = self.heads // self.kv_heads
        slots = keys.shape[2]
        # Query head j attends KV head j // groups, as transformers' repeat_kv lays them out.
        grouped = (rows, self.kv_heads, groups, slots, self.head_dim)
        keys = keys[:, :, None].expand(grouped).reshape(rows, self.heads, slots, -1)
        values = values[:, :, None].expand(grouped).reshape(rows, self.heads, slots, -1)
        # Gemma-4 attends with scaling 1.0: q_norm and k_norm set the temperature.
        scores = torch.matmul(q.to(self.dtype), keys.transpose(2, 3)).float() + mask
        probs = torch.softmax(scores, dim=-1).to(self.dtype)
        out = torch.matmul(probs, values).transpose(1, 2).reshape(rows, s, self.heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, par: Parallel, dtype: torch.dtype):
        super().__init__()
        h, i = spec.hidden_size, layer.intermediate_size
        self.gate_proj = par.column(h, i, dtype)
        self.up_proj = par.column(h, i, dtype)
        self.down_proj = par.row(i, h, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x).float()) * self.up_proj(x).float())


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, par: Parallel, dtype: torch.dtype):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.self_attn = Attention(spec, layer, par, dtype)
        self.mlp = MLP(spec, layer, par, dtype)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        # A buffer in transformers, and the checkpoint's value is far from 1: loaded explicitly like a weight.
        self.register_buffer("layer_scalar", torch.ones(1))
        self.has_ple = spec.ple_dim > 0
        if self.has_ple:
            self.per_layer_input_gate = par.replicated(h, spec.ple_dim, dtype)
            self.per_layer_projection = par.replicated(spec.ple_dim, h, dtype)
            self.post_per_layer_input_norm = RMSNorm(h, eps)

    def forward(self, hidden, per_layer_input, cos, sin, mask, keys, values, write=None, line=None, rows: int = 1):
        """One layer over ``rows`` sequences. A producer (``write`` given: the one-hot of the positions written and
        the cache entries they replace) first writes this step's keys and values into ``keys``/``values`` (its
        caches); a KV-shared layer attends over its producer's already-updated caches. ``line`` (one sequence's
        prefill into a batch's caches) is the one-hot of its cache line: the write lands there, and the layer attends
        over that line only. Returns ``(hidden, keys, values)``: every line of the caches."""
        x = self.input_layernorm(hidden)
        if write is not None:
            onehot, written = write
            k, v = self.self_attn.project_kv(x, cos, sin, rows)
            # The one-hot masked write: trace-safe arithmetic, no scatter.
            keys = keys * (1 - written) + written_rows(k, onehot, line)
            values = values * (1 - written) + written_rows(v, onehot, line)
        attn = self.self_attn(x, cos, sin, mask, *line_of((keys, values), line), rows)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = hidden + self.post_feedforward_layernorm(mlp)
        if self.has_ple:
            gate = gelu_tanh(self.per_layer_input_gate(hidden).float()) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar, keys, values


class RankDecoder(nn.Module):
    """The decoder stack of one rank, with its KV caches as buffers named ``k_cache_<layer>`` / ``v_cache_<layer>``."""

    def __init__(self, spec: ModelSpec, plan: ShardPlan, par: Parallel, kv_max: int, dtype: torch.dtype,
                 batch_size: int = 1):
        super().__init__()
        self.model_spec = spec
        self.kv_max = kv_max
        self.dtype = dtype
        self.batch_size = batch_size
        self.producers = [layer.index for layer in spec.producers]
        self.layers = nn.ModuleList(DecoderLayer(spec, layer, par, dtype) for layer in spec.layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = par.head(spec.hidden_size, spec.vocab_size, dtype, plan.shards_vocab)
        if spec.ple_dim:
            self.per_layer_model_projection = par.replicated(spec.hidden_size, spec.num_layers * spec.ple_dim, dtype)
            self.per_layer_projection_norm = RMSNorm(spec.ple_dim, spec.rms_norm_eps)
        for layer_type in spec.layer_types:  # sorted: a fixed graph on every build
            self.register_buffer(f"inv_freq_{layer_type}", rope_inv_freq(spec.ropes[layer_type]), persistent=False)
        # Registered in cache_names() order (all keys, then all values), which is also the buffers' order in a saved
        # rank and the order host-computed caches are seeded in.
        for kind in ("k", "v"):
            for layer in spec.producers:
                shape = (batch_size, rank_kv_heads(layer.num_kv_heads, plan.tp_degree), kv_max, layer.head_dim)
                self.register_buffer(f"{kind}_cache_{layer.index}", torch.zeros(shape, dtype=dtype), persistent=False)

    def cache_names(self) -> list[str]:
        """Cache buffer names in output order: all keys, then all values (producer layers ascending)."""
        return [f"k_cache_{i}" for i in self.producers] + [f"v_cache_{i}" for i in self.producers]

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.cache_names()]

    def _per_layer_inputs(self, embeds: torch.Tensor, per_layer_tokens: torch.Tensor, rows: int) -> torch.Tensor:
        spec = self.model_spec
        s = embeds.shape[1]
        proj = self.per_layer_model_projection(embeds).float() * spec.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(rows, s, spec.num_layers, spec.ple_dim))
        return (proj + per_layer_tokens.float()) * 2.0**-0.5

    def _masks(self, positions: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
        """Additive masks ``[rows, 1, S, kv_max]``: each row sees the cache positions up to its token's own (and,
        in sliding layers, within the window)."""
        if rows == 1:  # one sequence: the graph batch-1 builds have always had
            pos = positions.view(-1, 1)  # [S, 1]
            slots = torch.arange(self.kv_max, device=positions.device).view(1, -1)  # [1, kv_max]
        else:
            pos = positions.view(rows, -1, 1)  # [rows, S, 1]
            slots = torch.arange(self.kv_max, device=positions.device).view(1, 1, -1)  # [1, 1, kv_max]
        visible = slots <= pos
        neg = torch.finfo(torch.float32).min
        masks = {"full_attention": visible}
        masks["sliding_attention"] = visible & (slots > pos - self.model_spec.sliding_window)
        if rows == 1:
            return {t: torch.where(m, 0.0, neg).view(1, 1, *m.shape) for t, m in masks.items()}
        return {t: torch.where(m, 0.0, neg).unsqueeze(1) for t, m in masks.items()}

    def _writes(self, positions: torch.Tensor, seq_ids: torch.Tensor | None,
                rows: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """How this step writes its keys and values: ``((onehot, written), line)``. ``onehot`` places each token at its
        position (``[S, kv_max]`` for one sequence, ``[rows, S, kv_max]`` for a decode step's rows, a free row's
        zeroed: its ``seq_ids`` entry is not its own index), ``written`` marks the cache entries replaced, and
        ``line`` is one sequence's cache line when it prefills into a batch's caches (else None)."""
        # (A traced graph names its values after these locals: batch 1's lines are kept as they were, for its bytes.)
        if rows > 1:  # a decode step: row r is line r, written only where seq_ids[r] == r
            active = seq_ids.view(-1) == torch.arange(rows, device=positions.device)
            onehot = torch.arange(self.kv_max, device=positions.device).view(1, 1, -1) == positions.view(rows, -1, 1)
            onehot = (onehot & active.view(rows, 1, 1)).to(self.dtype)  # [rows, S, kv_max]
            return (onehot, onehot.sum(1).view(rows, 1, -1, 1)), None
        onehot = (torch.arange(self.kv_max, device=positions.device).view(1, -1) == positions.view(-1, 1))
        onehot = onehot.to(self.dtype)  # [S, kv_max]
        written = onehot.sum(0).view(1, 1, -1, 1)  # [1, 1, kv_max, 1]
        if seq_ids is None:  # batch 1: its own graph, unchanged
            return (onehot, written), None
        line = (torch.arange(self.batch_size, device=positions.device) == seq_ids.view(-1)).to(self.dtype)
        line = line.view(-1, 1, 1, 1)  # [batch, 1, 1, 1]: one sequence's line
        return (onehot, written * line), line

    def _rope(self, positions: torch.Tensor, rows: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for layer_type in self.model_spec.layer_types:
            inv_freq = getattr(self, f"inv_freq_{layer_type}")
            freqs = positions.view(rows, -1, 1).float() * inv_freq.view(1, 1, -1)
            emb = torch.cat((freqs, freqs), dim=-1)
            out[layer_type] = (emb.cos(), emb.sin())
        return out

    def step(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None, rows: int = 1):
        """Run ``S`` tokens of one sequence, or one token of each of the batch's sequences.

        Args:
            embeds: ``[rows, S, hidden]`` fp32 token embeddings (already scaled by sqrt(hidden)).
            per_layer_tokens: ``[rows, S, layers, ple_dim]`` fp32 per-layer token embeddings (scaled), or an empty
                tensor.
            positions: ``[rows, S]`` int64 cache positions of the tokens (padding continues the sequence).
            last_index: ``[1]`` int64 index in ``[0, S)`` of the token whose logits are returned (of each row).
            seq_ids: batch above 1 only (None at batch 1): ``[1]`` int64, the cache line a prefill fills; or
                ``[batch]``, a decode step's, ``r`` for a row decoding its sequence, -1 for a free row.
            rows: how many sequences the step runs, a Python int fixed per entry point (a constant of the traced
                graph): 1 for a prefill and at batch 1, ``batch_size`` for a batch's decode step.

        Returns:
            ``(logits [rows, vocab] fp32, token [rows] int64, caches)`` where ``caches`` follows ``cache_names()``.
        """
        spec = self.model_spec
        write, line = self._writes(positions, seq_ids, rows)
        masks, rope = self._masks(positions, rows), self._rope(positions, rows)
        ple = self._per_layer_inputs(embeds, per_layer_tokens, rows) if spec.ple_dim else None

        hidden = embeds.float()
        keys, values = {}, {}
        for layer, module in zip(spec.layers, self.layers):
            cos, sin = rope[layer.layer_type]
            per_layer_input = ple[:, :, layer.index, :] if ple is not None else None
            if layer.is_producer:
                cached_k = getattr(self, f"k_cache_{layer.index}")
                cached_v = getattr(self, f"v_cache_{layer.index}")
                hidden, keys[layer.index], values[layer.index] = module(
                    hidden, per_layer_input, cos, sin, masks[layer.layer_type], cached_k, cached_v, write, line, rows)
            else:
                hidden, _, _ = module(hidden, per_layer_input, cos, sin, masks[layer.layer_type],
                                      keys[layer.kv_source], values[layer.kv_source], None, line, rows)

        last = self.norm(hidden).index_select(1, last_index).view(rows, -1)
        logits = self.lm_head(last)
        if spec.final_logit_softcapping is not None:
            cap = spec.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        token = torch.argmax(logits, dim=-1)
        caches = [keys[i] for i in self.producers] + [values[i] for i in self.producers]
        return logits, token, caches


def entry_rows(decoder: RankDecoder, entry: str) -> int:
    """The sequences one call of ``entry`` runs: a decode step runs every line of the batch, a prefill one sequence."""
    return decoder.batch_size if entry == "decode" else 1


class StatefulRank(nn.Module):
    """A rank whose caches are updated in place: what the cpu backend traces and the host-side prefill model runs.

    ``prefill`` and ``decode`` are the same computation over ``bucket`` tokens of one sequence and one token of each
    of the batch's sequences; tracing both entry points of this one module makes them share weights and caches. At
    batch above 1 both take ``seq_ids`` too (``RankDecoder.step``).
    """

    def __init__(self, decoder: RankDecoder):
        super().__init__()
        self.decoder = decoder

    def _run(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None, rows: int = 1):
        logits, token, caches = self.decoder.step(embeds, per_layer_tokens, positions, last_index, seq_ids, rows)
        for buf, new in zip(self.decoder.caches(), caches):
            buf.copy_(new)
        return logits, token

    def forward(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None):
        return self._run(embeds, per_layer_tokens, positions, last_index, seq_ids)

    def prefill(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None):
        return self._run(embeds, per_layer_tokens, positions, last_index, seq_ids, entry_rows(self.decoder, "prefill"))

    def decode(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None):
        return self._run(embeds, per_layer_tokens, positions, last_index, seq_ids, entry_rows(self.decoder, "decode"))


def build_rank(spec: ModelSpec, plan: ShardPlan, par: Parallel, kv_max: int, dtype: torch.dtype,
               state: dict[str, torch.Tensor], batch_size: int = 1) -> StatefulRank:
    """A rank module holding ``state`` (from ``plan.load_rank_state``). Missing or extra tensors are an error."""
    decoder = RankDecoder(spec, plan, par, kv_max, dtype, batch_size)
    missing, unexpected = decoder.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"rank state does not fit the recipe: missing={sorted(missing)} "
                           f"unexpected={sorted(unexpected)}")
    decoder.eval()
    return StatefulRank(decoder).eval()
