"""Test stand-in for neuronx_distributed.trace (its exports at NxD v2.28.0: ModelBuilder v1, NxDModel and the
parallel_model_* functions; see tests/fake_neuron/README.md)."""

from neuronx_distributed.trace.model_builder import ModelBuilder  # noqa: F401
from neuronx_distributed.trace.spmd import NxDModel  # noqa: F401
from neuronx_distributed.trace.trace import (  # noqa: F401
    parallel_model_load,
    parallel_model_save,
    parallel_model_trace,
)
