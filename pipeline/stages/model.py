"""Stage 2, model: make the checkpoint available under ``artifacts/<model>/weights/``.

``source=tiny`` generates the embedded tiny model; ``source=hub`` downloads a snapshot of ``hub_id`` pinned to
``revision``; ``model.path=DIR`` takes a local checkpoint directory instead (hard-linked when on the same file
system, else copied). The checkpoint is checked against its ``config.json`` (every tensor present, right shapes)
before the stage succeeds.

Writes ``weights/`` and ``model.json``: the model's identity (hub id, revision, config digest), the sha256 of every
file, and the fingerprint the downstream stages build on.
"""

from __future__ import annotations

import fnmatch
import shutil
import time
from pathlib import Path

from pipeline.config import PipelineConfig
from pipeline.core.build_records import FileDigest, ModelRecord, SpecSummary
from pipeline.core.errors import CheckpointError, PipelineError, StaleInputError
from pipeline.core.fsutil import link_or_copy, sha256_file, staged_dir
from pipeline.core.log import log
from pipeline.core.records import code_digest, encode, fingerprint
from pipeline.paths import Paths, dvc_user_workspace
from pipeline.recipe.checkpoint import Checkpoint
from pipeline.recipe.spec import ModelSpec, load_spec
from pipeline.stages import StageResult, StageStatus, code_of


def source(cfg: PipelineConfig) -> dict:
    """Where the checkpoint comes from: what decides the files in weights/."""
    m = cfg.model
    if m.path is not None:
        return {"source": "path", "path": str(Path(m.path).resolve()), "text_prefix": m.text_prefix,
                "allow_patterns": list(m.allow_patterns)}
    if m.source == "tiny":
        from dataclasses import asdict

        return {"source": "tiny", "tiny": asdict(m.tiny), "generator": code_digest("models")}
    return {"source": "hub", "hub_id": m.hub_id, "revision": m.revision, "allow_patterns": list(m.allow_patterns)}


def summary(spec: ModelSpec) -> SpecSummary:
    """What model.json records of the model's shape."""
    return SpecSummary(spec.vocab_size, spec.hidden_size, spec.num_layers, spec.num_heads, spec.sliding_window,
                       spec.ple_dim, tuple(sorted({layer.head_dim for layer in spec.layers})),
                       tuple(sorted({layer.num_kv_heads for layer in spec.layers})),
                       tuple(layer.index for layer in spec.producers), spec.final_logit_softcapping)


def identity(cfg: PipelineConfig) -> dict:
    """What the model stage's outputs are made from: the checkpoint's source and the code that checks it."""
    return source(cfg) | {"code": code_of("model")}


def _link_or_copy(src_dir: Path, dst_dir: Path, patterns: list[str]) -> None:
    files = [p for p in sorted(src_dir.iterdir())
             if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    if not any(p.suffix == ".safetensors" for p in files):
        raise CheckpointError(f"model.path={src_dir} holds no *.safetensors file: point it at a checkpoint directory")
    for src in files:
        link_or_copy(src, dst_dir / src.name)


def download(hub_id: str, revision: str, patterns: list[str], into: Path) -> None:
    """A pinned snapshot of a Hub repo (resumable; the Hub's own client and cache do the transfer)."""
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id=hub_id, revision=revision, local_dir=into, allow_patterns=patterns)
    shutil.rmtree(into / ".cache", ignore_errors=True)  # the client's download bookkeeping, not checkpoint files


def materialise(cfg: PipelineConfig, into: Path) -> None:
    m = cfg.model
    if m.path is not None:
        _link_or_copy(Path(m.path), into, m.allow_patterns)
    elif m.source == "tiny":
        from pipeline.models.tiny_model import generate

        generate(m.tiny, into)
    else:
        download(m.hub_id, m.revision, m.allow_patterns, into)


def file_digests(weights: Path) -> dict[str, FileDigest]:
    return {p.name: FileDigest(p.stat().st_size, sha256_file(p)) for p in sorted(weights.iterdir()) if p.is_file()}


