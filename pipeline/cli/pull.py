"""``python -m pipeline pull SOURCE VERSION``: fetch a published version, verify it, unpack it for serving.

SOURCE is a local publish folder (``publish=local``'s git repository) or a Hugging Face repo id. VERSION is a published
version (``<variant>-<compiler>-<inputs>``), or a variant's name, which resolves to the newest published version of that
variant that fits this host (pipeline/backends/compatibility.py: the installed Neuron packages, or torch, against the
version's; the log says which, and why newer ones were skipped; ``--any-host`` does not judge). A published version that
does not fit is refused, naming what is installed, what it needs and the fix. The version's tag is resolved to a commit
once, and every file is fetched at that commit, so a tag moved meanwhile cannot mix two versions. The manifest is
schema-checked and (with ``--public-key``) its signature verified; the archive's sha256 and every member's are checked;
the rank files are unpacked into ``DEST/<model>-<version>/``, a directory holding nothing else, ready for
neuronx-distributed's loaders (``parallel_model_load`` for ``tp_N.pt`` files, ``torch.jit.load`` for ModelBuilder's
``model.pt``). Its path is printed on standard output.

DEST (``--dest``, default the cache folder, pipeline/core/cache.py) is a cache like the Hub's: beside each rank
directory are its manifest as published, its signature, and a record of where it came from and of its files when they
were hashed (pipeline/artifact/pulled.py). A version already there from the same commit of the same source is used
again with nothing downloaded: the signature checked as kept, the rank files by their record where no other user could
have changed them (``--verify-full`` hashes them again). A version whose files changed is fetched again; one pulled
from an archive of another sha256 than the one published under its name is refused. Two pulls of one version into one
DEST take turns; ``--offline`` asks no source at all.

    python -m pipeline pull artifacts/published 512_bf16 --dest /workspace --allow-unsigned
    python -m pipeline pull your-org/gemma-4-E4B-it-inferentia2 2048_bf16-ncc2.23.6484.0-1f0c9a7e --dest /workspace \\
        --public-key signing-key.pub.pem
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifact import pulled, signing
from pipeline.artifact.archive import extract_verified, verify_build
from pipeline.artifact.manifest import Manifest, manifest_beside
from pipeline.backends import compatibility
from pipeline.cli import plain
from pipeline.core.build_records import ToolchainRecord
from pipeline.core.cache import CACHE_ENV, versions_dir
from pipeline.core.errors import InputError, IntegrityError, PipelineError
from pipeline.core.fsutil import TMP_MARK, atomic_write_bytes, reporting_full_disk, sha256_bytes, sha256_file
from pipeline.core.log import exit_on_error, log, setup
from pipeline.core.names import child, component, repo_path
from pipeline.host import locking
from pipeline.publishing import index, layout, trust
from pipeline.publishing.localrepo import LocalRepo


class LocalSource:
    """A ``publish=local`` folder (a git repository)."""

    def __init__(self, path: Path):
        self.repo = LocalRepo(path)
        self.name = str(path)
        self.identity = str(Path(path).resolve())  # what a pulled version's record names as where it came from

    def tags(self) -> dict[str, str]:
        return self.repo.tags()

    def head(self) -> str:
        return self.repo.head()

    def files(self, commit: str) -> list[str]:
        return self.repo.list_files(commit)

    def fetch(self, commit: str, path: str, dest: Path, max_bytes: int | None = None) -> None:
        self.repo.checkout_file(commit, path, dest, max_bytes)


class HubSource:
    """A Hugging Face model repo (token from HF_TOKEN or the login cache, for private repos). A failed request is
    reported in one line naming the endpoint (a Hub that does not answer is no missing version)."""

    def __init__(self, repo_id: str):
        from huggingface_hub import HfApi, get_token

        from pipeline.publishing.hub import endpoint, endpoint_url

        self.api, self.repo_id, self.name = HfApi(endpoint=endpoint(), token=get_token()), repo_id, repo_id
        self.identity = f"{endpoint_url().rstrip('/')}/{repo_id}"  # the same repo id on another Hub is another source

    @contextmanager
    def asking(self, what: str) -> Iterator[None]:
        from pipeline.publishing.hub import endpoint_url, explain

        try:
            yield
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - every client failure becomes one line
            said, hint = explain(exc, self.repo_id, reading=True)
            raise PipelineError(f"{what} from {endpoint_url()} failed ({said}); {hint}") from None

    def tags(self) -> dict[str, str]:
        with self.asking(f"listing the tags of {self.repo_id}"):
            return {tag.name: tag.target_commit for tag in self.api.list_repo_refs(self.repo_id).tags}

    def head(self) -> str:
        with self.asking(f"reading the head of {self.repo_id}"):
            return self.api.repo_info(self.repo_id).sha

    def files(self, commit: str) -> list[str]:
        with self.asking(f"listing the files of {self.repo_id} at {commit[:12]}"):
            return self.api.list_repo_files(self.repo_id, revision=commit)

    def fetch(self, commit: str, path: str, dest: Path, max_bytes: int | None = None) -> None:
        # The client checks only the size of what it downloads; pull verifies every checksum afterwards. It downloads
        # beside the work folder, not in it: it leaves its bookkeeping (.cache/huggingface/...) in local_dir, and the
        # signature check refuses a folder holding anything but the version's files. A file larger than
        # ``max_bytes`` is refused by the size the Hub gives for it, before the download (which must then have that
        # size: the client refuses any other).
        repo_path(path, "a file of the repository")
        if max_bytes is not None:
            self.refuse_larger(commit, path, max_bytes)
        with (self.asking(f"downloading {path} of {self.repo_id} at {commit[:12]}"),
              tempfile.TemporaryDirectory(dir=dest.parent.parent, prefix=f".hub{TMP_MARK}") as local):
            got = Path(self.api.hf_hub_download(self.repo_id, path, revision=commit, local_dir=local))
            if not got.resolve().is_relative_to(Path(local).resolve()):
                raise IntegrityError(f"the download of {path} landed outside its folder ({got}): refusing it")
            shutil.move(got, dest)

    def refuse_larger(self, commit: str, path: str, max_bytes: int) -> None:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        from pipeline.publishing.hub import endpoint_url

        with self.asking(f"reading the size of {path} of {self.repo_id} at {commit[:12]}"):
            size = get_hf_file_metadata(hf_hub_url(self.repo_id, path, revision=commit, endpoint=endpoint_url()),
                                        token=self.api.token).size
        if size is None or size > max_bytes:
            raise IntegrityError(f"{path} of {self.repo_id} at {commit[:12]} is {size} bytes, more than the "
                                 f"{max_bytes} a file of its kind may have: refusing to download it")


def host_toolchain() -> ToolchainRecord:
    """This host's toolchain record (the toolchain stage's reader): what compatibility.judge compares a version with."""
    from pipeline.stages.toolchain import collect

    return collect("this host")


# A Hugging Face repo id: "owner/name" (or a bare name), of the characters the Hub allows.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def source_for(spec: str):
    """A local publish folder when ``spec`` is one; a Hub repository when it reads as a repo id; else the error says
    which it is not (a path that does not exist was asked of the Hub, whose refusal named neither)."""
    path = Path(spec)
    if path.exists():
        return LocalSource(path)
    if REPO_ID.fullmatch(spec) and not spec.startswith((".", "~")):
        return HubSource(spec)
    raise InputError(f"{spec!r} is neither a local publish folder (no such folder) nor a Hugging Face repo id "
                     "(owner/name): give the folder publish=local wrote (artifacts/published by default) or the repo")


@dataclass(frozen=True)
class Choice:
    """The version a pull takes: its name and commit, and with a public key the signed index and row that chose it
    (what its manifest must hash to, and what this client then remembers as trusted)."""

    version: str
    commit: str
    row: index.IndexRow | None = None
    signed: index.SignedIndex | None = None


def resolve(source, name: str, work: Path, host: dict | None = None, public_key: str | None = None,
            allow_older: str | None = None, allow_expired: bool = False) -> Choice:
    """The version ``name`` stands for: a published version, or a variant's name, which stands for the newest
    published version of that variant that fits ``host`` (a toolchain record: pipeline/backends/compatibility.py;
    None takes the newest whatever the host). With ``public_key``, the signed index decides (pipeline/publishing/
    index.py) and this client's trusted state bounds it (pipeline/publishing/trust.py); without, the tags decide and
    each version's own manifest says whether it fits."""
    if public_key is not None:
        return signed_choice(source, name, work, host, public_key, allow_older, allow_expired)
    tags = source.tags()
    if name in tags:
        return Choice(name, tags[name])
    if any(tag.startswith(name + "-") for tag in tags):
        candidates = newest_first(source, name, index.listing(source, work).versions, work)
        skipped = []
        for found in candidates:
            if host:  # judged by the version's manifest: an unsigned row could say anything
                described = index.manifest_at(source, found.row.version, found.commit, work)
                verdict = compatibility.judge(described[0].backend, described[0].toolchain, host) if described else None
                if described is None or verdict.fit == compatibility.Fit.refused:
                    skipped.append(f"{found.row.version}: {verdict.says() if verdict else 'its manifest is unusable'}")
                    continue
            return chosen(found, name, host, skipped)
        if skipped:
            raise PipelineError(f"no published version of {name!r} in {source.name} fits this host:\n  - "
                                + "\n  - ".join(skipped))
    raise PipelineError(f"{source.name} has no version or variant {name!r}; its versions are {sorted(tags)}")


