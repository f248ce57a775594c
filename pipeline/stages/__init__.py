"""One module per pipeline stage, each with ``run(cfg) -> StageResult``, in the order they run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageResult:
    stage: str
    status: str  # "ran" | "skipped"
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


ORDER = ("toolchain", "model", "reference", "trace", "package", "validate", "publish")


def module(name: str):
    import importlib

    if name not in ORDER:
        raise ValueError(f"unknown stage {name!r}")
    return importlib.import_module(f"pipeline.stages.{name}")
