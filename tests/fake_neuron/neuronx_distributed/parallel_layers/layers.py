"""Test stand-in for ColumnParallelLinear / RowParallelLinear: the constructors of NxD v2.28.0
parallel_layers/layers.py, parameter for parameter (no ``**kwargs``: a misspelt argument fails as it would there),
each rank holding its slice of the weight, with real collectives through the stand-in runtime.

As the real layers, the weight carries ``partition_dim`` (0 column, 1 row): ModelBuilder cuts a full checkpoint
along it (the real ``create_local_weight``: equal contiguous chunks, rank r's is chunk r).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.parallel_layers.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)


def _register_weight(layer, shape, dtype, partition_dim):
    """``layer.weight``, registered first and marked after (``set_tensor_model_parallel_attributes`` on
    ``self.weight``, v2.28.0 layers.py ~679-690, ~926-935): under ``init_on_device(meta)`` the registered parameter
    is a new meta one, and the marks must land on it."""
    layer.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    layer.weight.tensor_model_parallel = True
    layer.weight.partition_dim = partition_dim


def _group(given):
    """The layer's process group: the one given, else the tensor-parallel one, else (parallel state never
    initialised) a world of one, as the real layers fall back to a single-process group."""
    if given is not None:
        return given
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return parallel_state._Group(1)


def _unsupported(**flags):
    used = [name for name, value in flags.items() if value]
    if used:
        raise NotImplementedError(f"the stand-in does not emulate {used}")


class ColumnParallelLinear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = True,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        stride: int = 1,
        init_method: Callable[[Any], torch.Tensor] | None = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        pad: bool = False,
        pad_alignment_size_per_rank: int = 1,
        keep_padded_output: bool = False,
        tensor_model_parallel_group=None,
        reduce_dtype: torch.dtype = torch.float32,
        rank_ordering: list | None = None,
    ):
        super().__init__()
        _unsupported(bias=bias, sequence_parallel_enabled=sequence_parallel_enabled, pad=pad,
                     skip_bias_add=skip_bias_add, rank_ordering=rank_ordering)
        self.tensor_parallel_group = _group(tensor_model_parallel_group)
        world = self.tensor_parallel_group.size()
        if output_size % world:
            raise ValueError(f"output_size {output_size} is not divisible by the tensor parallel size {world}")
        self.input_size, self.output_size, self.gather_output = input_size, output_size, gather_output
        _register_weight(self, (output_size // world, input_size), dtype, 0)

    def forward(self, input: torch.Tensor, slice_indices: torch.Tensor | None = None) -> torch.Tensor:
        output = nn.functional.linear(input, self.weight)
        if not self.gather_output:
            return output
        return gather_from_tensor_model_parallel_region(output, process_group=self.tensor_parallel_group)


class RowParallelLinear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        stride: int = 1,
        init_method: Callable[..., Any] | None = None,
        sequence_parallel_enabled: bool = False,
        sequence_dimension: int | None = None,
        keep_master_weight: bool = False,
        skip_bias_add: bool = False,
        pad: bool = False,
        reduce_output: bool = True,
        tensor_model_parallel_group=None,
        reduce_dtype: torch.dtype = torch.float32,
        tile_cc: bool = False,
        rank_ordering: list | None = None,
    ):
        super().__init__()
        _unsupported(bias=bias, sequence_parallel_enabled=sequence_parallel_enabled, pad=pad,
                     skip_bias_add=skip_bias_add, tile_cc=tile_cc, rank_ordering=rank_ordering,
                     input_not_parallel=not input_is_parallel)
        self.tensor_parallel_group = _group(tensor_model_parallel_group)
        world = self.tensor_parallel_group.size()
        if input_size % world:
            raise ValueError(f"input_size {input_size} is not divisible by the tensor parallel size {world}")
        self.input_size, self.output_size = input_size, output_size
        self.reduce_output = reduce_output
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else dtype
        _register_weight(self, (output_size, input_size // world), dtype, 1)

    def forward(self, input_: torch.Tensor, slice_indices: torch.Tensor | None = None) -> torch.Tensor:
        output = nn.functional.linear(input_, self.weight)
        if self.reduce_output:  # reduced in reduce_dtype, then cast back (the real _rpl_maybe_reduce_output)
            original = output.dtype
            output = reduce_from_tensor_model_parallel_region(output.to(self.reduce_dtype),
                                                              process_group=self.tensor_parallel_group).to(original)
        return output
