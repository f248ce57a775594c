"""What ``pull`` keeps of a version it unpacked, so that using it again costs no download and no re-hash.

A pulled version is ``DEST/<root>/`` (the rank files), with beside it ``<root>.manifest.json`` (the manifest, byte for
byte as published), ``<root>.manifest.sig`` (its signature, when it is signed) and ``<root>.pulled.json``, the
``Pulled`` record written here: the version, its archive's sha256 (with the version, the entry's key: one version
name stands for one set of bytes), the manifest's sha256, the commit and source it came from, and each rank file's
size and sha256 with its file-system stamp (size, mtime, ctime, inode) taken when its bytes were last hashed.

Reuse is then like the Hugging Face cache's: a file whose stamp is unchanged is not read again. The ctime is in the
stamp because no user call sets it (``os.utime`` moves it to now): a file rewritten with its mtime put back still
differs. A file that differs in any way is hashed again (``reverified``), and a record that no longer matches is
rewritten after a full hash; ``full=True`` always hashes (pull and serve ``--verify-full``).

What a record vouches for is what only this user could have changed: it is trusted only where the folder, the rank
directory, the record, the manifest beside it and every rank file are owned by this user and writable by no one else
(writable by the user's private group is allowed; a shared ``/workspace`` that others can write is hashed every
time). The stamps are the files' ``stat`` before they were hashed, and a file whose ``stat`` moved while it was hashed
is refused (``archive.verify_build``).
"""

from __future__ import annotations

import grp
import os
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pipeline.artifact.archive import VerifiedBuild, file_stamp, verify_build
from pipeline.artifact.manifest import Manifest, manifest_beside
from pipeline.core.errors import IntegrityError
from pipeline.core.fsutil import sha256_file
from pipeline.core.log import log
from pipeline.core.records import Record

PULLED_SUFFIX = ".pulled.json"
SIGNATURE_SUFFIX = ".manifest.sig"


@dataclass(frozen=True)
class PulledFile:
    path: str
    size: int
    sha256: str
    mtime_ns: int
    ctime_ns: int
    inode: int


@dataclass(frozen=True)
class Pulled(Record):
    KIND = "pulled version record"
    MAKE = "pull writes it beside each version it unpacks"
    FIX = "pull the version again: it hashes the rank files once more and writes a new record"
    ERROR = IntegrityError
    SCHEMA_VERSION = 1

    schema_version: int
    version: str
    archive_sha256: str
    manifest_sha256: str
    commit: str
    """The commit of the source the version was fetched at (its tag's): the same commit is the same bytes."""
    source: str
    """Where it was fetched from: a publish folder's path, or the Hub's address and the repo id."""
    files: tuple[PulledFile, ...]
    pulled: str
    """When it was unpacked here (UTC): offline, a variant's name takes the version pulled last."""
    hashed: str
    """When the rank files were last hashed in full (UTC)."""


def pulled_beside(rank_dir: Path) -> Path:
    return rank_dir.with_name(rank_dir.name + PULLED_SUFFIX)


def signature_beside(rank_dir: Path) -> Path:
    return rank_dir.with_name(rank_dir.name + SIGNATURE_SUFFIX)


def entries(dest: Path) -> list[tuple[Path, Pulled]]:
    """Every pulled version in ``dest`` whose record this release can read, with its rank directory and manifest
    there, as (rank directory, record)."""
    found = []
    for path in sorted(Path(dest).glob(f"*{PULLED_SUFFIX}")):
        record = Pulled.read_if_valid(path)
        rank_dir = path.with_name(path.name[:-len(PULLED_SUFFIX)])
        if record is not None and rank_dir.is_dir() and manifest_beside(rank_dir).is_file():
            found.append((rank_dir, record))
    return found


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def record(build: VerifiedBuild, manifest: Manifest, commit: str, source: str, pulled: str | None = None) -> Pulled:
    """The record of ``build`` (just hashed against ``manifest``, whose bytes are beside it), fetched from ``source``
    at ``commit``; ``pulled`` is kept from an earlier record of the same entry."""
    build.recheck()  # the stamps recorded are those of the bytes that were hashed
    sha256 = {member.path: member.sha256 for member in build.members}
    files = [PulledFile(name, size, sha256[name], mtime_ns, ctime_ns, inode)
             for name, size, mtime_ns, ctime_ns, inode in build.stamps]
    return Pulled(schema_version=Pulled.SCHEMA_VERSION, version=manifest.version,
                  archive_sha256=manifest.archive.sha256,
                  manifest_sha256=sha256_file(manifest_beside(build.directory)), commit=commit, source=source,
                  files=tuple(files), pulled=pulled or now(), hashed=now())