def chosen(found: index.Published, name: str, host: dict | None, skipped: list[str],
           signed: index.SignedIndex | None = None) -> Choice:
    for line in skipped:
        log.info("pull: skipped the newer %s", line)
    if found.row.version != name:
        log.info("pull: %s resolves to %s, the newest published version of that variant%s", name, found.row.version,
                 " that fits this host" if host else "")
    return Choice(found.row.version, found.commit, found.row if signed else None, signed)


def signed_choice(source, name: str, work: Path, host: dict | None, public_key: str, allow_older: str | None,
                  allow_expired: bool) -> Choice:
    """``resolve`` by the signed index: its rows decide (they are signed), a rolled-back index and a version older
    than one already taken are refused, and so is a version whose tag is gone (a freeze hides the newest)."""
    listing = index.listing(source, work, public_key, allow_expired)
    trust.check_index(source.identity, listing.signed)
    exact = [p for p in listing.versions if p.row.version == name]
    candidates = exact or [p for p in reversed(listing.versions) if p.row.variant.name == name]
    if not candidates:
        raise PipelineError(f"{source.name}'s signed index (index_version {listing.signed.index.index_version}) has no "
                            f"version or variant {name!r}; its versions are "
                            f"{sorted(p.row.version for p in listing.versions)}")
    skipped = []
    for found in candidates:
        verdict = compatibility.judge(found.row.backend, found.row.toolchain, host) if host and not exact else None
        if verdict is not None and verdict.fit == compatibility.Fit.refused:
            skipped.append(f"{found.row.version}: {verdict.says()}")
            continue
        if found.commit is None:
            raise IntegrityError(
                f"{source.name}'s signed index (index_version {listing.signed.index.index_version}) lists "
                f"{found.row.version} (published {found.row.published}), but the repository has no tag for it: the "
                "version is withheld (a freeze) or was removed without a new index. Nothing was taken. Ask its "
                "publisher, or name an older version to take that one instead")
        trust.check_version(source.identity, found.row, allow_older)
        return chosen(found, name, host, skipped, listing.signed)
    raise PipelineError(f"no published version of {name!r} in {source.name} fits this host:\n  - "
                        + "\n  - ".join(skipped))


