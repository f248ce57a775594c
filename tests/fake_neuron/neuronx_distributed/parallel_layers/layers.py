"""Test stand-in for ColumnParallelLinear / RowParallelLinear, with the real constructor arguments (world size 1)."""

import torch
from torch import nn

from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.parallel_layers.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, gather_output=True, dtype=torch.float32, device=None,
                 **kwargs):
        super().__init__()
        world = parallel_state.get_tensor_model_parallel_size()
        if bias:
            raise NotImplementedError("the test stand-in has no bias")
        self.gather_output = gather_output
        self.tensor_parallel_group = None
        self.weight = nn.Parameter(torch.empty(output_size // world, input_size, dtype=dtype), requires_grad=False)

    def forward(self, input, *_):
        out = nn.functional.linear(input, self.weight)
        return gather_from_tensor_model_parallel_region(out) if self.gather_output else out


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False, dtype=torch.float32,
                 device=None, reduce_output=True, **kwargs):
        super().__init__()
        world = parallel_state.get_tensor_model_parallel_size()
        if bias or not input_is_parallel:
            raise NotImplementedError("the test stand-in takes parallel input and no bias")
        self.reduce_output = reduce_output
        self.tensor_parallel_group = None
        self.weight = nn.Parameter(torch.empty(output_size, input_size // world, dtype=dtype), requires_grad=False)

    def forward(self, input_, *_):
        out = nn.functional.linear(input_, self.weight)
        if self.reduce_output:
            out = reduce_from_tensor_model_parallel_region(out.float()).to(out.dtype)
        return out
