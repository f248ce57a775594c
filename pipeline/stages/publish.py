"""Stage 7, publish: push a validated version as one commit, tagged ``<variant>-<compiler>-<inputs>``.

The commit carries ``<variant>/<archive>``, ``<variant>/manifest.json`` (with the validation summary, and its signature
``manifest.sig`` when a key is set), ``<variant>/metrics.json`` and the root ``README.md``, the model card, regenerated
from every version already published plus this one, so it never forgets older versions. Anything else in the variant's
folder (an older version's archive) leaves the head in the same commit; tags keep every version.

Only a validated artifact goes out: its validation must have passed every gate for exactly this archive, and the
archive's checksum (and signature) is verified again just before it is sent. Publishing is idempotent: a version already
published with the same rank files makes no commit and no tag. A version names its inputs (package.version_name), so a
rebuild from changed inputs is a new version; an existing version is never moved, and other rank files under a
published version (a build that is not reproducible) are refused. A rebuild is compared with the last published version
of its variant first and refused if it regressed (pipeline/publishing/regression.py;
``publish.allow_regression=true`` overrides, and the comparison is recorded in the published manifest). Targets:
``local`` (a git repository laid out as the Hub repo) and ``hub`` (pipeline/publishing/hub.py).

Writes ``artifacts/<model>/<variant>/publish.json``: the receipt (target, repo, version, commit, tag, fingerprint).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from dataclasses import replace
from pathlib import Path

from filelock import FileLock

from pipeline.artifact import signing
from pipeline.artifact.archive import verify_file
from pipeline.artifact.manifest import Manifest
from pipeline.config import PipelineConfig
from pipeline.core.errors import PublishError
from pipeline.core.fsutil import write_json_if_changed
from pipeline.core.log import log
from pipeline.paths import Paths
from pipeline.publishing import regression
from pipeline.publishing.card import render
from pipeline.publishing.localrepo import LocalRepo
from pipeline.stages import StageResult
from pipeline.stages import package as package_stage
from pipeline.stages import validate as validate_stage


def validation_summary(report: dict) -> dict:
    """The published manifest's ``validation``, from validation.json: what the regression gate compares with the
    next version (pipeline/publishing/regression.py) and the model card shows."""
    return {"parity": {k: report["parity"][k] for k in ("mode", "passed", "prompts", "prompts_matched",
                                                        "teacher_forced_match", "max_abs_dlogit")},
            "throughput": report["throughput"], "contexts": report["contexts"], "gates": report["gates"],
            "backend": report["backend"], "hardware": report["hardware"],
            "throughput_floor": report["throughput_gate"]["floor"]}


def demo_reasons(manifest: Manifest) -> list[str]:
    """Why a build is not the real model compiled for Inferentia (empty when it is)."""
    reasons = []
    if not manifest.model.hub_id:
        reasons.append(f"its model, {manifest.model.name!r}, is the embedded tiny test model, not a Hub checkpoint")
    if manifest.backend != "neuron":
        reasons.append(f"it was built by the {manifest.backend} backend, not compiled for Inferentia")
    return reasons


def require_real_or_allowed(manifest: Manifest, repo_id: str, allow_demo: bool) -> None:
    """The Hub gets real Inferentia builds, or demo builds only when asked for (publish.allow_demo)."""
    reasons = demo_reasons(manifest)
    if reasons and not allow_demo:
        raise PublishError(f"refusing to publish {manifest.version} to {repo_id}: " + "; ".join(reasons) + ". "
                           "Build the real model on an inf2 host (model=gemma4_e4b backend=neuron), or set "
                           "publish.allow_demo=true to publish it as a demo build (its card says so). Nothing was "
                           "published")


# What ``git check-ref-format`` refuses anywhere in a ref: control characters, space, ``~^:?*[\``, ``..``, ``@{``
# and ``//`` (git-check-ref-format(1), rules 3-5, 8 and 10); the Hub checks tag names the same way.
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")


def tag_problem(name: str) -> str | None:
    """Why ``name`` cannot be a tag (``git check-ref-format refs/tags/<name>``, and no leading ``-``, which git's
    commands would read as an option), or None."""
    if not name or name == "@":
        return "it is empty or '@'"
    found = _REF_FORBIDDEN.search(name)
    if found:
        return f"it contains {found.group()!r}"
    if name.startswith(("-", "/")) or name.endswith(("/", ".")):
        return "it starts with '-' or '/', or ends with '/' or '.'"
    if any(part.startswith(".") or part.endswith(".lock") for part in name.split("/")):
        return "a component starts with '.' or ends with '.lock'"
    return None


def require_valid_tag(version: str) -> None:
    """A version is published as a tag: a name git (and the Hub) would refuse is refused before any request."""
    problem = tag_problem(version)
    if problem:
        raise PublishError(f"version {version!r} cannot be a tag ({problem}): its variant's name and compiler id "
                           "make it; nothing was published")


def require_same_model(manifest: Manifest, published: list[Manifest], repo_id: str) -> None:
    """One repository, one model: the card names it, and every version must be a build of it."""
    theirs = {m.model.hub_id for m in published}
    if theirs and theirs != {manifest.model.hub_id}:
        raise PublishError(f"{repo_id} holds builds of {sorted(map(str, theirs))}; {manifest.version} is a build of "
                           f"{manifest.model.hub_id!r}: publish it to another publish.repo_id. Nothing was published")


def require_validated(manifest: Manifest, report: dict, variant: str) -> None:
    if report.get("archive_sha256") != manifest.archive.sha256:
        raise PublishError(f"{variant}: the validation on record is for another archive than dist/ holds: "
                           "run stage=validate")
    if "gates" not in report:
        raise PublishError(f"{variant}: validation.json was written by an older pipeline (it has no gates): "
                           "run stage=validate")
    gates = report["gates"]
    if not gates.get("passed"):
        failed = [name for name in ("parity", "throughput") if not gates.get(name)]
        raise PublishError(f"{variant}: refusing to publish an artifact that did not pass validation "
                           f"({', '.join(failed)} gate failed); see validation.json")


def published_manifest(manifest: Manifest, summary: dict, regression: dict | None, signed: bool) -> Manifest:
    """The manifest as published: with its validation summary, its regression comparison, and whether a signature
    (``manifest.sig``, over these very bytes) goes beside it."""
    final = replace(manifest, validation=summary, regression=regression or None,
                    signature={"file": signing.SIGNATURE} if signed else None)
    return Manifest.from_json(final.to_json(), f"the published manifest of {manifest.version}")


def dump(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def read_manifest(raw: bytes | None, where: str) -> Manifest | None:
    """A manifest read from the target (None when there is none there)."""
    return Manifest.from_json(json.loads(raw), where) if raw else None


def repo_files(variant: str, archive: Path, manifest: Manifest, metrics: dict, private_key: str | None) -> dict:
    """The version's files in the repo layout; the published manifest is signed again (it now carries the
    validation summary), so that pull can verify it."""
    files = {f"{variant}/{archive.name}": archive, f"{variant}/manifest.json": dump(manifest.to_json()),
             f"{variant}/metrics.json": dump(metrics)}
    if private_key:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / signing.MANIFEST).write_bytes(files[f"{variant}/manifest.json"])
            files[f"{variant}/{signing.SIGNATURE}"] = signing.sign(Path(tmp), archive.name, private_key).read_bytes()
    return files


def folder_of(version: str, folders: set[str]) -> str | None:
    """The variant folder of a version (``<variant>-<compiler>-<inputs>`` lives under ``<variant>/``)."""
    matches = [f for f in folders if version.startswith(f + "-")]
    return max(matches, key=len) if matches else None


def published_manifests(target, exclude: str) -> list[Manifest]:
    """The manifest of every tagged version, read at its tag: the model card lists them all."""
    out = []
    for tag, commit in sorted(target.tags().items()):
        if tag == exclude:
            continue
        files = target.list_files(commit)
        folder = folder_of(tag, {f.split("/")[0] for f in files if f.endswith("/manifest.json")})
        raw = target.read(commit, f"{folder}/manifest.json") if folder else None
        manifest = read_manifest(raw, f"{folder}/manifest.json at tag {tag}")
        if manifest and manifest.version == tag:
            out.append(manifest)
    return out


def same_build(theirs: Manifest | None, ours: Manifest) -> bool:
    """The same rank files in the same archive format. Not the archive's sha256: the compressor's library version
    may pack the same files into other bytes, and the version names the files, not the compressor."""
    return theirs is not None and (theirs.members, theirs.archive.format) == (ours.members, ours.archive.format)


def publish_version(target, version: str, variant: str, prepare, ours: Manifest, repo_id: str, source: str) -> dict:
    """Publish a version as one commit tagged ``version`` on ``target``; idempotent on its rank files (same_build).

    ``prepare(previous)`` gets the manifest of the version of this variant the target's head holds (or None) and
    returns ``(files, manifest)`` to publish (it may refuse: the regression gate). Returns
    ``{"commit": oid, "created": bool}``.
    """
    target.ensure()
    tags = target.tags()
    if version in tags:
        theirs = read_manifest(target.read(tags[version], f"{variant}/manifest.json"),
                               f"{variant}/manifest.json at tag {version}")
        if same_build(theirs, ours):
            log.info("publish: %s is already published at %s (the same rank files): nothing to do", version,
                     tags[version][:12])
            return {"commit": tags[version], "created": False}
        raise PublishError(f"version {version} is already published (commit {tags[version][:12]}) from another build "
                           "(its rank files or archive format differ): the same inputs gave different files, so "
                           "something that decides them is missing from the version's inputs (stages/trace.py, "
                           "inputs_digest). A published version is never replaced; nothing was published")
    head = target.head()
    files, manifest = prepare(read_manifest(target.read(head, f"{variant}/manifest.json"),
                                            f"{variant}/manifest.json at the head"))
    others = published_manifests(target, version)
    require_same_model(manifest, others, repo_id)
    card = render(others + [manifest], repo_id, source).encode()
    stale = [p for p in target.list_files(head) if p.startswith(f"{variant}/") and p not in files]
    commit = target.commit({**files, "README.md": card}, stale, f"Publish {version}", head)
    target.tag(version, commit, replace=False)
    return {"commit": commit, "created": True}


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    manifest = package_stage.load(cfg)
    metrics, report = validate_stage.load(cfg), validate_stage.load_report(cfg)
    require_validated(manifest, report, cfg.variant.name)
    archive = paths.dist / manifest.archive.name
    sig = cfg.package.signing
    signing.check(paths.dist, archive.name, sig.verifying_key(), sig.allow_unsigned, f"the artifact in {paths.dist}")
    verify_file(archive, manifest.archive.size, manifest.archive.sha256, "archive")
    summary = validation_summary(report)
    version = manifest.version
    require_valid_tag(version)
    pub = cfg.publish

    def prepare(previous: Manifest | None) -> tuple[dict, Manifest]:
        found = regression.gate(previous, version, manifest.fingerprint, summary, pub.regression,
                                pub.allow_regression)
        if found:
            log.log(logging.WARNING if found["allowed"] else logging.INFO, "publish: %s against %s: %s\n%s",
                    version, found["against"], "REGRESSED, allowed by publish.allow_regression" if found["allowed"]
                    else "no regression", regression.table(found))
        final = published_manifest(manifest, summary, found, bool(sig.private_key))
        return repo_files(cfg.variant.name, archive, final, metrics, sig.private_key), final

    def publish(target, source: str) -> dict:
        return publish_version(target, version, cfg.variant.name, prepare, manifest, pub.repo_id, source)

    if pub.target == "local":
        repo_dir = paths.root / pub.local_dir
        repo_dir.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(repo_dir.parent / f".{repo_dir.name}.lock"), timeout=600):
            result = publish(LocalRepo(repo_dir), str(repo_dir))
        where = str(repo_dir.resolve())
    else:
        from pipeline.publishing import hub

        require_real_or_allowed(manifest, pub.repo_id, pub.allow_demo)
        target = hub.HubTarget(pub.repo_id, pub.private)
        result = hub.with_retries(lambda: publish(target, pub.repo_id), f"publishing {version} to {pub.repo_id}",
                                  pub.retries, pub.retry_base_s, pub.retry_max_s, pub.repo_id)
        where = pub.repo_id
    write_json_if_changed(paths.receipt, {  # an unchanged receipt keeps its mtime (DVC and make see no change)
        "target": pub.target, "repo": where, "version": version, "tag": version, "commit": result["commit"],
        "fingerprint": manifest.fingerprint, "archive_sha256": manifest.archive.sha256,
    })
    log.info("publish: %s -> %s @ %s (%s)", version, where, result["commit"][:12],
             "new commit" if result["created"] else "already there")
    return StageResult("publish", "ran" if result["created"] else "skipped", details=result)
