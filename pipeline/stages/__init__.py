"""One module per pipeline stage, each with ``run(cfg) -> StageResult``, and the one registry of them (``STAGES``).

Everything that lists or classifies stages reads the registry: the order ``python -m pipeline`` runs them in, which
need a variant, the lock each holds, the scheduler's phases, the code each fingerprint hashes; dvc.yaml's stages and
their code deps are its one unavoidable copy, held to it by tests/test_dvc.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.choices import StrEnum
from pipeline.core.records import code_digest


class StageStatus(StrEnum):
    ran = "ran"
    skipped = "skipped"  # up to date: nothing written


class StageScope(StrEnum):
    """What one run of a stage covers, and so the lock it holds."""

    host = "host"  # the toolchain record, one per artifacts folder
    model = "model"  # the checkpoint and its float reference
    variant = "variant"  # one build


@dataclass
class StageResult:
    stage: str
    status: StageStatus
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    name: str
    scope: StageScope
    phase: str | None
    """The scheduler's task it belongs to (``build``, ``validate``, ``publish``); None for the shared stages."""
    code: tuple[str, ...]
    """The pipeline code it runs (paths under pipeline/, files or folders). Its fingerprint hashes this code
    (records.code_digest), so an edit re-runs it under `python -m pipeline`, multirun and `schedule` exactly as
    dvc.yaml's deps re-run it under `dvc repro`. Shared plumbing (config, paths, logging, file helpers) is left out: it
    moves files, it does not decide their content, and listing it would rebuild everything on every refactor."""

    @property
    def shared(self) -> bool:
        """Needs no variant."""
        return self.scope != StageScope.variant

    def lock_name(self, model: str, variant: str | None) -> str:
        """The lock it holds: what it writes decides whom it must exclude."""
        return {StageScope.host: "toolchain", StageScope.model: model}.get(self.scope, f"{model}-{variant}")


STAGES = (  # in the order they run
    Stage("toolchain", StageScope.host, None, ("stages/toolchain.py", "core/versions.py", "backends/__init__.py")),
    Stage("model", StageScope.model, None, ("stages/model.py", "models", "recipe/spec.py", "recipe/checkpoint.py")),
    Stage("reference", StageScope.model, None, ("stages/reference.py", "validation/prompts.py", "validation/parity.py",
                                                "validation/reference_records.py", "models/texts.py",
                                                "recipe/spec.py", "host/bf16_matmul.py")),
    Stage("trace", StageScope.variant, "build", ("stages/trace.py", "core/shape.py", "recipe", "backends")),
    Stage("package", StageScope.variant, "build", ("stages/package.py", "artifact")),
    Stage("validate", StageScope.variant, "validate", ("stages/validate.py", "core/shape.py", "decoding", "validation",
                                                       "artifact", "recipe", "backends", "host/bf16_matmul.py")),
    Stage("publish", StageScope.variant, "publish", ("stages/publish.py", "publishing", "artifact",
                                                     "backends/registry.py", "validation/records.py",
                                                     "validation/reference_records.py")),
)
BY_NAME = {s.name: s for s in STAGES}
ORDER = tuple(BY_NAME)
SHARED = tuple(s.name for s in STAGES if s.shared)
CODE = {s.name: s.code for s in STAGES}


def phases() -> dict[str, tuple[str, ...]]:
    """The scheduler's tasks per variant, in order, and the stages each runs."""
    out: dict[str, tuple[str, ...]] = {}
    for s in STAGES:
        if s.phase:
            out[s.phase] = out.get(s.phase, ()) + (s.name,)
    return out


def code_of(stage: str) -> str:
    """Digest of the code ``stage`` runs (semantic: comments and formatting do not count)."""
    return code_digest(*CODE[stage])


def module(name: str):
    import importlib

    if name not in BY_NAME:
        raise ValueError(f"unknown stage {name!r}")
    return importlib.import_module(f"pipeline.stages.{name}")
