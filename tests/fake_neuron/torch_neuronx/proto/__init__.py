"""Test stand-in for torch_neuronx.proto (see tests/fake_neuron/README.md)."""
