"""Test stand-in for neuronx-distributed (see tests/fake_neuron/README.md)."""

import importlib.metadata

__version__ = importlib.metadata.version("neuronx-distributed")  # the dist-info tests/fake_sdk.py writes
