"""The parallel primitives of the cpu backend (and of the host-side prefill model, with one rank).

The recipe builds its linear layers through a ``Parallel`` factory; only these primitives differ between backends
(the neuron backend hands out neuronx-distributed's ``ColumnParallelLinear`` / ``RowParallelLinear`` instead).

Collectives are recorded in TorchScript by calling ``torch.ops._c10d_functional`` inside ``@torch.jit.script``
functions that take the process-group name as a string: ``torch.jit.trace`` then keeps the call in the graph
(direct ``_c10d_functional`` calls and ``dist.all_reduce`` are not traceable), and a saved rank runs the real
collective over whatever gloo group of that name exists in the process that loads it.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.jit.script
def all_reduce_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    y = torch.ops._c10d_functional.all_reduce(x, "sum", group)
    return torch.ops._c10d_functional.wait_tensor(y)


@torch.jit.script
def all_gather_dim0(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    y = torch.ops._c10d_functional.all_gather_into_tensor(x, world, group)
    return torch.ops._c10d_functional.wait_tensor(y)


class ShardLinear(nn.Module):
    """``y = x @ W.T`` on this rank's shard; the input is cast to the weight's dtype, as is the output."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight)


class RowLinear(ShardLinear):
    """Row-parallel: the partial products are summed across ranks in fp32 (as NxD's ``reduce_dtype`` default)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, tp_degree: int, group: str):
        super().__init__(in_features // tp_degree, out_features, dtype)
        self.tp_degree = tp_degree
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x).float()
        if self.tp_degree > 1:
            y = all_reduce_sum(y, self.group)
        return y


class VocabHead(ShardLinear):
    """The output head split by vocabulary; each rank's logits are gathered into the full row (fp32)."""

    def __init__(self, in_features: int, vocab: int, dtype: torch.dtype, tp_degree: int, group: str, sharded: bool):
        super().__init__(in_features, vocab // tp_degree if sharded else vocab, dtype)
        self.tp_degree = tp_degree if sharded else 1
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [rows, hidden] -> [rows, vocab]
        y = super().forward(x).float()
        if self.tp_degree > 1:
            rows, part = y.shape
            gathered = all_gather_dim0(y, self.tp_degree, self.group)  # [tp * rows, part], rank-major
            y = gathered.view(self.tp_degree, rows, part).transpose(0, 1).reshape(rows, self.tp_degree * part)
        return y


class Parallel:
    """Factory of the recipe's linear layers for one rank of a ``tp_degree``-way split (cpu backend)."""

    def __init__(self, tp_degree: int = 1, group: str = ""):
        self.tp_degree = tp_degree
        self.group = group

    def column(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return ShardLinear(in_features, out_features // self.tp_degree, dtype)

    def row(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return RowLinear(in_features, out_features, dtype, self.tp_degree, self.group)

    def replicated(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        return ShardLinear(in_features, out_features, dtype)

    def head(self, in_features: int, vocab: int, dtype: torch.dtype, sharded: bool) -> nn.Module:
        return VocabHead(in_features, vocab, dtype, self.tp_degree, self.group, sharded)