def newest_first(source, variant: str, published: list[index.Published], work: Path) -> list[index.Published]:
    """The versions of ``variant``, newest first: by publish time where the index records it; a version with none (an
    index rebuilt from the tags) is ordered by the head, which holds the newest of each variant, then by name."""
    mine = [p for p in published if p.row.variant.name == variant]
    dated = sorted((p for p in mine if p.row.published), key=lambda p: p.row.published, reverse=True)
    undated = sorted((p for p in mine if not p.row.published), key=lambda p: p.row.version, reverse=True)
    head_version = None
    if undated:
        head = source.head()
        if variant in layout.variant_folders(source.files(head)):
            raw = index.fetch_bounded(source, head, layout.path_in(variant, layout.MANIFEST),
                                      work / "head-manifest.json", Manifest.MAX_BYTES)
            (work / "head-manifest.json").unlink()  # the signature check allows nothing but the version's files
            head_version = Manifest.from_bytes(raw, f"{variant}/manifest.json at the head").version
    return dated + sorted(undated, key=lambda p: p.row.version != head_version)


def judged(manifest: Manifest, host: dict | None) -> None:
    """Refuse (naming what is installed, what is needed and the fix) a version that does not fit ``host``; warn when
    it fits with a warning."""
    if host is None:
        return
    verdict = compatibility.judge(manifest.backend, manifest.toolchain, host)
    if verdict.fit == compatibility.Fit.refused:
        raise PipelineError(f"{manifest.version} does not fit this host: {verdict.says()} (pull --any-host fetches "
                            "it without this check, to serve elsewhere)")
    if verdict.fit == compatibility.Fit.warning:
        log.warning("pull: %s fits this host with a warning: %s", manifest.version, verdict.reason)


