"""What the backends need installed, told from the import system alone (no backend module, no torch imported):
``backend=auto`` and the backends' entries (pipeline/backends/registry.py ``package_problem``) ask it on every run,
and the backends' own refusals read the same text."""

from __future__ import annotations

import glob
import importlib.util

NEURON_MODULES = ("torch_neuronx", "neuronx_distributed")


def neuron_devices() -> list[str]:
    return sorted(glob.glob("/dev/neuron[0-9]*"))


def neuron_packages_present() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in NEURON_MODULES)


XLA_EXTRA, XLA_MAKE_TARGET = "xla", "make test-xla"
XLA_MISSING = (f"backend=xla needs torch-xla, which is not installed in this environment: install the pipeline's "
               f"[{XLA_EXTRA}] extra (pip install -e '.[{XLA_EXTRA}]'; it pins torch 2.8, as torch-neuronx does), or "
               f"run `{XLA_MAKE_TARGET}`, which sets up .venv-production with it")
