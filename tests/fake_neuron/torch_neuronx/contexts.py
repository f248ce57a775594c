"""Test stand-in for torch_neuronx.contexts (neuronx-distributed's loaders enter ``disable_nrt_load``)."""

import contextlib


@contextlib.contextmanager
def disable_nrt_load():
    """The real one keeps torch.jit.load from loading NEFFs onto the device; the stand-in has nothing to defer."""
    yield