def variant_folder(files: list[str], version: str) -> str:
    """The folder holding ``version`` (pipeline/publishing/layout.py), or an error naming the folders there are."""
    folder = layout.folder_of(version, files)
    if folder is None:
        raise PipelineError(f"version {version!r} matches no variant folder among "
                            f"{sorted(layout.variant_folders(files))}")
    return folder


def destination(dest: Path) -> Path:
    """``--dest``, made if missing; a file or a folder this user cannot write is refused by name."""
    if dest.exists() and not dest.is_dir():
        raise PipelineError(f"--dest {dest} is a file: give a directory (it is created if missing)")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PipelineError(f"--dest {dest} cannot be created ({exc.strerror}): give a directory you can write") \
            from None
    if not os.access(dest, os.W_OK | os.X_OK):
        raise PipelineError(f"--dest {dest} is not writable by this user: give a directory you can write")
    return dest


def pull(source, name: str, dest: Path, public_key: str | None, allow_unsigned: bool, host: dict | None = None,
         verify_full: bool = False, *, allow_older: str | None = None, allow_expired: bool = False) -> Path:
    """Fetch, verify and unpack the version ``name`` (or the newest of the variant ``name``) into ``dest``; with
    ``host`` (this host's toolchain record), only a version that fits it (pipeline/backends/compatibility.py).

    A version already in ``dest`` from the same commit of the same source is used again without a download: its
    manifest and signature are checked as kept beside it, its rank files by their ``Pulled`` record
    (pipeline/artifact/pulled.py; hashed in full with ``verify_full``). Two pulls of one version into one ``dest``
    take turns (a lock per version): the second finds the first's. ``source`` None pulls nothing: only what ``dest``
    holds (``--offline``).

    With ``public_key``, the signed index chooses and this client's trusted state bounds the choice
    (pipeline/publishing/trust.py): ``allow_older`` names a version older than one already taken that may be taken
    all the same, ``allow_expired`` takes an index past its expiry.

    Every name the repository supplies (its listing's folders, the manifest's archive and directory names) is checked
    as a plain path component before it becomes a path (pipeline/core/names.py), and every file is created inside the
    work folder this call made (the rank directory is unpacked there too, then renamed), or as ``dest``'s one rank
    directory and the files beside it, or as the version's lock in ``dest/.locks/``. A work folder left by a pull
    that was killed is removed by the next one (``work_folder``).
    """
    destination(dest)
    with reporting_full_disk(dest, f"pull {name}"), work_folder(dest) as work:
        if source is None:
            choice = Choice(*cached_version(dest, name, host))
        else:  # once: every file from this commit
            choice = resolve(source, name, work, host, public_key, allow_older, allow_expired)
        with locking.held(dest, lock_name(component(choice.version, "the version to pull"))):
            kept = reused(dest, choice, source, work, public_key, allow_unsigned, host, verify_full)
            if kept is None and source is None:
                raise PipelineError(f"--offline: {dest} holds no usable {choice.version} (see above); pull it "
                                    "without --offline")
            if kept is None:
                kept = fetched(source, choice, dest, work, public_key, allow_unsigned, host, verify_full)
        if choice.signed is not None:
            trust.remember(source.identity, choice.signed, choice.row)
        return kept


