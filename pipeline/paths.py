"""Where every stage reads and writes (docs/design.md, "Artifacts"). One place, so no two stages disagree."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import PipelineConfig


@dataclass(frozen=True)
class Paths:
    root: Path
    model: str
    variant: str | None = None  # the variant's folder: its name, or variant_folder

    @classmethod
    def of(cls, cfg: PipelineConfig) -> Paths:
        if cfg.variant is None:
            return cls(Path(cfg.artifacts_dir), cfg.model.name)
        return cls(Path(cfg.artifacts_dir), cfg.model.name, cfg.variant_folder or cfg.variant.name)

    # shared
    @property
    def toolchain(self) -> Path:
        return self.root / "toolchain.json"

    @property
    def model_dir(self) -> Path:
        return self.root / self.model

    @property
    def weights(self) -> Path:
        return self.model_dir / "weights"

    @property
    def model_record(self) -> Path:
        return self.model_dir / "model.json"

    @property
    def reference(self) -> Path:
        return self.model_dir / "reference.json"

    @property
    def reference_tensors(self) -> Path:
        return self.model_dir / "reference.safetensors"

    # per variant
    @property
    def variant_dir(self) -> Path:
        if self.variant is None:
            raise ValueError("no variant")
        return self.model_dir / self.variant

    @property
    def build(self) -> Path:
        return self.variant_dir / "build"

    @property
    def build_record(self) -> Path:
        return self.variant_dir / "build.json"

    @property
    def dist(self) -> Path:
        return self.variant_dir / "dist"

    @property
    def manifest(self) -> Path:
        return self.dist / "manifest.json"

    @property
    def metrics(self) -> Path:
        return self.variant_dir / "metrics.json"

    @property
    def validation_report(self) -> Path:
        return self.variant_dir / "validation.json"

    @property
    def plot_rows(self) -> Path:
        """Per variant, beside the other variants' rows: dvc plots reads the directory as one chart."""
        return self.model_dir / "plots" / f"{self.variant}.json"

    @property
    def concurrency_rows(self) -> Path:
        """Per variant, a row per count of sequences in flight: its own chart (x: sequences), beside the others'."""
        return self.model_dir / "plots" / "concurrency" / f"{self.variant}.json"

    @property
    def receipt(self) -> Path:
        return self.variant_dir / "publish.json"


def dvc_user_workspace() -> Path | None:
    """The user's DVC workspace when this process runs in one of DVC's temporary experiment workspaces (``dvc exp run
    --queue`` or ``--temp``: a copy of the repository under ``<workspace>/.dvc/tmp/exps/``, deleted after the run);
    None anywhere else. DVC sets ``DVC_ROOT`` to the user's workspace there ("Override DVC_ROOT env var to point to
    the parent DVC repo root (and not an executor tempdir root)": dvc/repo/experiments/queue/base.py, DVC 3.x)."""
    root = os.environ.get("DVC_ROOT")
    if not root:
        return None
    temporary = (Path(root) / ".dvc" / "tmp" / "exps").resolve()
    return Path(root) if Path.cwd().resolve().is_relative_to(temporary) else None


def outliving_dvc(path: Path) -> Path:
    """``path`` (relative to the working directory) where it outlives a DVC temporary workspace: under the user's
    workspace when this runs in one, else itself. What must not be deleted with the experiment's copy (the local
    publish repository) goes there."""
    workspace = dvc_user_workspace()
    return workspace / path if workspace is not None and not path.is_absolute() else path
