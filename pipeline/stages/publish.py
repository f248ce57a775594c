"""Stage 7, publish: push a validated version as one commit, tagged ``<variant>-<compiler>-<inputs>``.

The commit carries ``<variant>/<archive>``, ``<variant>/manifest.json`` (with the validation summary, and its signature
``manifest.sig`` when a key is set), ``<variant>/metrics.json``, the root ``README.md``, the model card, and the root
``versions.json``, the index of every version (pipeline/publishing/index.py; ``versions.sig`` beside it when a key is
set), both regenerated from every version already published plus this one, so they never forget older versions.
Anything else in the variant's folder (an older version's archive) leaves the head in the same commit; tags keep every
version.

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

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

from pipeline.artifact import signing
from pipeline.artifact.archive import verify_file
from pipeline.artifact.manifest import Manifest, RegressionResult, SignatureFile
from pipeline.backends.registry import backend_entry
from pipeline.config import PipelineConfig
from pipeline.core.build_records import PublishReceipt
from pipeline.core.errors import PublishError
from pipeline.core.fsutil import json_text, sha256_bytes, write_json_if_changed
from pipeline.core.log import log
from pipeline.core.names import version_problem
from pipeline.core.records import encode
from pipeline.host import locking
from pipeline.paths import Paths, outliving_dvc
from pipeline.publishing import index, layout, regression
from pipeline.publishing.card import render
from pipeline.publishing.localrepo import LocalRepo
from pipeline.stages import StageResult, StageStatus
from pipeline.stages import package as package_stage
from pipeline.stages import validate as validate_stage
from pipeline.validation.records import Metrics, ValidationRecord, ValidationSummary


def demo_reasons(manifest: Manifest) -> list[str]:
    """Why a build is not the real model compiled for Inferentia (empty when it is)."""
    reasons = []
    if not manifest.model.hub_id:
        reasons.append(f"its model, {manifest.model.name!r}, is the embedded tiny test model, not a Hub checkpoint")
    if not backend_entry(manifest.backend).hub_releases:
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


def target_problems(cfg: PipelineConfig, backend: str) -> list[str]:
    """Everything that would refuse this configuration's publish and is known before anything is built: the
    placeholder repository, a missing Hub token, and a demo build (the embedded tiny model, or a backend that is not
    neuron) without ``publish.allow_demo``. All at once: one run says all three, before its first stage."""
    pub = cfg.publish
    if pub.target != "hub":
        return local_problems(cfg)
    found = [p for p in (pub.placeholder_problem(),) if p]
    from huggingface_hub import get_token

    if not get_token():
        found.append("no Hugging Face token: set HF_TOKEN (a token with write access to publish.repo_id) or run "
                     "`hf auth login`")
    reasons = []
    if not cfg.model.hub_id:
        reasons.append(f"its model, {cfg.model.name!r}, is the embedded tiny test model, not a Hub checkpoint")
    if not backend_entry(backend).hub_releases:
        reasons.append(f"it would be built by the {backend} backend, not compiled for Inferentia")
    if reasons and not pub.allow_demo:
        found.append("the build is a demo build: " + "; ".join(reasons) + ". Build the real model on an inf2 host "
                     "(model=gemma4_e4b backend=neuron), or set publish.allow_demo=true to publish it as a demo "
                     "build (its card says so)")
    return found


def known_as(hub_id: str | None, name: str) -> str:
    """What tells one model's builds from another's: its Hub id, or its conf name where it has none (the generated
    tiny model), so that a renamed conf of the same release is the same model."""
    return hub_id or name


def local_problems(cfg: PipelineConfig) -> list[str]:
    """``publish=local``: a folder holding another model's builds (what ``require_same_model`` refuses at publish),
    said before anything is built. Its working tree holds each variant's ``manifest.json`` at its head."""
    repo_dir = outliving_dvc(Paths.of(cfg).root / cfg.publish.local_dir)
    ours = known_as(cfg.model.hub_id, cfg.model.name)
    theirs = set()
    for path in sorted(repo_dir.glob(f"*/{layout.MANIFEST}")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # publish reads it strictly later
            model = json.loads(path.read_text())["model"]
            theirs.add(known_as(model.get("hub_id"), model["name"]))
    if not theirs or theirs == {ours}:
        return []
    return [f"publish.local_dir {repo_dir} holds builds of {', '.join(sorted(theirs))}; this is a build of {ours}: "
            f"each model has its own repository, so set publish.local_dir (e.g. published-{cfg.model.name})"]


def require_valid_tag(version: str) -> None:
    """A version is published as a tag: a name git (and the Hub) would refuse is refused before any request."""
    problem = version_problem(version)
    if problem:
        raise PublishError(f"version {version!r} cannot be a tag ({problem}): its variant's name and compiler id "
                           "make it; nothing was published")


def require_same_model(manifest: Manifest, published: list[Manifest], repo_id: str) -> None:
    """One repository, one model: the card names it, a variant's folder holds one model's builds (``pull 512_bf16``
    never picks another model's), and the regression gate compares builds of one model. Checked before the gate."""
    theirs = {known_as(m.model.hub_id, m.model.name) for m in published}
    ours = known_as(manifest.model.hub_id, manifest.model.name)
    if theirs and theirs != {ours}:
        raise PublishError(f"{repo_id} holds builds of {', '.join(sorted(theirs))}; {manifest.version} is a build of "
                           f"{ours}: each model has its own repository (model.published_repo names it: "
                           "publish.repo_id's default), so publish it to another publish.repo_id (publish=hub) or "
                           "publish.local_dir (publish=local). Nothing was published")


def require_validated(manifest: Manifest, report: ValidationRecord, variant: str) -> None:
    if report.archive_sha256 != manifest.archive.sha256:
        raise PublishError(f"{variant}: the validation on record is for another archive than dist/ holds: "
                           "run stage=validate")
    gates = report.gates
    if not gates.passed:
        failed = [name for name in ("parity", "throughput") if not getattr(gates, name)]
        raise PublishError(f"{variant}: refusing to publish an artifact that did not pass validation "
                           f"({', '.join(failed)} gate failed); see validation.json")


def published_manifest(manifest: Manifest, summary: ValidationSummary, regression: RegressionResult | None,
                       signed: bool) -> Manifest:
    """The manifest as published: with its validation summary, its regression comparison, and whether a signature
    (``manifest.sig``, over these very bytes) goes beside it."""
    final = replace(manifest, validation=encode(summary), regression=regression,
                    signature=SignatureFile(signing.SIGNATURE) if signed else None)
    return Manifest.from_json(final.to_json(), f"the published manifest of {manifest.version}")


def dump(obj) -> bytes:
    return json_text(obj).encode()


def read_manifest(raw: bytes | None, where: str) -> Manifest | None:
    """A manifest read from the target (None when there is none there)."""
    return Manifest.from_bytes(raw, where) if raw else None


def repo_files(variant: str, archive: Path, manifest: Manifest, metrics: Metrics, private_key: str | None) -> dict:
    """The version's files in the repo layout (pipeline/publishing/layout.py); the published manifest is signed again
    (it now carries the validation summary), so that pull can verify it."""
    manifest_path = layout.path_in(variant, layout.MANIFEST)
    files = {layout.path_in(variant, archive.name): archive, manifest_path: dump(manifest.to_json()),
             layout.path_in(variant, layout.METRICS): dump(metrics.to_json())}
    if private_key:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / signing.MANIFEST).write_bytes(files[manifest_path])
            files[layout.path_in(variant, signing.SIGNATURE)] = signing.sign(Path(tmp), archive.name,
                                                                             private_key).read_bytes()
    return files