WORK_PREFIX = f".pull{TMP_MARK}"
WORK_LOCK = "work-folders"  # never a version's lock: those are "pull-..."


@contextmanager
def work_folder(dest: Path) -> Iterator[Path]:
    """A new work folder in ``dest``, removed afterwards. The folder itself is locked (flock, on the directory) while
    the pull runs: the kernel lets go when the pull dies, however it dies, so the next pull removes what a killed one
    left (its lock is free: a whole version's size, the archive and the half-unpacked rank directory are in there)
    and never a running one's (its lock is held)."""
    # The sweep and a new folder's lock are one step under a lock of the whole folder: otherwise another pull's sweep
    # can find this folder between mkdtemp and flock, unlocked, and remove it under us.
    with locking.held(dest, WORK_LOCK):
        for left in sorted(dest.glob(f"{WORK_PREFIX}*")):
            if left.is_dir() and not left.is_symlink() and not held_by_a_pull(left):
                log.info("pull: removing %s, left by a pull that was killed", left)
                shutil.rmtree(left, ignore_errors=True)
        work = Path(tempfile.mkdtemp(dir=dest, prefix=WORK_PREFIX))
        lock = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        os.close(lock)


def held_by_a_pull(folder: Path) -> bool:
    """Whether a running pull holds ``folder``'s lock (True too when this user cannot ask: only what is proven
    abandoned is removed)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def lock_name(version: str) -> str:
    """The lock of ``version`` in a pull folder (``.locks/<name>.lock`` and ``.owner``: within a file name's 255
    bytes however long the version is)."""
    if len(version.encode()) <= 200:
        return f"pull-{version}"
    return f"pull-{hashlib.sha256(version.encode()).hexdigest()[:32]}"


def cached_version(dest: Path, name: str, host: dict | None) -> tuple[str, str]:
    """``(version, commit)`` for ``name`` among the versions pulled into ``dest``, without asking any source: a
    version, or a variant's name, which takes the version of that variant pulled last that fits ``host`` (offline,
    the repository's publish times are not at hand)."""
    held = [(rank_dir, entry) for rank_dir, entry in pulled.entries(dest)
            if entry.version == name or entry.version.startswith(name + "-")]
    skipped = []
    for rank_dir, entry in sorted(held, key=lambda found: found[1].pulled, reverse=True):
        manifest = Manifest.read_if_valid(manifest_beside(rank_dir))
        verdict = compatibility.judge(manifest.backend, manifest.toolchain, host) if manifest and host else None
        if verdict is not None and verdict.fit == compatibility.Fit.refused:
            skipped.append(f"{entry.version}: {verdict.says()}")
            continue
        if entry.version != name:
            log.info("pull: offline, %s resolves to %s, the version of that variant pulled last%s", name,
                     entry.version, " that fits this host" if host else "")
        return entry.version, entry.commit
    why = ("; the ones there do not fit this host:\n  - " + "\n  - ".join(skipped)) if skipped else ""
    raise PipelineError(f"--offline: {dest} holds no pulled version {name!r}{why}; pull it without --offline first "
                        f"(it holds {sorted(entry.version for _, entry in pulled.entries(dest))})")


