"""Test stand-in for torch-neuronx (see tests/fake_neuron/README.md): what neuronx-distributed and the pipeline use.

Importing it registers the stand-in's ``torch.ops.neuron`` ops, as importing the real package registers the real
ones: a saved model that calls them cannot be loaded before (pipeline/backends/neuron.py imports it for that).
"""

import importlib.metadata

import torch

from torch_neuronx import _fake_runtime, contexts  # noqa: F401 - registers the ops

__version__ = importlib.metadata.version("torch-neuronx")  # the dist-info tests/fake_sdk.py writes


def move_trace_to_device(trace, device_id):
    """Put a loaded rank on its NeuronCore. As the real one, the ``states.N`` parameters the model holds are
    replaced with new tensors (the device copies; initial values carried over): references taken before are
    orphaned (neuronx-distributed v2.28.0 trace/trace.py, TensorParallelNeuronModel._load)."""
    states = trace.states
    for name in list(states._parameters.keys()):
        old = states._parameters[name]
        states._parameters[name] = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
