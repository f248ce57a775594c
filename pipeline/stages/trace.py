"""Stage 4, trace: check the host (preflight), then shard the weights per rank and trace/compile one variant.

The preflight (pipeline/host/preflight.py) compares RAM + swap (cgroup-aware), free disk and free NeuronCores with what
this variant needs, derived from the checkpoint's own spec (its weights' bytes per rank, times factors measured per
backend; ``model.resources.<backend>.<key>`` overrides a figure), and refuses a shortfall with the numbers and the fix
before anything is written.

Writes ``artifacts/<model>/<variant>/build/`` holding exactly the backend's files (``tp_0.pt``, ``tp_1.pt``; or, for
the neuron backend's device prefill, ModelBuilder's single ``model.pt``; neuronx-distributed's loader loads every
file there) and ``build.json``: the fingerprint, the variant, the backend, the compiler and its exact arguments, the
toolchain, the preflight's figures (the estimate, the weights' bytes it scaled, and the measured peak RSS of the stage
and of each graph, so the factors can be derived again), times, and each file's sha256.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

from pipeline.backends import resolve
from pipeline.backends.base import CheckpointRef, TraceRequest
from pipeline.backends.registry import backend_entry
from pipeline.config import PipelineConfig
from pipeline.core.build_records import (
    BuildRecord,
    Compiler,
    ModelRecord,
    ToolchainRecord,
    TracePeaks,
    TracePreflight,
    Variant,
)
from pipeline.core.errors import PipelineError, StaleInputError
from pipeline.core.fsutil import clean_stale_temps
from pipeline.core.log import log
from pipeline.core.records import code_digest, fingerprint
from pipeline.core.units import GIB
from pipeline.host import preflight
from pipeline.host.procinfo import peak_rss_bytes
from pipeline.paths import Paths
from pipeline.recipe.spec import ModelSpec, load_spec
from pipeline.stages import StageResult, StageStatus, code_of
from pipeline.stages import model as model_stage
from pipeline.stages import toolchain as toolchain_stage


def backend_name(cfg: PipelineConfig, toolchain: ToolchainRecord) -> str:
    name = resolve(cfg.backend.name)
    if toolchain.backend != name:
        raise StaleInputError(f"artifacts/toolchain.json was recorded for backend {toolchain.backend!r}, this "
                               f"run uses {name!r}: run stage=toolchain first")
    return name


def compiler_args(cfg: PipelineConfig, backend: str) -> list[str]:
    return backend_entry(backend).compiler_args(cfg)


def compiler_workdir(cfg: PipelineConfig) -> Path | None:
    """``backend.compiler_workdir`` (relative to ``artifacts_dir`` unless absolute), or None for the default."""
    if cfg.backend.compiler_workdir is None:
        return None
    return (Paths.of(cfg).root / cfg.backend.compiler_workdir).resolve()


def compile_cache(cfg: PipelineConfig) -> str | None:
    """``backend.compile_cache_dir``: a URL as given; a path relative to ``artifacts_dir`` made absolute (the compile
    runs in its own work directory)."""
    value = cfg.backend.compile_cache_dir
    if value is None or "://" in value:
        return value
    return str((Paths.of(cfg).root / value).resolve())


def request(cfg: PipelineConfig, backend: str, host=None, need=None) -> TraceRequest:
    paths = Paths.of(cfg)
    entry = backend_entry(backend)
    return TraceRequest(
        checkpoint=CheckpointRef(paths.weights.resolve(), cfg.model.text_prefix, cfg.model.head_key),
        shape=cfg.variant.shape,
        compiler_args=tuple(compiler_args(cfg, backend)),
        workdir=compiler_workdir(cfg),
        max_parallel=cfg.backend.max_parallel,
        visible_cores=cfg.backend.visible_cores if entry.on_neuron_cores else None,
        check_sdk_release=cfg.backend.check_sdk_release,
        allow_unsupported_host_prefill=cfg.backend.allow_unsupported_host_prefill,
        compile_cache_dir=compile_cache(cfg) if entry.neuronx_cc else None,
        host=host,
        need=need,
    )


def estimate(cfg: PipelineConfig, backend: str, spec: ModelSpec) -> preflight.Estimate:
    """What this variant of the checkpoint ``spec`` describes needs, with the conf's overrides."""
    return preflight.estimate(spec, cfg.variant.shape, backend_entry(backend), cfg.model.resources.get(backend))


def preflight_need(cfg: PipelineConfig, backend: str, est: preflight.Estimate) -> preflight.Need:
    paths, entry = Paths.of(cfg), backend_entry(backend)
    disk_paths = [paths.variant_dir]
    if entry.neuronx_cc and compiler_workdir(cfg) is not None:
        disk_paths.append(compiler_workdir(cfg))
    if Path(".dvc/cache").is_dir():  # dvc repro copies (or links) every output into its cache
        disk_paths.append(Path(".dvc/cache").resolve())
    work_bytes = entry.work_folder_bytes(cfg.variant.shape, est.weights)
    extra = {compiler_workdir(cfg) or paths.variant_dir: work_bytes} if work_bytes is not None else {}
    return preflight.trace_need(est.resources, entry, cfg.variant.shape, cfg.backend.max_parallel, disk_paths,
                                est.describe(), extra)


