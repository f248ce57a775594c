"""Stage 1, toolchain: record the installed compiler and runtime versions.

Writes ``artifacts/toolchain.json``: the resolved backend and the versions of torch, transformers, neuronx-cc,
torch-neuronx, neuronx-distributed and libneuronxla (absent ones recorded as absent). It always runs, but rewrites
the file only when its content changes: every build depends on this file, so an upgrade of the compiler (and only a
real change) invalidates the builds.
"""

from __future__ import annotations

import importlib.metadata
import time

from pipeline.backends import resolve
from pipeline.config import PipelineConfig
from pipeline.fsutil import write_json_if_changed
from pipeline.log import log
from pipeline.paths import Paths
from pipeline.stages import StageResult

PACKAGES = ("torch", "transformers", "safetensors", "neuronx-cc", "torch-neuronx", "neuronx-distributed",
            "libneuronxla")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(backend: str) -> dict:
    """The toolchain record. Deterministic: no times, no paths, only what determines build outputs."""
    return {
        "schema_version": 1,
        "backend": backend,
        "packages": {name: {"version": package_version(name)} for name in PACKAGES},
    }


def run(cfg: PipelineConfig) -> StageResult:
    started = time.monotonic()
    record = collect(resolve(cfg.backend.name))
    path = Paths.of(cfg).toolchain
    changed = write_json_if_changed(path, record)
    present = {k: v["version"] for k, v in record["packages"].items() if v["version"]}
    log.info("toolchain: backend %s, %s (%s)", record["backend"], present,
             "changed, rewrote " + str(path) if changed else "unchanged")
    return StageResult("toolchain", "ran", time.monotonic() - started, {"changed": changed})


def load(cfg: PipelineConfig) -> dict:
    from pipeline.records import require_record

    return require_record(Paths.of(cfg).toolchain, "toolchain")