def describe(cfg: PipelineConfig, weights: Path, fp: str, files: dict[str, FileDigest] | None = None) -> ModelRecord:
    """Check the checkpoint against its config.json and record what it is (``files``: its file_digests, when the
    caller has them already)."""
    spec = load_spec(weights)
    with Checkpoint(weights, cfg.model.text_prefix, cfg.model.head_key) as ckpt:
        ckpt.verify(spec)
    files = files or file_digests(weights)
    return ModelRecord(
        fingerprint=fp,
        source_fingerprint=fingerprint(source(cfg)),
        name=cfg.model.name,
        source=identity(cfg)["source"],
        hub_id=cfg.model.hub_id,
        revision=cfg.model.revision,
        text_prefix=cfg.model.text_prefix,
        head_key=cfg.model.head_key,
        config_digest=files["config.json"].sha256,
        weights_digest=fingerprint({"files": encode(files)}),
        files=files,
        spec=summary(spec),
    )


def same_checkpoint(cfg: PipelineConfig, paths: Paths) -> dict[str, FileDigest] | None:
    """The file_digests of weights/ if it holds, unmodified, the files the last run recorded from the checkpoint
    source ``cfg`` names; else None."""
    record = ModelRecord.read_if_valid(paths.model_record)
    if not record or record.source_fingerprint != fingerprint(source(cfg)) or not paths.weights.is_dir():
        return None
    found = {p.name: p.stat().st_size for p in paths.weights.iterdir() if p.is_file()}
    if found != {name: f.size for name, f in record.files.items()}:
        return None  # before hashing 16 GB
    files = file_digests(paths.weights)
    return files if files == record.files else None


def workspace_checkpoint(cfg: PipelineConfig) -> tuple[Path, dict[str, FileDigest]] | None:
    """In a DVC temporary workspace, the user's workspace's weights/ and their file_digests when they hold the
    checkpoint ``cfg`` names, unmodified; else None."""
    workspace = dvc_user_workspace()
    if workspace is None or Path(cfg.artifacts_dir).is_absolute():
        return None
    theirs = Paths(workspace / cfg.artifacts_dir, cfg.model.name)
    files = same_checkpoint(cfg, theirs)
    return (theirs.weights, files) if files else None


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    fp = fingerprint(identity(cfg))
    recorded = ModelRecord.read_if_valid(paths.model_record)
    if not cfg.force and recorded and recorded.fingerprint == fp and paths.weights.exists():
        log.info("model: %s is up to date (%s)", cfg.model.name, paths.weights)
        return StageResult("model", StageStatus.skipped)
    started = time.monotonic()
    unchanged = None if cfg.force else same_checkpoint(cfg, paths)
    if unchanged:
        # Only the code that checks and records it changed: an E4B checkpoint is 16 GB, not worth fetching (or
        # hashing) again.
        log.info("model: %s is the same checkpoint, recorded by changed code: checking it again", cfg.model.name)
        record = describe(cfg, paths.weights, fp, unchanged)
    elif (shared := workspace_checkpoint(cfg)) is not None:
        # A queued DVC experiment's copy has no weights (they are not cached: dvc.yaml); the user's workspace has
        # them, checked file by file against its record, so 16 GB are linked instead of fetched again.
        weights, files = shared
        log.info("model: %s from the DVC workspace's %s (linked)", cfg.model.name, weights)
        with staged_dir(paths.weights) as tmp:
            for name in files:
                link_or_copy(weights / name, tmp / name)
            record = describe(cfg, tmp, fp, files)
    else:
        log.info("model: materialising %s (%s) into %s", cfg.model.name, identity(cfg)["source"], paths.weights)
        with staged_dir(paths.weights) as tmp:
            materialise(cfg, tmp)
            record = describe(cfg, tmp, fp)
    record.write(paths.model_record)
    size = sum(f.size for f in record.files.values())
    log.info("model: %d files, %.1f MB, config %s", len(record.files), size / 1e6, record.config_digest[:12])
    return StageResult("model", StageStatus.ran, time.monotonic() - started)


def load(cfg: PipelineConfig) -> ModelRecord:
    """The model record, with the checkpoint it describes; refuses a missing or out-of-date one."""
    paths = Paths.of(cfg)
    record = ModelRecord.read(paths.model_record)
    if not paths.weights.is_dir():
        raise PipelineError(f"{paths.weights} is missing: run stage=model force=true")
    if record.fingerprint != fingerprint(identity(cfg)):
        raise StaleInputError(f"{paths.model_record} was made for another model configuration: run stage=model")
    return record
