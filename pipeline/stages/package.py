"""Stage 5, package: a deterministic archive of the rank directory, with its manifest.

Writes ``artifacts/<model>/<variant>/dist/``, for the version ``<variant>-<compiler>-<inputs>`` (version_name):
``<model>-<version>.<format>`` (unpacks to one directory,
``<model>-<version>/``, holding only the rank files), ``manifest.json`` (schema version; model id, revision and
config digest; the variant; backend, compiler and exact compiler arguments; toolchain; each member's path, size and
sha256; the archive's name, size and sha256; the input fingerprint) and, with a signing key, ``manifest.sig``.
Same inputs, same bytes. A build directory holding anything but its rank files is refused.
"""

from __future__ import annotations

import time

from pipeline import __version__
from pipeline.artifact import archive as archive_mod
from pipeline.artifact import signing
from pipeline.artifact.formats import SUFFIX
from pipeline.artifact.manifest import SCHEMA_VERSION, Manifest
from pipeline.config import PipelineConfig
from pipeline.core.errors import IntegrityError
from pipeline.core.fsutil import reporting_full_disk, staged_dir
from pipeline.core.log import log
from pipeline.core.records import fingerprint
from pipeline.paths import Paths
from pipeline.stages import StageResult, StageStatus, code_of
from pipeline.stages import trace as trace_stage

INPUTS_DIGITS = 8  # 32 bits: a clash among the few builds of one variant and compiler is out of reach


def version_name(variant: str, compiler_id: str, inputs_digest: str, archive_format: str, signed: bool) -> str:
    """``<variant>-<compiler>-<inputs>``, e.g. ``2048_bf16-ncc2.23.6484.0-1f0c9a7e``.

    ``<inputs>`` is the start of a digest of everything that decides the published files: the build's inputs digest
    (trace.inputs_digest: the checkpoint's content, so its revision; the recipe and the backend's code; the compiler,
    its arguments and versions; the shape), the archive format and whether it is signed (a version published
    unsigned stays so; signing a build of it is another version). A rebuild from changed inputs gets a new version,
    an unchanged one the same version (re-runs stay idempotent), and a published version never has to move.
    """
    inputs = fingerprint({"build": inputs_digest, "format": archive_format, "signed": signed})[:INPUTS_DIGITS]
    return f"{variant}-{compiler_id}-{inputs}"


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    build = trace_stage.load(cfg)
    version = version_name(cfg.variant.name, build.compiler.id, build.inputs_digest, cfg.package.format,
                           bool(cfg.package.signing.private_key))
    root = f"{cfg.model.name}-{version}"
    fp = fingerprint({"build": build.fingerprint, "format": cfg.package.format, "root": root,
                      "created_by": __version__, "signed": bool(cfg.package.signing.private_key),
                      "code": code_of("package")})
    current = Manifest.read_if_valid(paths.manifest)
    # Up to date only if it packs exactly the rank files the build records now.
    if (not cfg.force and current and current.fingerprint == fp and current.members == build.members
            and (paths.dist / current.archive.name).is_file()):
        log.info("package: %s is up to date (%s)", cfg.variant.name, paths.dist)
        return StageResult("package", StageStatus.skipped)
    started = time.monotonic()
    # The build directory must still be what the trace recorded: what stat can tell, now; the bytes are hashed as they
    # are packed (one read of the rank files, not two) and compared below, before anything is renamed into place.
    for member in build.members:
        archive_mod.check_stat(paths.build / member.path, member.size, "rank file", "build.json")
    found = sorted(p.name for p in paths.build.iterdir())
    recorded = [m.path for m in build.members]
    if found != sorted(recorded):
        raise IntegrityError(f"{paths.build} holds {found}, the trace recorded {recorded}: "
                             "remove the stray files or rerun stage=trace force=true")
    with reporting_full_disk(paths.dist, "package"), staged_dir(paths.dist) as tmp:
        out = tmp / f"{root}{SUFFIX[cfg.package.format]}"
        packed = archive_mod.pack(paths.build, recorded, root, out, cfg.package.format, cfg.package.threads)
        if packed.members != build.members:
            raise IntegrityError(f"{paths.build}: {differing(packed.members, build.members)}; it was changed after the "
                                 "trace (rerun stage=trace force=true) or while it was packed (rerun stage=package)")
        Manifest(
            schema_version=SCHEMA_VERSION,
            version=version,
            fingerprint=fp,
            model=build.model,
            variant=build.variant,
            backend=build.backend,
            compiler=build.compiler,
            toolchain=build.toolchain,
            layout=build.layout,
            members=packed.members,
            archive=packed.archive,
            created_by=f"gemma4-neuron-pipeline {__version__}",
        ).write(tmp / "manifest.json")
        if cfg.package.signing.private_key:
            signing.sign(tmp, out.name, cfg.package.signing.private_key)
    size_in = sum(m.size for m in packed.members)
    took = time.monotonic() - started
    log.info("package: %s -> %s (%.1f MB of %.1f MB, %.0f MB/s, sha256 %s, %s)", cfg.variant.name,
             packed.archive.name, packed.archive.size / 1e6, size_in / 1e6, size_in / 1e6 / max(took, 1e-9),
             packed.archive.sha256[:12], "signed" if cfg.package.signing.private_key else "unsigned")
    return StageResult("package", StageStatus.ran, time.monotonic() - started)


def load(cfg: PipelineConfig) -> Manifest:
    return Manifest.read(Paths.of(cfg).manifest)


def differing(packed, recorded) -> str:
    """Which rank files were read other than build.json records them."""
    recorded_by_path = {m.path: m for m in recorded}
    return "; ".join(f"{m.path} read with sha256 {m.sha256}, build.json says {recorded_by_path[m.path].sha256}"
                     for m in packed if m != recorded_by_path.get(m.path)) or "its members differ from build.json's"
