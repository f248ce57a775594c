"""Install the stand-in Neuron SDK (tests/fake_neuron) as one release of pipeline/backends/neuron_sdk.py's table.

``install(dest, release)`` makes ``dest`` a site directory: the stand-in packages (linked), a ``.dist-info`` per
Neuron package with that release's version (so ``importlib.metadata`` and pip's view of the environment report them,
as for a real install), ``bin/`` with ``neuronx-cc --version`` and ``neuron-ls --json-output``, and the DMI product name
of an inf2.8xlarge. ``env(dest)`` is
what a process needs to use it. The stand-in's "device" (its NeuronCores) lives under ``dest/device``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import stat
import sys
from pathlib import Path

from pipeline.backends import neuron_sdk

FAKE = Path(__file__).resolve().parent / "fake_neuron"
MODULES = ("torch_neuronx", "neuronx_distributed", "neuronxcc")


BUILD_HASH = "+f702b353"  # Neuron's compiler and torch-neuronx wheels carry a build hash as a local version


def versions(release: str) -> dict[str, str]:
    """The versions an install of ``release`` reports (what ``importlib.metadata`` and pip see)."""
    row = neuron_sdk.release(release)
    return {"torch-neuronx": (row.torch_neuronx_for(neuron_sdk.PINNED_TORCH) or row.torch_neuronx[0]) + BUILD_HASH,
            "neuronx-cc": row.neuronx_cc + BUILD_HASH, "neuronx-distributed": row.neuronx_distributed,
            "libneuronxla": row.libneuronxla}


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _tool(dest: Path, name: str, flag: str, output: str) -> None:
    """``dest/bin/name``: answers ``name flag`` as the real tool does (``output``: the shell command printing the
    answer), and refuses anything else."""
    _script(dest / "bin" / name, f"""#!/bin/sh
# Test stand-in: {name} {flag}, in the real tool's output format.
if [ "$1" = "{flag}" ]; then
  {output}
  exit 0
fi
echo "stand-in {name}: only {flag}" >&2
exit 2
""")


def install(dest: Path, release: str = neuron_sdk.PINNED, cores: int = 2) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for module in MODULES:
        if not (dest / module).exists():
            (dest / module).symlink_to(FAKE / module, target_is_directory=True)
    for info in dest.glob("*.dist-info"):
        for f in info.iterdir():
            f.unlink()
        info.rmdir()
    for name, version in versions(release).items():
        info = dest / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("stand-in\n")
    (dest / "bin").mkdir(exist_ok=True)
    ncc = versions(release)["neuronx-cc"]  # with its build hash, as --version prints it
    _tool(dest, "neuronx-cc", "--version",
          f"printf 'NeuronX Compiler version {ncc}\\n\\nPython version 3.11.0\\nHWM version 2.0.0\\n'")
    devices = ", ".join(  # Inferentia2 devices of 2 NeuronCores each
        f'{{"neuron_device": {d}, "bdf": "00:{0x1f - d:02x}.0", "nc_count": 2, "memory_size": 34359738368, '
        f'"neuroncore_ids": [{2 * d}, {2 * d + 1}], "neuron_processes": []}}' for d in range(max(1, cores // 2)))
    _tool(dest, "neuron-ls", "--json-output", f"echo '[{devices}]'")
    # An inf2.8xlarge names itself in its DMI product name (hardware=auto reads it; its throughput floors apply).
    (dest / "dmi_product_name").write_text("inf2.8xlarge\n")
    return dest


def trace_port() -> int:
    """``parallel_model_trace``'s fixed rendezvous port, 2022 (NxD v2.28.0 trace/trace.py), moved by 100 for each
    pytest-xdist worker after the first: each worker's stand-in sites are hosts of their own (own NeuronCores, own
    leases, so own port lock), and two such hosts on one machine would otherwise collide on the one real port. Within
    a worker the port is fixed, so two traces at once still collide as the real ones do."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return 2022 + 100 * int(worker.removeprefix("gw"))


def env(dest: Path, cores: int = 2) -> dict[str, str]:
    """The variables a process (and its children) need to run on the stand-in installed at ``dest``."""
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(dest), os.environ.get("PYTHONPATH")])),
        "PATH": f"{dest / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "FAKE_NEURON_DEVICE_DIR": str(dest / "device"),
        "FAKE_NEURON_CORES": str(cores),
        "GEMMA4_NEURON_LOCK_DIR": str(dest / "leases"),
        "GEMMA4_DMI_PRODUCT_NAME_FILE": str(dest / "dmi_product_name"),
        "FAKE_NEURON_TRACE_PORT": str(trace_port()),
        "NEURON_COMPILE_CACHE_URL": str(dest / "compile-cache"),  # the stand-in's, not /var/tmp's
    }


def forget_modules() -> None:
    """Drop the stand-in's modules from this process (the next import finds whichever site is on sys.path). Its
    runtime stays: its ops are registered with torch once per process, as the real ones are."""
    from pipeline.backends.neuron_rank import nxd_linear_classes

    nxd_linear_classes.cache_clear()
    for name in list(sys.modules):
        if name.split(".")[0] in MODULES and name != "torch_neuronx._fake_runtime":
            del sys.modules[name]


@contextlib.contextmanager
def activated(site: Path, monkeypatch, cores: int = 2):
    """The stand-in at ``site`` importable here and in every process started from here."""
    forget_modules()
    monkeypatch.syspath_prepend(str(site))
    for name, value in env(site, cores).items():
        monkeypatch.setenv(name, value)
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        forget_modules()