def private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's own group with no other members (Ubuntu's user-private groups: there the umask
    is 002, and every file a user makes is group-writable)."""
    try:
        return gid == os.getegid() and not grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def writable_by_others(paths: list[Path]) -> Path | None:
    """The first of ``paths`` that another user could change: owned by someone else, world-writable, or writable by
    a group that is not this user's private one."""
    for path in paths:
        st = path.stat()
        if (st.st_uid != os.geteuid() or st.st_mode & stat.S_IWOTH
                or (st.st_mode & stat.S_IWGRP and not private_group(st.st_gid))):
            return path
    return None


def unchanged_since_hashed(rank_dir: Path, manifest: Manifest, pulled: Pulled) -> str | None:
    """None when ``pulled`` vouches for ``rank_dir`` as ``manifest`` describes it, without reading a byte; else what
    differs (the files are then hashed again)."""
    members = {m.path: m for m in manifest.members}
    open_to_others = writable_by_others([rank_dir.parent, rank_dir, pulled_beside(rank_dir), manifest_beside(rank_dir),
                                         *(rank_dir / name for name in members if (rank_dir / name).is_file())])
    if open_to_others is not None:
        return f"{open_to_others} could be changed by another user"
    if (pulled.version, pulled.archive_sha256) != (manifest.version, manifest.archive.sha256):
        return f"its record is of {pulled.version} with archive sha256 {pulled.archive_sha256[:12]}"
    if pulled.manifest_sha256 != sha256_file(manifest_beside(rank_dir)):
        return "the manifest beside it is not the one its record was made with"
    recorded = {f.path: f for f in pulled.files}
    if sorted(recorded) != sorted(members) or sorted(p.name for p in rank_dir.iterdir()) != sorted(members):
        return "it does not hold exactly the manifest's files"
    for name, member in members.items():
        f = recorded[name]
        if f.sha256 != member.sha256 or f.size != member.size:
            return f"{name}'s recorded sha256 is not the manifest's"
        if file_stamp(rank_dir, name) != (name, f.size, f.mtime_ns, f.ctime_ns, f.inode):
            return f"{name} changed (size, mtime, ctime or inode) since it was hashed"
    return None


def reverified(rank_dir: Path, manifest: Manifest, full: bool = False) -> tuple[VerifiedBuild, str]:
    """``rank_dir`` checked against ``manifest``: by its ``Pulled`` record when every file is as it was when hashed
    (``"by its record"``), else hashed in full (``"hashed"``; an existing record is then rewritten with the new stamps,
    keeping its commit and source). Raises ``IntegrityError`` naming the file that does not match."""
    path = pulled_beside(rank_dir)
    pulled = Pulled.read_if_valid(path) if path.is_file() else None
    differs = "--verify-full" if full else "no record" if pulled is None else unchanged_since_hashed(rank_dir, manifest,
                                                                                                   pulled)
    if differs is None:  # the stamps a backend rechecks before loading are the recorded ones, of the hashed bytes
        stamps = tuple((f.path, f.size, f.mtime_ns, f.ctime_ns, f.inode) for f in pulled.files)
        return VerifiedBuild(rank_dir, manifest.members, stamps), "by its record"
    if pulled is not None and not full:
        log.info("%s is hashed again: %s", rank_dir.name, differs)
    build = verify_build(rank_dir, manifest.members)
    if pulled is not None:
        record(build, manifest, pulled.commit, pulled.source, pulled.pulled).write(path)
    return build, "hashed"