def published_manifests(target, exclude: str) -> list[tuple[Manifest, str]]:
    """The manifest of every tagged version, read at its tag, with the sha256 of its bytes: the model card lists them
    all, the index hashes them."""
    out = []
    for tag, commit in sorted(target.tags().items()):
        if tag == exclude:
            continue
        folder = layout.folder_of(tag, target.list_files(commit))
        raw = target.read(commit, layout.path_in(folder, layout.MANIFEST)) if folder else None
        manifest = read_manifest(raw, f"{folder}/manifest.json at tag {tag}")
        if manifest and manifest.version == tag:
            out.append((manifest, sha256_bytes(raw)))
    return out


def same_build(theirs: Manifest | None, ours: Manifest) -> bool:
    """The same rank files in the same archive format. Not the archive's sha256: the compressor's library version
    may pack the same files into other bytes, and the version names the files, not the compressor."""
    return theirs is not None and (theirs.members, theirs.archive.format) == (ours.members, ours.archive.format)


def archive_problem(target, commit: str, variant: str, published: Manifest) -> str | None:
    """Why the archive published at ``commit`` is not the one its manifest names (size and sha256), or None."""
    path = layout.path_in(variant, published.archive.name)
    found = target.file_digest(commit, path)
    if found is None:
        return f"{path} is missing at commit {commit[:12]}"
    size, sha256 = found
    if (size, sha256) != (published.archive.size, published.archive.sha256):
        return (f"{path} at commit {commit[:12]} has {size} bytes and sha256 {sha256[:16]}..., its manifest says "
                f"{published.archive.size} bytes and {published.archive.sha256[:16]}...")
    return None


