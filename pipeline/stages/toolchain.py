"""Stage 1, toolchain: record the installed compiler and runtime versions.

Writes ``artifacts/toolchain.json``: the resolved backend; the versions of the Python packages that shape a build
(torch, transformers, safetensors, neuronx-cc, torch-neuronx, neuronx-distributed, libneuronxla, torch-xla);
neuronx-cc's full version with its build hash (``neuronxcc.__version__``, else ``neuronx-cc --version``), which is
what the Neuron compile cache keys on; and the Neuron runtime and driver system packages (``aws-neuronx-*``, from dpkg
or rpm).
Anything absent is recorded as absent (null). Host hardware (how many Neuron devices) is deliberately not here: it
does not change what is compiled, and the preflight records it per build.

It always runs, but rewrites the file only when its content changes: every build depends on this file, so an
upgrade of the compiler or the runtime (and only a real change) invalidates the builds.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import time

from pipeline.backends import package_problem, resolve
from pipeline.config import PipelineConfig
from pipeline.core.build_records import NeuronxCcBuild, PackageVersion, ToolchainRecord
from pipeline.core.errors import BuildError
from pipeline.core.fsutil import write_json_if_changed
from pipeline.core.log import log
from pipeline.core.versions import installed as package_version
from pipeline.paths import Paths
from pipeline.stages import StageResult, StageStatus

PACKAGES = ("torch", "transformers", "safetensors", "neuronx-cc", "torch-neuronx", "neuronx-distributed",
            "libneuronxla", "torch-xla")
SYSTEM_PACKAGE_PATTERN = "aws-neuronx-*"  # driver (aws-neuronx-dkms), runtime, collectives, tools
NCC_VERSION_RE = re.compile(r"NeuronX Compiler version\s+(\S+)")
TOOL_TIMEOUT_S = 60


# -- neuronx-cc ---------------------------------------------------------------------------------------------------

def parse_neuronx_cc_version(output: str) -> str | None:
    """The version (with build hash) from ``neuronx-cc --version``, e.g. ``2.23.6484.0+f702b353``."""
    match = NCC_VERSION_RE.search(output)
    return match.group(1) if match else None


def neuronx_cc_full_version() -> tuple[str | None, str | None]:
    """``(version with build hash, where it was read)``: the Python module first, then the command line."""
    if importlib.util.find_spec("neuronxcc") is not None:
        try:
            version = getattr(importlib.import_module("neuronxcc"), "__version__", None)
        except Exception as exc:  # noqa: BLE001 - a broken install is recorded, not fatal
            log.warning("toolchain: importing neuronxcc failed: %s", exc)
            version = None
        if version:
            return str(version), "neuronxcc.__version__"
    exe = shutil.which("neuronx-cc")
    if exe:
        try:
            proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
            version = parse_neuronx_cc_version(proc.stdout + proc.stderr)
            if version:
                return version, "neuronx-cc --version"
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("toolchain: neuronx-cc --version failed: %s", exc)
    return None, None


# -- aws-neuronx-* system packages ----------------------------------------------------------------------------------

def parse_dpkg_query(output: str) -> dict[str, str]:
    """Installed packages from ``dpkg-query -W -f='${db:Status-Abbrev}\\t${Package}\\t${Version}\\n'``."""
    found = {}
    for line in output.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0].strip() == "ii" and parts[2]:
            found[parts[1]] = parts[2]
    return found


def parse_rpm_query(output: str) -> dict[str, str]:
    """Installed packages from ``rpm -qa --queryformat '%{NAME}\\t%{VERSION}-%{RELEASE}\\n'``."""
    found = {}
    for line in output.splitlines():
        parts = line.split("\t")
        if len(parts) == 2 and parts[0] and parts[1]:
            found[parts[0]] = parts[1]
    return found


def system_packages() -> dict[str, str]:
    """The ``aws-neuronx-*`` packages installed on this host (empty where there are none, or no package manager)."""
    queries = (
        ("dpkg-query", ["-W", "-f=${db:Status-Abbrev}\t${Package}\t${Version}\n", SYSTEM_PACKAGE_PATTERN],
         parse_dpkg_query),
        ("rpm", ["-qa", "--queryformat", "%{NAME}\t%{VERSION}-%{RELEASE}\n", SYSTEM_PACKAGE_PATTERN], parse_rpm_query),
    )
    for tool, args, parse in queries:
        exe = shutil.which(tool)
        if exe is None:
            continue
        try:
            proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError):
            continue
        # dpkg-query exits 1 when nothing matches the pattern: that is an answer (none installed), not an error.
        return dict(sorted(parse(proc.stdout).items()))
    return {}


def collect(backend: str) -> ToolchainRecord:
    """The toolchain record. Deterministic: no times, no paths, no host hardware, only what shapes a build."""
    return ToolchainRecord(
        schema_version=ToolchainRecord.SCHEMA_VERSION,
        backend=backend,
        packages={name: PackageVersion(package_version(name)) for name in PACKAGES},
        neuronx_cc=NeuronxCcBuild(*neuronx_cc_full_version()),
        system_packages=system_packages(),
    )


def run(cfg: PipelineConfig) -> StageResult:
    from pipeline.core import versions

    versions.check()  # a torch or transformers outside the supported range: refused before anything is written
    started = time.monotonic()
    backend = resolve(cfg.backend.name)
    problem = package_problem(backend)  # a backend this host cannot run changes no record (no build marked stale)
    if problem:
        raise BuildError(problem)
    record = collect(backend)
    path = Paths.of(cfg).toolchain
    changed = write_json_if_changed(path, record.to_json())
    present = {name: version for name, version in record.compiler_versions().items() if version}
    log.info("toolchain: backend %s, %s, %d aws-neuronx packages (%s)", record.backend, present,
             len(record.system_packages), "changed, rewrote " + str(path) if changed else "unchanged")
    # It always looks; it "ran" only when the record changed (a run that changes nothing says "ran nothing").
    status = StageStatus.ran if changed else StageStatus.skipped
    return StageResult("toolchain", status, time.monotonic() - started, {"changed": changed})


def load(cfg: PipelineConfig) -> ToolchainRecord:
    return ToolchainRecord.read(Paths.of(cfg).toolchain)
