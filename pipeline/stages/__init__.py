"""One module per pipeline stage, each with ``run(cfg) -> StageResult``, in the order they run."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.records import code_digest


@dataclass
class StageResult:
    stage: str
    status: str  # "ran" | "skipped"
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


ORDER = ("toolchain", "model", "reference", "trace", "package", "validate", "publish")

# The pipeline code each stage runs (paths under pipeline/, files or folders): the one list of it. A stage's fingerprint
# hashes this code (records.code_digest), so an edit re-runs the stage under `python -m pipeline`, multirun and
# `schedule` exactly as dvc.yaml's deps re-run it under `dvc repro`; tests/test_dvc.py checks that dvc.yaml lists
# exactly these. Shared plumbing (config, paths, logging, file helpers) is left out: it moves files, it does not
# decide their content, and listing it would rebuild everything on every refactor.
CODE = {
    "toolchain": ("stages/toolchain.py", "versions.py", "backends/__init__.py"),
    "model": ("stages/model.py", "tiny_model.py", "texts.py", "recipe/spec.py", "recipe/checkpoint.py"),
    "reference": ("stages/reference.py", "prompts.py", "parity.py", "texts.py", "recipe/spec.py"),
    "trace": ("stages/trace.py", "recipe", "backends"),
    "package": ("stages/package.py", "archive.py", "manifest.py", "signing.py"),
    "validate": ("stages/validate.py", "validation.py", "generation.py", "parity.py", "prompts.py", "archive.py",
                 "manifest.py", "signing.py", "recipe", "backends"),
    "publish": ("stages/publish.py", "card.py", "regression.py", "manifest.py", "signing.py", "archive.py",
                "localrepo.py", "hub.py"),
}


def code_of(stage: str) -> str:
    """Digest of the code ``stage`` runs (semantic: comments and formatting do not count)."""
    return code_digest(*CODE[stage])


def module(name: str):
    import importlib

    if name not in ORDER:
        raise ValueError(f"unknown stage {name!r}")
    return importlib.import_module(f"pipeline.stages.{name}")
