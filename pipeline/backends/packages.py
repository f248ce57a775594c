"""What each backend needs installed, told from the import system alone (no backend module, no torch imported):
the toolchain stage and ``backend=auto`` ask it on every run, and the backends' own refusals read the same text."""

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


def package_problem(name: str) -> str | None:
    """Why backend ``name`` cannot run in this environment for want of its packages (None when it can), told from
    the import system alone: the toolchain stage asks it before it writes its record, and must stay cheap (it runs on
    every `dvc repro`)."""
    if name == "neuron" and not neuron_packages_present():
        from pipeline.backends.neuron_sdk import INSTALL, PINNED

        missing = [m for m in NEURON_MODULES if importlib.util.find_spec(m) is None]
        return f"backend=neuron needs the Python package {missing[0]!r}: install it on an inf2 host: " + \
            INSTALL.format(release=PINNED)
    if name == "xla" and importlib.util.find_spec("torch_xla") is None:
        return XLA_MISSING
    return None