def repair(target, version: str, variant: str, archive: Path, ours: Manifest, theirs: Manifest, problem: str) -> str:
    """Restore the published archive of ``version`` byte for byte, in a new commit that the tag moves to; or refuse,
    saying why. Only the archive is written again (its manifest, card and signature stay as published), so it is
    done only when this build's archive is exactly the bytes the published manifest names, and only when the
    repository's head still holds this version for the variant (else restoring it would roll the head back)."""
    tags, head = target.tags(), target.head()
    fix = (f"delete the tag {version} (and its files at the head, if there) so that the next publish makes it again")
    if ours.archive.sha256 != theirs.archive.sha256:
        raise PublishError(f"version {version} is published with a corrupt archive ({problem}); this build's archive "
                           "is other bytes than its manifest names (packed by another compressor version?), so it "
                           f"cannot restore them. Refused, nothing was published: {fix}")
    at_head = read_manifest(target.read(head, layout.path_in(variant, layout.MANIFEST)),
                            f"{variant}/manifest.json at the head")
    if at_head is None or at_head.version != version:
        holds = at_head.version if at_head else "no version"
        raise PublishError(f"version {version} is published with a corrupt archive ({problem}), and the head now holds "
                           f"{holds} of {variant}: restoring it there would roll the head back. Refused, nothing was "
                           f"published: {fix}")
    verify_file(archive, ours.archive.size, ours.archive.sha256, "archive")
    commit = target.commit({layout.path_in(variant, ours.archive.name): archive}, [],
                           f"Repair {version}: restore its archive", head)
    target.tag(version, commit, replace=True)
    log.warning("publish: %s had a corrupt archive (%s): REPAIRED, restored byte for byte in commit %s, the tag "
                "moved from %s", version, problem, commit[:12], tags[version][:12])
    return commit


def index_files(target, head: str, others: list[tuple[Manifest, str]], new: tuple[Manifest, str],
                private_key: str | None, expiry_days: float) -> dict:
    """The repository's ``versions.json`` (pipeline/publishing/index.py) with ``new`` added, from every tagged
    version's manifest (so never stale when written), each keeping the publish time the head's index gave it, one
    ``index_version`` past the head's; and its signature where signing is on.

    A retry after a commit whose answer was lost finds ``new`` in the head's index already: it keeps that index (its
    number, times and rows), so the index (and the signature, taken from the head for the same bytes) are the bytes
    already there, and the Hub client makes no second commit of unchanged files."""
    at_head = target.read(head, layout.INDEX)
    previous = index.readable(at_head)
    if previous is not None and new[0].version in {row.version for row in previous.versions}:
        return index_files_of(target, head, previous, private_key)
    dates = index.published_dates(at_head)
    rows = [index.row_of(m, sha, dates.get(m.version)) for m, sha in others]
    rows.append(index.row_of(new[0], new[1], index.now()))
    return index_files_of(target, head, index.written(rows, previous, expiry_days), private_key)


def index_files_of(target, head: str, written: index.VersionIndex, private_key: str | None) -> dict:
    """``versions.json`` for ``written``, and ``versions.sig`` where signing is on (the head's, for the same bytes)."""
    data = index.encode(written)
    if not private_key:
        return {layout.INDEX: data}
    signed = target.read(head, layout.INDEX_SIGNATURE) if data == target.read(head, layout.INDEX) else None
    return {layout.INDEX: data, layout.INDEX_SIGNATURE: signed or index.signature(data, private_key)}


T = TypeVar("T")


@dataclass(frozen=True)
class PublishOutcome:
    """What publishing a version did on its target: the commit its tag names, and whether it made it or repaired
    its archive (neither: it was already there)."""

    commit: str
    created: bool
    repaired: bool


@dataclass(frozen=True)
class IndexRefresh:
    """What refreshing the index did: the head's commit, whether the index was written again, and the index it
    holds (all None but ``refreshed`` when nothing is published there)."""

    commit: str | None
    refreshed: bool
    expires: str | None
    index_version: int | None


