"""Backends turn the recipe into per-rank artifacts and load them back: ``cpu`` everywhere, ``neuron`` on inf2, ``xla``
(the graphs neuronx-cc would receive, lowered by torch-xla on its CPU device) where the ``[xla]`` extra is installed."""

from __future__ import annotations

from pipeline.backends.packages import neuron_devices, neuron_packages_present
from pipeline.core.log import log

__all__ = ["get_backend", "neuron_devices", "neuron_packages_present", "package_problem", "resolve"]


def resolve(name: str) -> str:
    """``auto`` becomes ``neuron`` when NeuronCores and the Neuron packages are present, else ``cpu``."""
    if name != "auto":
        return name
    devices = neuron_devices()
    chosen = "neuron" if devices and neuron_packages_present() else "cpu"
    said = (f"backend=auto chose {chosen} (Neuron devices: {devices or 'none'}; Neuron packages: "
            f"{'present' if neuron_packages_present() else 'absent'})")
    if said not in _SAID:  # asked once per stage and check: said once per process
        _SAID.add(said)
        log.info("%s", said)
    return chosen


_SAID: set[str] = set()


def package_problem(name: str) -> str | None:
    """Why backend ``name`` cannot run in this environment for want of its packages (None when it can)."""
    from pipeline.backends.registry import backend_entry

    return backend_entry(name).package_problem()


def get_backend(name: str):
    """The ``Backend`` named ``name`` (its entry in pipeline/backends/registry.py; imported here, not above: a rank
    process imports this package and needs no configuration schema)."""
    from pipeline.backends.registry import backend_entry

    return backend_entry(name).create()