def reused(dest: Path, choice: Choice, source, work: Path, public_key: str | None, allow_unsigned: bool,
           host: dict | None, verify_full: bool) -> Path | None:
    """The rank directory of the chosen version when ``dest`` already holds it from ``source`` at its commit (the same
    commit of the same source: the same bytes) and it still verifies, with no download; else None, and it is fetched.
    One that no longer matches its manifest is removed first (this release's pull made it: it has a record). Offline
    (``source`` None), any source's will do, and one that does not verify is refused, not removed."""
    offline, version, commit = source is None, choice.version, choice.commit
    found = [(rank_dir, entry) for rank_dir, entry in pulled.entries(dest)
             if (entry.version, entry.commit) == (version, commit) and (offline or entry.source == source.identity)]
    if not found:
        return None
    rank_dir, entry = found[0]
    if sha256_file(manifest_beside(rank_dir)) != entry.manifest_sha256:
        log.warning("pull: the manifest beside %s is not the one pulled with it%s", rank_dir,
                    "" if offline else "; fetching it again")
        return None
    if choice.row is not None and entry.manifest_sha256 != choice.row.manifest_sha256:
        return None  # fetched: the signed index names another manifest, and the download is checked against it
    shutil.copyfile(manifest_beside(rank_dir), work / signing.MANIFEST)
    if pulled.signature_beside(rank_dir).is_file():
        shutil.copyfile(pulled.signature_beside(rank_dir), work / signing.SIGNATURE)
    manifest = Manifest.read_if_valid(work / signing.MANIFEST)
    if manifest is None or (manifest.version, manifest.archive.root) != (version, rank_dir.name):
        emptied(work)  # a manifest beside it that is not its own: fetched again, as if it were not there
        return None
    judged(manifest, host)
    try:
        accepted = signing.check(work, manifest.archive.name, public_key, allow_unsigned, f"{version} in {dest}")
    except IntegrityError as exc:
        if offline or public_key is None:  # the signing policy refuses it: a download would be refused the same way
            raise
        log.warning("pull: the signature kept beside %s fails (%s); fetching it again", rank_dir, exc)
        emptied(work)  # fetched: the published manifest and signature are checked as every pull checks them
        return None
    try:
        _, how = pulled.reverified(rank_dir, manifest, verify_full)
    except IntegrityError as exc:
        if offline:
            raise IntegrityError(f"--offline: {exc}; pull it again without --offline") from None
        log.warning("pull: %s no longer matches its manifest (%s); fetching it again", rank_dir, exc)
        emptied(work)
        discard(rank_dir, work)
        return None
    log.info("pull: %s is in %s (commit %s, signature %s, rank files checked %s): nothing downloaded", version,
             rank_dir, commit[:12], accepted, how)
    return rank_dir


def emptied(work: Path) -> None:
    """The work folder without the kept manifest and signature (the signature check allows nothing else there)."""
    for name in (signing.MANIFEST, signing.SIGNATURE):
        (work / name).unlink(missing_ok=True)


def discard(rank_dir: Path, work: Path) -> None:
    """Remove a pulled version: its directory first (one rename into the work folder: it is gone at once, and a kill
    before it is deleted leaves it where the next pull removes it), then what is beside it."""
    gone = work / f"discarded-{rank_dir.name}"
    os.replace(rank_dir, gone)
    for beside in (pulled.pulled_beside(rank_dir), pulled.signature_beside(rank_dir), manifest_beside(rank_dir)):
        beside.unlink(missing_ok=True)
    shutil.rmtree(gone, ignore_errors=True)