def build_settings(cfg: PipelineConfig, model_record: ModelRecord, backend: str) -> dict:
    """What both digests below hash: the checkpoint, how it is read, the shape and how it is compiled (the variant's
    name does not count; its shape does)."""
    return {
        "weights": model_record.weights_digest,
        "text_prefix": cfg.model.text_prefix,
        "head_key": cfg.model.head_key,
        "shape": asdict(cfg.variant.shape),
        "backend": backend,
        "compiler_args": compiler_args(cfg, backend),
        "compiler_env": backend_entry(backend).compiler_env(),
    }


def build_fingerprint(cfg: PipelineConfig, model_record: ModelRecord, toolchain: ToolchainRecord, backend: str) -> str:
    """Everything that may change the rank files' bytes: rebuild when it changes."""
    return fingerprint(build_settings(cfg, model_record, backend) | {"toolchain": toolchain.to_json(),
                                                                     "code": code_of("trace")})


def inputs_digest(cfg: PipelineConfig, model_record: ModelRecord, toolchain: ToolchainRecord, backend: str) -> str:
    """Digest of exactly what decides the rank files' bytes; the version names its start (package.version_name).

    The backend's entry (pipeline/backends/registry.py) names the packages and the code (its ``build_code``) that
    do. The build fingerprint hashes all of CODE["trace"] (any backend's code, as dvc.yaml does),
    so an edit anywhere there rebuilds; only an edit in the build code can make other bytes, and so a new version.
    Narrower than the build fingerprint, which also rebuilds on what only might change them (the host's Neuron system
    packages, another backend's code, transformers): such a rebuild gives the same files under the same version, and
    publishing it is a no-op.
    """
    versions, entry = toolchain.compiler_versions(), backend_entry(backend)
    return fingerprint(build_settings(cfg, model_record, backend) | {
        "packages": {name: versions.get(name) for name in entry.build_packages},
        "code": code_digest(*entry.build_code),
    })


def is_built(paths: Paths, fp: str) -> bool:
    record = BuildRecord.read_if_valid(paths.build_record)
    if not record or record.fingerprint != fp or not paths.build.is_dir():
        return False
    found = sorted(p.name for p in paths.build.iterdir())
    return found == sorted(m.path for m in record.members) and all(
        (paths.build / m.path).stat().st_size == m.size for m in record.members)


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    toolchain = toolchain_stage.load(cfg)
    model_record = model_stage.load(cfg)
    backend = backend_name(cfg, toolchain)
    fp = build_fingerprint(cfg, model_record, toolchain, backend)
    if not cfg.force and is_built(paths, fp):
        log.info("trace: %s is up to date (%s)", cfg.variant.name, paths.build)
        return StageResult("trace", StageStatus.skipped)
    for stale in clean_stale_temps(paths.variant_dir):
        log.warning("trace: removed %s left by an interrupted run", stale)
    impl = backend_entry(backend).create()
    req = request(cfg, backend)
    impl.check(req)  # e.g. the neuron backend's packages: said before anything else
    compiler_id = impl.compiler_id(toolchain)  # refuses a toolchain without the backend's compiler, before any work
    est = estimate(cfg, backend, load_spec(paths.weights))
    passed = preflight.run(est, preflight_need(cfg, backend, est), cfg.preflight)
    log.info("trace: preflight passed: needs %.1f GiB of RAM + swap, %d NeuronCores; host offers %s",
             passed.need.memory / GIB, passed.need.neuron_cores, passed.host.summary())
    req = replace(req, host=passed.host, need=passed.need)  # the preflight's figures, quoted if the compile is killed
    started = time.monotonic()
    log.info("trace: %s on %s, tp_degree %d, kv_max %d, bucket %d, %s, %s prefill", cfg.variant.name, backend,
             req.shape.tp_degree, req.shape.kv_max, req.shape.bucket, req.shape.dtype, req.shape.prefill)
    traced = impl.trace(req, paths.build)
    BuildRecord(
        fingerprint=fp,
        inputs_digest=inputs_digest(cfg, model_record, toolchain, backend),
        variant=Variant(**asdict(cfg.variant)),
        backend=backend,
        layout=traced.layout,
        compiler=Compiler(compiler_id, req.compiler_args, toolchain.compiler_versions()),
        toolchain=toolchain,
        preflight=TracePreflight(*passed.figures(), TracePeaks(peak_rss_bytes(), traced.peak_rss_bytes,
                                                               sum(m.size for m in traced.members))),
        trace=traced.to_json(),
        members=traced.members,
        model=model_record.identity,
    ).write(paths.build_record)
    log.info("trace: %s built in %.1f s, peak RSS %.2f GB", cfg.variant.name, time.monotonic() - started,
             traced.peak_rss_bytes / 1e9)
    return StageResult("trace", StageStatus.ran, time.monotonic() - started)


def load(cfg: PipelineConfig) -> BuildRecord:
    """The build record, with the rank directory it describes; refuses a missing or unreadable one."""
    paths = Paths.of(cfg)
    record = BuildRecord.read(paths.build_record)
    if not paths.build.is_dir():
        raise PipelineError(f"{paths.build} is missing: rebuild with stage=trace force=true")
    return record
