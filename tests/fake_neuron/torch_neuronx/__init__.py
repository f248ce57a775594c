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
    orphaned (neuronx-distributed v2.28.0 trace/trace.py, TensorParallelNeuronModel._load). Every attribute of the
    rank that held a state tensor now holds its device copy (the real rank has only the states)."""
    moved = {}
    for name in list(trace.states._parameters.keys()):
        old = trace.states._parameters[name]
        moved[id(old)] = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
    for module in trace.modules():
        for name in list(module._parameters.keys()):
            param = module._parameters[name]
            if param is not None and id(param) in moved:
                module._parameters[name] = moved[id(param)]