def fetched(source, choice: Choice, dest: Path, work: Path, public_key: str | None, allow_unsigned: bool,
            host: dict | None, verify_full: bool) -> Path:
    """The chosen version fetched from ``source`` at its commit, verified and unpacked into ``dest``; a rank directory
    of that version already there is used when it holds exactly the published files (the same archive sha256).

    The manifest and its signature are fetched within their size bounds and the signature checked over the bytes
    before the manifest is parsed; with a signed index, the manifest must be the one its row names."""
    version, commit = choice.version, choice.commit
    files = source.files(commit)
    folder = variant_folder(files, version)
    raw = index.fetch_bounded(source, commit, layout.path_in(folder, layout.MANIFEST), work / signing.MANIFEST,
                              Manifest.MAX_BYTES)
    if layout.path_in(folder, signing.SIGNATURE) in files:
        source.fetch(commit, layout.path_in(folder, signing.SIGNATURE), work / signing.SIGNATURE,
                     signing.MAX_SIGNATURE_BYTES)
    accepted = signing.check(work, None, public_key, allow_unsigned, f"{version} in {source.name}")
    if choice.row is not None and sha256_bytes(raw) != choice.row.manifest_sha256:
        raise IntegrityError(f"{folder}/manifest.json at {commit[:12]} is not the manifest the signed index names for "
                             f"{version} (sha256 {sha256_bytes(raw)[:12]}, the index says "
                             f"{choice.row.manifest_sha256[:12]}): another version's files mixed in. Nothing was taken")
    manifest = Manifest.from_bytes(raw, f"{folder}/manifest.json at {commit[:12]}")  # names checked: problems()
    if manifest.version != version:
        raise IntegrityError(f"{folder}/manifest.json at {commit[:12]} describes {manifest.version!r}, "
                             f"not {version!r}")
    judged(manifest, host)
    archive_name = manifest.archive.name
    target = child(dest, manifest.archive.root, "the manifest's archive.root")
    if target.exists() and already_there(target, manifest, work, source, commit, verify_full):
        log.info("pull: %s is already in %s and verifies", version, target)
        return target
    source.fetch(commit, layout.path_in(folder, archive_name), child(work, archive_name, "the manifest's archive.name"))
    # The manifest (and signature) go beside the rank directory (never in it: neuronx-distributed's loader loads every
    # file there) before the directory appears, so the directory's rename is the one step that makes the version
    # visible: interrupted before it, there is no rank directory; after it, it has its manifest. Its record comes
    # last (one left by a directory removed by hand goes first): a directory without one is hashed in full when used
    # again.
    pulled.pulled_beside(target).unlink(missing_ok=True)
    keep_beside(work, target)
    try:
        build = extract_verified(work / archive_name, manifest, target, staging=work)
    except BaseException:
        if not target.exists():
            for beside in (manifest_beside(target), pulled.signature_beside(target)):
                beside.unlink(missing_ok=True)
        raise
    pulled.record(build, manifest, commit, source.identity).write(pulled.pulled_beside(target))
    log.info("pull: %s (commit %s, signature %s) -> %s", version, commit[:12], accepted, target)
    return target


def already_there(target: Path, manifest: Manifest, work: Path, source, commit: str, verify_full: bool) -> bool:
    """Whether the rank directory already at ``target`` is ``manifest``'s version, verified, and now recorded as
    fetched from ``source`` at ``commit``; False when it was this release's pull's and no longer verifies (it is
    removed: fetched again). One that is not exactly the published files is refused and left as it is; so is one
    pulled from an archive of another sha256 (a version names one set of bytes)."""
    entry = pulled.Pulled.read_if_valid(pulled.pulled_beside(target))
    if entry is None:  # an earlier release's pull, or somebody's folder: every byte hashed, nothing changed if wrong
        build = verify_build(target, manifest.members)
        keep_beside(work, target)
        pulled.record(build, manifest, commit, source.identity).write(pulled.pulled_beside(target))
        return True
    if entry.version != manifest.version:
        raise IntegrityError(f"{target} holds {entry.version}, pulled from {entry.source}: {manifest.version} unpacks "
                             f"to the same directory (archive.root {manifest.archive.root!r}); pull it into another "
                             "--dest")
    if entry.archive_sha256 != manifest.archive.sha256:
        raise IntegrityError(
            f"{target} holds {entry.version} from an archive of sha256 {entry.archive_sha256} (pulled from "
            f"{entry.source} at {entry.commit[:12]}); {source.name} publishes sha256 {manifest.archive.sha256} under "
            "that version. A version names one set of bytes, so one of the two is not what was built: pull into "
            f"another --dest to compare them, or remove {target} (and the files beside it named {target.name}.*) to "
            "take the published one")
    keep_beside(work, target)
    try:
        build, _ = pulled.reverified(target, manifest, verify_full)
    except IntegrityError as exc:
        log.warning("pull: %s no longer matches its manifest (%s); fetching it again", target, exc)
        discard(target, work)
        return False
    pulled.record(build, manifest, commit, source.identity, entry.pulled).write(pulled.pulled_beside(target))
    return True


