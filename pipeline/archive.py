"""Deterministic archives of a rank directory, and their verified, allow-listed extraction.

Packing streams every member once: the bytes read are hashed (member sha256) and written into the tar, and the
bytes written are hashed (archive sha256) on the way to disk. Members are sorted and carry fixed metadata (mtime 0,
uid/gid 0, no user names, mode 0644), and gzip's header time is 0, so the same rank files always give the same
archive bytes.

Extraction trusts nothing: the archive's sha256 must match the manifest before it is opened; then only the exact
expected members (``<root>/`` and ``<root>/<member>`` regular files) are accepted, each no larger than the manifest
says; their data is written by this module (never by ``tarfile.extract``) into a fresh temporary directory, hashed,
and only a complete, verified directory is renamed into place. Links, devices, absolute or ``..`` names,
duplicates and extra members are refused, and the destination is left untouched.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import zlib
from pathlib import Path
from typing import BinaryIO

from pipeline.errors import IntegrityError
from pipeline.fsutil import CHUNK, sha256_file, temp_dir_beside

SUFFIX = {"tar": ".tar", "tar.gz": ".tar.gz"}


class _HashingWriter(io.RawIOBase):
    """Pass-through file object that hashes and counts what is written."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.raw.write(data)


class _HashingReader:
    """Pass-through reader that hashes what is read (tarfile only calls ``read``)."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.digest = raw, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.digest.update(data)
        return data


def _info(name: str, size: int, is_dir: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = 0 if is_dir else size
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode = 0o755 if is_dir else 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(src_dir: Path, members: list[str], root: str, out_path: Path, fmt: str) -> dict:
    """Write ``out_path`` (tar or tar.gz) holding ``root/`` and ``root/<member>``; return checksums.

    Returns ``{"members": [{path, size, sha256}], "archive": {name, format, size, sha256, root}}``.
    """
    if fmt not in SUFFIX:
        raise ValueError(f"unknown archive format {fmt!r}")
    entries = []
    with open(out_path, "wb") as raw:
        sink = _HashingWriter(raw)
        compressed = gzip.GzipFile(filename="", mode="wb", fileobj=sink, mtime=0, compresslevel=6) \
            if fmt == "tar.gz" else None
        with tarfile.open(fileobj=compressed or sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_info(root, 0, is_dir=True))
            for name in sorted(members):
                path = src_dir / name
                size = path.stat().st_size
                with open(path, "rb") as f:
                    reader = _HashingReader(f)
                    tar.addfile(_info(f"{root}/{name}", size), reader)
                entries.append({"path": name, "size": size, "sha256": reader.digest.hexdigest()})
        if compressed is not None:
            compressed.close()
        raw.flush()
        os.fsync(raw.fileno())
    return {
        "members": entries,
        "archive": {"name": out_path.name, "format": fmt, "size": sink.size, "sha256": sink.digest.hexdigest(),
                    "root": root},
    }


def verify_file(path: Path, size: int, sha256: str, what: str) -> None:
    if not path.is_file():
        raise IntegrityError(f"{what} {path} is missing")
    if path.stat().st_size != size:
        raise IntegrityError(f"{what} {path} has {path.stat().st_size} bytes, the manifest says {size}")
    actual = sha256_file(path)
    if actual != sha256:
        raise IntegrityError(f"{what} {path} has sha256 {actual}, the manifest says {sha256}: it is corrupt or "
                             "was tampered with; fetch it again")


def _member_name(info: tarfile.TarInfo, root: str, allowed: dict[str, dict]) -> str:
    """The member file name of ``info``, or raise: only ``root/`` and ``root/<allowed>`` regular files pass."""
    name = info.name
    if name.startswith("/") or "\\" in name or "\0" in name:
        raise IntegrityError(f"archive member {name!r} has an absolute or unsafe name")
    parts = name.rstrip("/").split("/")
    if ".." in parts or "." in parts:
        raise IntegrityError(f"archive member {name!r} leaves its directory")
    if info.issym() or info.islnk():
        raise IntegrityError(f"archive member {name!r} is a link ({info.linkname!r}); only regular files are allowed")
    if not (info.isreg() or info.isdir()):
        raise IntegrityError(f"archive member {name!r} is a device, fifo or other special file")
    if info.isdir():
        if parts != [root]:
            raise IntegrityError(f"archive member {name!r} is an unexpected directory")
        return ""
    if len(parts) != 2 or parts[0] != root or parts[1] not in allowed:
        raise IntegrityError(f"archive member {name!r} is not one of the expected files "
                             f"{[f'{root}/{m}' for m in sorted(allowed)]}")
    if info.size > allowed[parts[1]]["size"]:
        raise IntegrityError(f"archive member {name!r} is {info.size} bytes, larger than the "
                             f"{allowed[parts[1]]['size']} the manifest allows")
    return parts[1]


def extract_verified(archive: Path, manifest: dict, dest: Path) -> Path:
    """Verify ``archive`` against ``manifest`` and unpack its rank files into ``dest`` (a new directory).

    ``dest`` ends up holding exactly the manifest's members, each with its manifest sha256, or does not change.
    """
    spec = manifest["archive"]
    verify_file(archive, spec["size"], spec["sha256"], "archive")
    allowed = {m["path"]: m for m in manifest["members"]}
    root = spec["root"]
    tmp = temp_dir_beside(dest)
    try:
        seen: set[str] = set()
        mode = "r|gz" if spec["format"] == "tar.gz" else "r|"
        try:
            with tarfile.open(archive, mode=mode) as tar:
                for info in tar:
                    member = _member_name(info, root, allowed)
                    if not member:
                        continue
                    if member in seen:
                        raise IntegrityError(f"archive member {info.name!r} appears twice")
                    seen.add(member)
                    _write_member(tar, info, tmp / member, allowed[member])
        except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
            raise IntegrityError(f"archive {archive} cannot be read: {exc}") from None
        missing = sorted(set(allowed) - seen)
        if missing:
            raise IntegrityError(f"archive {archive} lacks members {missing}")
        if dest.exists():
            raise IntegrityError(f"refusing to replace existing {dest}: unpack into a new directory")
        os.replace(tmp, dest)
        return dest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_member(tar: tarfile.TarFile, info: tarfile.TarInfo, path: Path, expected: dict) -> None:
    source = tar.extractfile(info)
    digest, size = hashlib.sha256(), 0
    with open(path, "xb") as out:
        while chunk := source.read(CHUNK):
            size += len(chunk)
            if size > expected["size"]:
                raise IntegrityError(f"archive member {info.name!r} runs past its manifest size {expected['size']}")
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if size != expected["size"] or digest.hexdigest() != expected["sha256"]:
        raise IntegrityError(f"archive member {info.name!r} does not match the manifest (size {size}, "
                             f"sha256 {digest.hexdigest()})")
