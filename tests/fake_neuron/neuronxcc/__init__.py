"""Test stand-in for neuronx-cc's Python package: only its version (see tests/fake_neuron/README.md)."""

__version__ = "9.9.9.9+fa4e0000"
