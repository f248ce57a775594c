"""File-system helpers: atomic writes, atomic directory replacement, hashing, canonical JSON.

Every stage writes through these so that no output ever sits half-written under its final name.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import resource
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHUNK = 8 * 1024 * 1024
TMP_MARK = ".tmp-"


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace variance: the form every fingerprint hashes."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_stream(stream) -> tuple[int, str]:
    """``(size, sha256)`` of what a binary stream gives until its end (a file, a pipe, a download), read in chunks:
    archives can be many GB and are never held in memory."""
    digest, size = hashlib.sha256(), 0
    while chunk := stream.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f)[1]


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable (the directory entry, not only the data)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _default_mode() -> int:
    """What ``open()`` would have given a new file (mkstemp makes it 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}{TMP_MARK}")
    try:
        os.fchmod(fd, _default_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def json_text(obj: Any) -> str:
    """The JSON of every record and published file: indented, keys sorted, one final newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Pretty, key-sorted JSON with a trailing newline, written atomically."""
    atomic_write_text(path, json_text(obj))


def write_json_if_changed(path: str | os.PathLike, obj: Any) -> bool:
    """Rewrite ``path`` only when its content would change, so its mtime and hash stay put. Returns True if written."""
    text = json_text(obj)
    path = Path(path)
    if path.exists() and path.read_text() == text:
        return False
    atomic_write_text(path, text)
    return True


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def temp_dir_beside(final: Path) -> Path:
    """A fresh, uniquely named directory next to ``final`` (same file system, so the rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}{TMP_MARK}{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished ``tmp`` directory to ``final``, replacing any previous one.

    ``final`` either holds the old complete content or the new complete content; in between it is briefly absent,
    never half-written.
    """
    old = None
    if final.exists():
        old = final.parent / f".{final.name}{TMP_MARK}old-{uuid.uuid4().hex[:12]}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces ``final``, on any error it is removed."""
    tmp = temp_dir_beside(final)
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def clean_stale_temps(directory: Path) -> list[Path]:
    """Remove leftovers of killed runs (``.<name>.tmp-*``) in ``directory``. Returns what was removed."""
    removed = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if entry.name.startswith(".") and TMP_MARK in entry.name:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
            removed.append(entry)
    return removed


# A write that fails for want of room: the file system is full, the user's quota is used up, or the process may not
# write a file that large (``ulimit -f``).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


def space_report(path: str | os.PathLike, what: str, exc: BaseException) -> str:
    """What failed, where, how much room there is, and what to do: the text of a ``DiskFullError``."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = f"{shutil.disk_usage(where).free / 2**30:.2f} GiB free"
    except OSError:
        free = "unknown free space"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    size_limit = "" if limit == resource.RLIM_INFINITY else f"; files are limited to {limit} bytes (ulimit -f)"
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
    return (f"{what}: out of space writing {path} ({reason}); the file system holding {where} has {free}"
            f"{size_limit}. Nothing was kept under its final name: free some space (or move artifacts_dir=...) "
            "and rerun")


@contextlib.contextmanager
def reporting_full_disk(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn a write that runs out of space inside the block into a ``DiskFullError`` saying where and how much."""
    from pipeline.core.errors import DiskFullError

    try:
        yield
    except OSError as exc:
        if is_out_of_space(exc):
            raise DiskFullError(space_report(path, what, exc)) from exc
        raise


def link_or_copy(source: Path, target: Path) -> None:
    """``target`` as a hard link to ``source`` where both are on one file system, else a copy: a checkpoint taken
    from ``model.path``, an archive in a local publish folder's working tree (git keeps its own copy in its objects;
    8 GB less per E4B variant). Safe because neither side is ever written in place: the pipeline replaces its files by
    renaming, and git its working tree's by unlinking."""
    target.unlink(missing_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