def publish_version(target, version: str, variant: str, prepare, ours: Manifest, repo_id: str, source: str,
                    archive: Path, private_key: str | None, expiry_days: float) -> PublishOutcome:
    """Publish a version as one commit tagged ``version`` on ``target``; idempotent on its rank files (same_build),
    once the published archive is verified against its manifest (and repaired from ``archive`` if it can be).

    ``prepare(previous)`` gets the manifest of the version of this variant the target's head holds (or None) and
    returns ``(files, manifest)`` to publish (it may refuse: the regression gate).
    """
    target.ensure()
    tags = target.tags()
    if version in tags:
        theirs = read_manifest(target.read(tags[version], layout.path_in(variant, layout.MANIFEST)),
                               f"{variant}/manifest.json at tag {version}")
        if same_build(theirs, ours):
            problem = archive_problem(target, tags[version], variant, theirs)
            if problem is None:
                log.info("publish: %s is already published at %s (the same rank files, its archive verified): "
                         "nothing to do", version, tags[version][:12])
                return PublishOutcome(tags[version], created=False, repaired=False)
            commit = repair(target, version, variant, archive, ours, theirs, problem)
            return PublishOutcome(commit, created=False, repaired=True)
        raise PublishError(f"version {version} is already published (commit {tags[version][:12]}) from another build "
                           "(its rank files or archive format differ): the same inputs gave different files, so "
                           "something that decides them is missing from the version's inputs (stages/trace.py, "
                           "inputs_digest). A published version is never replaced; nothing was published")
    head = target.head()
    others = published_manifests(target, version)
    require_same_model(ours, [m for m, _ in others], repo_id)
    files, manifest = prepare(read_manifest(target.read(head, layout.path_in(variant, layout.MANIFEST)),
                                            f"{variant}/manifest.json at the head"))
    card = render([m for m, _ in others] + [manifest], repo_id, source).encode()
    new = (manifest, sha256_bytes(files[layout.path_in(variant, layout.MANIFEST)]))
    files = {**files, layout.CARD: card, **index_files(target, head, others, new, private_key, expiry_days)}
    stale = [p for p in target.list_files(head) if (p.startswith(f"{variant}/") or p == layout.INDEX_SIGNATURE)
             and p not in files]
    commit = target.commit(files, stale, f"Publish {version}", head)
    target.tag(version, commit, replace=False)
    return PublishOutcome(commit, created=True, repaired=False)


def on_target(cfg: PipelineConfig, act: Callable[[object, str], T], what: str) -> tuple[T, str]:
    """``act(target, source)`` on the configured target (the local repository under its lock; the Hub with retries):
    its result and where the target is."""
    pub = cfg.publish
    if pub.target == "local":
        # A queued DVC experiment runs in a copy DVC deletes afterwards: its versions go to the user's repository.
        repo_dir = outliving_dvc(Paths.of(cfg).root / pub.local_dir)
        with locking.held(repo_dir.parent, f"publish-{repo_dir.name}", timeout_s=600):
            refuse_a_shared_repository(repo_dir)
            return act(LocalRepo(repo_dir), str(repo_dir)), str(repo_dir.resolve())
    from pipeline.publishing import hub

    target = hub.HubTarget(pub.repo_id, pub.private)
    return hub.with_retries(lambda: act(target, pub.repo_id), f"{what} to {pub.repo_id}", pub.retries,
                            pub.retry_base_s, pub.retry_max_s, pub.repo_id), pub.repo_id


def refuse_a_shared_repository(repo_dir: Path) -> None:
    """Refuse a ``publish=local`` repository another user could change, before git runs in it: git runs there with
    its own configuration and hooks, as when its publisher types a git command there (it is the publisher's folder),
    and another user who could change it could plant configuration that runs a command, or commit rows that publish
    and refresh-index would then sign with the private key. Every folder and file in it must be this user's alone
    (pipeline/host/locking.py's rule); the folder holding it is checked by the lock taken there."""
    if not repo_dir.exists():
        return
    fix = (f"another user could plant git configuration there, or rows for the private key to sign. Make {repo_dir} "
           f"yours alone (chmod -R go-w {repo_dir}), then run again")
    for path in everything_in(repo_dir):
        locking.refuse_if_shared(path, fix, error=PublishError)


def everything_in(folder: Path) -> list[Path]:
    """``folder``, and every folder and file in it. A link is left out: it sits in a folder checked here, so only
    this user could have made it, and it is not followed."""
    found = [folder]
    for parent, folders, files in os.walk(folder):
        found += [path for name in folders + files if not (path := Path(parent, name)).is_symlink()]
    return found


