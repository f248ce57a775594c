"""Stage 4, trace: shard the weights per rank and trace/compile every rank of one variant.

Writes ``artifacts/<model>/<variant>/build/`` holding exactly the backend's rank files (``tp_0.pt``, ``tp_1.pt``;
neuronx-distributed's loader loads every file there) and ``build.json``: the fingerprint, the variant, the backend,
the compiler and its exact arguments, the toolchain, per-rank times and peak RSS, and each file's sha256.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from pipeline.backends import get_backend, resolve
from pipeline.backends.base import CheckpointRef, TraceRequest
from pipeline.config import PipelineConfig
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_json, clean_stale_temps
from pipeline.log import log
from pipeline.paths import Paths
from pipeline.records import code_digest, fingerprint, read_record, require_record
from pipeline.stages import StageResult
from pipeline.stages import model as model_stage
from pipeline.stages import toolchain as toolchain_stage


def backend_name(cfg: PipelineConfig, toolchain: dict) -> str:
    name = resolve(cfg.backend.name)
    if toolchain.get("backend") != name:
        raise PipelineError(f"artifacts/toolchain.json was recorded for backend {toolchain.get('backend')!r}, this run "
                            f"uses {name!r}: run stage=toolchain first")
    return name


def compiler_args(cfg: PipelineConfig, backend: str) -> list[str]:
    return list(cfg.backend.compiler_args.get(cfg.variant.dtype, [])) if backend == "neuron" else []


def request(cfg: PipelineConfig, backend: str) -> TraceRequest:
    paths = Paths.of(cfg)
    return TraceRequest(
        checkpoint=CheckpointRef(paths.weights.resolve(), cfg.model.text_prefix, cfg.model.head_key),
        shape=cfg.variant.shape,
        compiler_args=tuple(compiler_args(cfg, backend)),
        workdir=None if cfg.backend.compiler_workdir is None else paths.root / cfg.backend.compiler_workdir,
        max_parallel=cfg.backend.max_parallel,
        options={"compile_cache_dir": cfg.backend.compile_cache_dir},
    )


def build_fingerprint(cfg: PipelineConfig, model_record: dict, toolchain: dict, backend: str) -> str:
    """Everything that determines the rank files' bytes (the variant's name does not; its shape does)."""
    return fingerprint({
        "weights": model_record["weights_digest"],
        "text_prefix": cfg.model.text_prefix,
        "head_key": cfg.model.head_key,
        "shape": asdict(cfg.variant.shape),
        "backend": backend,
        "compiler_args": compiler_args(cfg, backend),
        "toolchain": toolchain,
        "code": code_digest("recipe", "backends"),
    })


def is_built(paths: Paths, fp: str) -> bool:
    record = read_record(paths.build_record)
    if not record or record.get("fingerprint") != fp or not paths.build.is_dir():
        return False
    found = sorted(p.name for p in paths.build.iterdir())
    return found == sorted(m["path"] for m in record["members"]) and all(
        (paths.build / m["path"]).stat().st_size == m["size"] for m in record["members"])


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    toolchain = toolchain_stage.load(cfg)
    model_record = model_stage.load(cfg)
    backend = backend_name(cfg, toolchain)
    fp = build_fingerprint(cfg, model_record, toolchain, backend)
    if not cfg.force and is_built(paths, fp):
        log.info("trace: %s is up to date (%s)", cfg.variant.name, paths.build)
        return StageResult("trace", "skipped")
    for stale in clean_stale_temps(paths.variant_dir):
        log.warning("trace: removed %s left by an interrupted run", stale)
    impl = get_backend(backend)
    req = request(cfg, backend)
    started = time.monotonic()
    log.info("trace: %s on %s, tp_degree %d, kv_max %d, bucket %d, %s, %s prefill", cfg.variant.name, backend,
             req.shape.tp_degree, req.shape.kv_max, req.shape.bucket, req.shape.dtype, req.shape.prefill)
    traced = impl.trace(req, paths.build)
    members = [{"path": r["file"], "size": r["size"], "sha256": r["sha256"]} for r in traced["ranks"]]
    atomic_write_json(paths.build_record, {
        "fingerprint": fp,
        "variant": asdict(cfg.variant),
        "backend": backend,
        "layout": traced.get("layout", "per_rank"),
        "compiler": {"id": impl.compiler_id(toolchain), "args": list(req.compiler_args),
                     "versions": {k: v["version"] for k, v in toolchain["packages"].items()}},
        "toolchain": toolchain,
        "trace": traced,
        "members": members,
        "model": {"name": cfg.model.name, "hub_id": model_record["hub_id"], "revision": model_record["revision"],
                  "config_digest": model_record["config_digest"], "weights_digest": model_record["weights_digest"]},
    })
    peak = max(r["peak_rss_bytes"] for r in traced["ranks"])
    log.info("trace: %s built in %.1f s, peak rank RSS %.2f GB", cfg.variant.name, time.monotonic() - started,
             peak / 1e9)
    return StageResult("trace", "ran", time.monotonic() - started)


def load(cfg: PipelineConfig) -> dict:
    paths = Paths.of(cfg)
    return require_record(paths.build_record, "trace", paths.build)
