"""Test stand-in for neuronx_distributed.parallel_layers."""