def refresh_index(cfg: PipelineConfig, force: bool = False) -> IndexRefresh:
    """Write the target's ``versions.json`` again (same rows, the next ``index_version``, a new expiry; signed where
    signing is on) when less than half of ``publish.index_expiry_days`` is left, or with ``force``: what keeps a
    consumer with the public key taking it while nothing new is published."""
    pub, key = cfg.publish, cfg.package.signing.private_key

    def refresh(target, _source: str) -> IndexRefresh:
        # Nothing published there yet (a first run that built nothing new, a host whose publish=local folder is its
        # own): nothing can expire, and the repository is not created by a command that only keeps one fresh.
        raw = target.read(head := target.head(), layout.INDEX) if target.exists() else None
        if raw is None:
            return IndexRefresh(None, refreshed=False, expires=None, index_version=None)
        previous = index.readable(raw)
        if previous is None:
            raise PublishError(f"the head of {pub.repo_id} holds no {layout.INDEX} this release reads: publish any "
                               "version with this release first (it writes the index whole)")
        left = index.parsed_time(previous.expires) - index.parsed_time(index.now())
        if not force and left.total_seconds() > pub.index_expiry_days * 86400 / 2:
            return IndexRefresh(head, refreshed=False, expires=previous.expires,
                                index_version=previous.index_version)
        new = index.refreshed(previous, pub.index_expiry_days)
        stale = [layout.INDEX_SIGNATURE] if not key and layout.INDEX_SIGNATURE in target.list_files(head) else []
        commit = target.commit(index_files_of(target, head, new, key), stale,
                               f"Refresh {layout.INDEX} (index_version {new.index_version})", head)
        return IndexRefresh(commit, refreshed=True, expires=new.expires, index_version=new.index_version)

    result, where = on_target(cfg, refresh, "refreshing the index")
    if result.commit is None:
        log.warning("refresh-index: %s: no %s there (nothing published yet): nothing to refresh", where, layout.INDEX)
        return result
    log.info("refresh-index: %s: %s (index_version %d, expires %s)", where,
             "written again" if result.refreshed else "fresh enough, nothing to do", result.index_version,
             result.expires)
    return result


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    manifest = package_stage.load(cfg)
    metrics, report = validate_stage.load(cfg), validate_stage.load_report(cfg)
    require_validated(manifest, report, cfg.variant.name)
    archive = paths.dist / manifest.archive.name
    sig = cfg.package.signing
    signing.check(paths.dist, archive.name, sig.verifying_key(), sig.allow_unsigned, f"the artifact in {paths.dist}")
    verify_file(archive, manifest.archive.size, manifest.archive.sha256, "archive")
    summary = ValidationSummary.of(report)
    version = manifest.version
    require_valid_tag(version)
    pub = cfg.publish

    def prepare(previous: Manifest | None) -> tuple[dict, Manifest]:
        found = regression.gate(previous, version, manifest.fingerprint, summary, pub.regression,
                                pub.allow_regression, manifest.model.weights_digest)
        if found:
            said = ("REGRESSED, allowed by publish.allow_regression" if found.allowed else "no regression"
                    if found.passed else "other weights: compared, not gated")
            log.log(logging.WARNING if found.allowed else logging.INFO, "publish: %s against %s: %s\n%s",
                    version, found.against, said, regression.table(found))
        final = published_manifest(manifest, summary, found, bool(sig.private_key))
        return repo_files(cfg.variant.name, archive, final, metrics, sig.private_key), final

    def publish(target, source: str) -> PublishOutcome:
        return publish_version(target, version, cfg.variant.name, prepare, manifest, pub.repo_id, source, archive,
                               sig.private_key, pub.index_expiry_days)

    if pub.target != "local":
        require_real_or_allowed(manifest, pub.repo_id, pub.allow_demo)
    result, where = on_target(cfg, publish, f"publishing {version}")
    receipt = PublishReceipt(pub.target, where, version, version, result.commit, manifest.fingerprint,
                             manifest.archive.sha256)
    write_json_if_changed(paths.receipt, receipt.to_json())  # unchanged: its mtime kept (DVC and make see no change)
    log.info("publish: %s -> %s @ %s (%s)", version, where, result.commit[:12],
             "new commit" if result.created else "archive repaired" if result.repaired else "already there")
    status = StageStatus.ran if result.created or result.repaired else StageStatus.skipped
    return StageResult("publish", status, details=asdict(result))