def keep_beside(work: Path, target: Path) -> None:
    """The fetched manifest, byte for byte, and its signature (or none, for an unsigned version) beside ``target``."""
    atomic_write_bytes(manifest_beside(target), (work / signing.MANIFEST).read_bytes())
    if (work / signing.SIGNATURE).is_file():
        atomic_write_bytes(pulled.signature_beside(target), (work / signing.SIGNATURE).read_bytes())
    else:
        pulled.signature_beside(target).unlink(missing_ok=True)


def add_source_flags(parser: argparse.ArgumentParser) -> None:
    """The flags by which pull and serve find, trust and reuse a published version."""
    parser.add_argument("--dest", type=Path, default=None,
                        help=f"where a pulled version is unpacked (default: {versions_dir()}, the cache folder; "
                             f"{CACHE_ENV} moves it)")
    parser.add_argument("--public-key", help="PEM public key the manifest's signature must verify with")
    parser.add_argument("--allow-unsigned", action="store_true", help="accept a version no key verifies")
    parser.add_argument("--offline", action="store_true",
                        help="ask no source: use a version already pulled into --dest (a variant's name takes the one "
                             "of that variant pulled last); SOURCE is then only named, not read")
    parser.add_argument("--verify-full", action="store_true",
                        help="hash every file of a version already pulled, instead of trusting its unchanged size, "
                             "mtime, ctime and inode since pull last hashed it")
    # What the signed index's bounds would refuse, taken by name.
    parser.add_argument("--allow-older", metavar="VERSION",
                        help="take VERSION although this client already took a newer version of its variant from "
                             "this source (with --public-key: a rollback is refused unless named)")
    parser.add_argument("--allow-expired", action="store_true",
                        help="take the signed index although it is past its expiry (its publisher stopped refreshing "
                             "it, or an old copy is served)")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline pull", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a local publish folder, or a Hugging Face repo id")
    parser.add_argument("version", help="a published version (<variant>-<compiler>-<inputs>), or a variant's name for "
                                        "its newest published version")
    add_source_flags(parser)
    parser.add_argument("--any-host", action="store_true",
                        help="fetch and verify without judging whether this host can run it (to serve it elsewhere, "
                             "or to build an image on another machine); a variant's name then takes its newest")
    args = parser.parse_args(argv)
    setup()
    with exit_on_error():
        problem = signing.key_problem(args.public_key, "public", "--public-key") if args.public_key else None
        if problem:
            raise PipelineError(problem)
        dest = (args.dest or versions_dir()).resolve()
        host = None if args.any_host else host_toolchain()
        source = None if args.offline else source_for(args.source)
        path = pull(source, args.version, dest, args.public_key, args.allow_unsigned, host, args.verify_full,
                    allow_older=args.allow_older, allow_expired=args.allow_expired)
    # The path's own bytes, for DIR=$(pull ...): one that is not UTF-8 (--dest /tmp/caf$'\xe9') cannot be printed as
    # text under a UTF-8 locale's strict stdout.
    sys.stdout.flush()
    sys.stdout.buffer.write(os.fsencode(path) + b"\n")
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
