"""Stage 7, publish: push a validated version (archive, manifest and its signature, metrics, regenerated model card)
as one commit, tagged ``<variant>-<compiler>``.

Only a validated artifact goes out: its metrics must carry a passing parity result for exactly this archive, and
the archive's checksum is verified again just before it is sent. Publishing is idempotent: the same fingerprint
already published under the version makes no commit and no tag; a different build under an existing version is
refused unless ``publish.overwrite=true``.

Writes ``artifacts/<model>/<variant>/publish.json``: the receipt (target, repo, version, commit, tag, fingerprint).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from pipeline import signing
from pipeline.archive import verify_file
from pipeline.card import render
from pipeline.config import PipelineConfig
from pipeline.errors import PublishError
from pipeline.fsutil import write_json_if_changed
from pipeline.localrepo import LocalRepo
from pipeline.log import log
from pipeline.manifest import check as check_manifest
from pipeline.paths import Paths
from pipeline.stages import StageResult
from pipeline.stages import package as package_stage
from pipeline.stages import validate as validate_stage


def validation_summary(metrics: dict, report: dict) -> dict:
    return {"parity": {k: metrics["parity"][k] for k in ("mode", "passed", "prompts", "prompts_matched",
                                                         "teacher_forced_match", "max_abs_dlogit")},
            "throughput": metrics["throughput"], "contexts": metrics["contexts"], "gates": metrics["gates"],
            "backend": report["backend"], "hardware": report["hardware"],
            "throughput_floor": report["throughput_gate"]["floor"]}


def require_validated(manifest: dict, metrics: dict, report: dict, variant: str) -> None:
    if report.get("archive_sha256") != manifest["archive"]["sha256"]:
        raise PublishError(f"{variant}: the validation on record is for another archive than dist/ holds: "
                           "run stage=validate")
    gates = metrics.get("gates", {})
    if not gates.get("passed"):
        failed = [name for name in ("parity", "throughput") if not gates.get(name)]
        raise PublishError(f"{variant}: refusing to publish an artifact that did not pass validation "
                           f"({', '.join(failed)} gate failed); see metrics.json and validation.json")


def published_manifest(manifest: dict, summary: dict) -> dict:
    return check_manifest(manifest | {"validation": summary})


def dump(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def repo_files(variant: str, archive: Path, manifest: dict, metrics: dict, private_key: str | None) -> dict:
    """The version's files in the repo layout; the published manifest is signed again (it now carries the
    validation summary), so that pull can verify it."""
    files = {f"{variant}/{archive.name}": archive, f"{variant}/manifest.json": dump(manifest),
             f"{variant}/metrics.json": dump(metrics)}
    if private_key:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / signing.MANIFEST).write_bytes(files[f"{variant}/manifest.json"])
            files[f"{variant}/{signing.SIGNATURE}"] = signing.sign(Path(tmp), archive.name, private_key).read_bytes()
    return files


def publish_local(repo: LocalRepo, version: str, variant: str, files: dict, manifest: dict, repo_id: str,
                  overwrite: bool) -> dict:
    """One commit and one tag per version in a local git repository; idempotent on the manifest fingerprint."""
    repo.ensure()
    existing = repo.tag_commit(version)
    if existing:
        raw = repo.read(existing, f"{variant}/manifest.json")
        theirs = json.loads(raw) if raw else {}
        if theirs.get("fingerprint") == manifest["fingerprint"]:
            log.info("publish: %s is already published at %s (same fingerprint): nothing to do", version, existing[:12])
            return {"commit": existing, "created": False}
        if not overwrite:
            raise PublishError(f"version {version} is already published (commit {existing[:12]}) from a different "
                               "build: bump the variant or compiler, or pass publish.overwrite=true to replace it")
    others = []
    for path in repo.list_files():
        if path.endswith("/manifest.json") and not path.startswith(f"{variant}/"):
            others.append(json.loads(repo.read("HEAD", path)))
    files = dict(files, **{"README.md": render(others + [manifest], repo_id).encode()})
    commit = repo.commit(files, f"Publish {version}")
    repo.create_tag(version, commit, force=bool(existing))
    return {"commit": commit, "created": True}


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    manifest = package_stage.load(cfg)
    metrics, report = validate_stage.load(cfg), validate_stage.load_report(cfg)
    require_validated(manifest, metrics, report, cfg.variant.name)
    archive = paths.dist / manifest["archive"]["name"]
    sig = cfg.package.signing
    signing.check(paths.dist, archive.name, sig.verifying_key(), sig.allow_unsigned, f"the artifact in {paths.dist}")
    verify_file(archive, manifest["archive"]["size"], manifest["archive"]["sha256"], "archive")
    final = published_manifest(manifest, validation_summary(metrics, report))
    version = manifest["version"]
    files = repo_files(cfg.variant.name, archive, final, metrics, sig.private_key)
    started = time.monotonic()
    if cfg.publish.target == "local":
        repo_dir = paths.root / cfg.publish.local_dir
        repo_dir.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(repo_dir.parent / f".{repo_dir.name}.lock"), timeout=600):
            result = publish_local(LocalRepo(repo_dir), version, cfg.variant.name, files, final,
                                   cfg.publish.repo_id, cfg.publish.overwrite)
        where = str(repo_dir.resolve())
    else:
        from pipeline import hub

        result = hub.publish(cfg, version, cfg.variant.name, files, final)
        where = cfg.publish.repo_id
    write_json_if_changed(paths.receipt, {  # an unchanged receipt keeps its mtime (DVC and make see no change)
        "target": cfg.publish.target, "repo": where, "version": version, "tag": version, "commit": result["commit"],
        "fingerprint": manifest["fingerprint"], "archive_sha256": manifest["archive"]["sha256"],
    })
    log.info("publish: %s -> %s @ %s (%s)", version, where, result["commit"][:12],
             "new commit" if result["created"] else "already there")
    return StageResult("publish", "ran", time.monotonic() - started, result)
