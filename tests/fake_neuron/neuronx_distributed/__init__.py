"""Test stand-in for neuronx-distributed (see tests/fake_neuron/README.md)."""

__version__ = "9.9.9+fake"
