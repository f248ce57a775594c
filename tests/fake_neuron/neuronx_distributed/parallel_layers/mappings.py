"""Test stand-in for neuronx_distributed.parallel_layers.mappings (signatures of NxD v2.28.0
parallel_layers/mappings.py): the all-reduce and the last-dimension all-gather, as stand-in collectives."""


import torch
import torch_neuronx  # noqa: F401 - registers torch.ops.neuron (the real package imports it too)

from neuronx_distributed.parallel_layers import parallel_state


def _world(process_group) -> int:
    return process_group.size() if process_group is not None else parallel_state.get_tensor_model_parallel_size()


def reduce_from_tensor_model_parallel_region(input_, process_group: object | None = None):
    world = _world(process_group)
    if world == 1:
        return input_
    return torch.ops.neuron.fake_all_reduce(input_, parallel_state._group_name(),
                                            parallel_state._collective_rank(), world)


def gather_from_tensor_model_parallel_region(input_, process_group: object | None = None) -> torch.Tensor:
    world = _world(process_group)
    if world == 1:
        return input_
    return torch.ops.neuron.fake_all_gather(input_, parallel_state._group_name(),
                                            parallel_state._collective_rank(), world)
