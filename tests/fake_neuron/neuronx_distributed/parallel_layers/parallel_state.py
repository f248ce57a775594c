"""Test stand-in for neuronx_distributed.parallel_layers.parallel_state (the functions the pipeline and the
stand-in's layers use, with the signatures of NxD v2.28.0 parallel_layers/parallel_state.py).

The tensor-parallel world is set by ``initialize_model_parallel`` (inside a ``parallel_model_trace`` rank process,
after torch.distributed is initialised: the rank is torch.distributed's) or, while ModelBuilder builds and traces its
modules ahead of time, by ``_set_aot_rank``: rank 0 of the world, as the real ModelBuilder builds every module under
``mock_distributed`` after ``init_process_group(backend, rank=0, world_size=...)`` (NxD v2.28.0 model_builder.py
~551-556, ~813-816; trace/mock_torchdist.py ``get_rank`` returns that 0). Its one graph is every rank's (SPMD): what a
module reads of the rank while it is built is 0 on every core, and its collectives name no rank (``_collective_rank``).
"""

import threading

import torch

_TENSOR_MODEL_PARALLEL_SIZE = None
_GROUP_NAME = None  # the name collectives of one traced model share
_aot = threading.local()


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    skip_collective_init: bool = False,
    lnc_size: int = 1,
    mesh_only: bool = False,
):
    global _TENSOR_MODEL_PARALLEL_SIZE
    if pipeline_model_parallel_size != 1 or context_parallel_size != 1 or expert_model_parallel_size != 1:
        raise NotImplementedError("the stand-in has tensor parallelism only")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != tensor_model_parallel_size:
        raise RuntimeError(f"world size {torch.distributed.get_world_size()} is not divisible by "
                           f"tensor_model_parallel_size {tensor_model_parallel_size}")
    _TENSOR_MODEL_PARALLEL_SIZE = tensor_model_parallel_size


def model_parallel_is_initialized() -> bool:
    return _TENSOR_MODEL_PARALLEL_SIZE is not None or getattr(_aot, "rank", None) is not None


def destroy_model_parallel():
    global _TENSOR_MODEL_PARALLEL_SIZE
    _TENSOR_MODEL_PARALLEL_SIZE = None


def _set_aot_rank(rank, world, group):
    """The stand-in ModelBuilder's trace context (rank None leaves it)."""
    _aot.rank, _aot.world, _aot.group = rank, world, group


def _require():
    if not model_parallel_is_initialized():
        raise AssertionError("intra_layer_model parallel group is not initialized")


def get_tensor_model_parallel_size() -> int:
    _require()
    if getattr(_aot, "rank", None) is not None:
        return _aot.world
    return _TENSOR_MODEL_PARALLEL_SIZE


def get_tensor_model_parallel_rank() -> int:
    _require()
    if getattr(_aot, "rank", None) is not None:
        return _aot.rank
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _collective_rank() -> torch.Tensor:
    """The rank a collective is traced with: in an SPMD graph, the graph's rank input (each call's own rank), else
    the process's, a constant."""
    if getattr(_aot, "rank", None) is not None:
        if getattr(_aot, "rank_input", None) is None:
            raise RuntimeError("a collective traced outside an SPMD graph's call")
        return _aot.rank_input
    return torch.tensor(get_tensor_model_parallel_rank())


def _set_rank_input(rank_input):
    """The stand-in SPMD graph's rank input while it is traced (None after)."""
    _aot.rank_input = rank_input


def get_tensor_model_parallel_group(as_list: bool = False):
    _require()
    return _Group(get_tensor_model_parallel_size())


def _group_name() -> str:
    """What the collectives of this trace are keyed by at run time (one name per traced model)."""
    if getattr(_aot, "rank", None) is not None:
        return _aot.group
    import os

    return os.environ.get("FAKE_NXD_GROUP", "tp")


class _Group:
    """The process group object layers keep (``self.tensor_parallel_group``); only its size is asked."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size
