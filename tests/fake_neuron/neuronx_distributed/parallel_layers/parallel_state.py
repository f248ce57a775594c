"""Test stand-in: one process, tensor-parallel world size 1."""


def get_tensor_model_parallel_size() -> int:
    return 1


def get_tensor_model_parallel_rank() -> int:
    return 0
