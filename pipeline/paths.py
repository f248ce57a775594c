"""Where every stage reads and writes (docs/design.md, "Artifacts"). One place, so no two stages disagree."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import PipelineConfig


@dataclass(frozen=True)
class Paths:
    root: Path
    model: str
    variant: str | None = None

    @classmethod
    def of(cls, cfg: PipelineConfig) -> Paths:
        return cls(Path(cfg.artifacts_dir), cfg.model.name, cfg.variant.name if cfg.variant else None)

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
    def receipt(self) -> Path:
        return self.variant_dir / "publish.json"
