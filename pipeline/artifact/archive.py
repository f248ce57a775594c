"""Deterministic archives of a rank directory, and their verified, allow-listed extraction.

Packing is one streaming pass: each member is read once, in large chunks, hashed (member sha256) on the way into
the tar stream, compressed (``tar.zst``: zstd on every core; ``tar.gz``: gzip, for the seed's consumers; ``tar``),
and hashed again (archive sha256) on the way to disk. The tar stream is written here, not by ``tarfile``: sorted
members with fixed metadata (mtime 0, uid/gid 0, no user names, modes 0755/0644), and compressors whose output does
not depend on time or thread count (zstd's multi-threaded output is the same for any number of workers; gzip's
header time is 0). The same rank files always give the same archive bytes.

Extraction trusts nothing: the archive's sha256 must match the manifest before it is opened; the decompressed stream
may not run past what the manifest's members account for, nor hold an extended (PAX, GNU long-name) header past 16
KiB or more than four of them in a row, nor a zstd frame asking for a window past 32 MiB; what cannot be decompressed
is refused naming the archive; only the exact expected members (``<root>/`` and ``<root>/<member>`` regular files) are
accepted, each no larger than the manifest says; their data is written by this module (never ``tarfile.extract``)
into a fresh temporary directory and hashed; only a complete, verified directory is renamed into place. Links,
devices, absolute or ``..`` names, duplicates and extra members are refused, and the destination is left untouched.
The result is a ``VerifiedBuild``: the only thing a backend will load.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pipeline.artifact.formats import FORMATS
from pipeline.artifact.manifest import ArchiveFile, Manifest
from pipeline.core.build_records import Member
from pipeline.core.errors import IntegrityError
from pipeline.core.fsutil import is_out_of_space, sha256_file, temp_dir_beside

READ_CHUNK = 8 << 20
BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240: tar files are padded to whole records
ZSTD_LEVEL = 3
# The largest PAX or GNU long-name record taken: ours carry one path of at most 255 + 255 bytes in one block. tarfile
# reads such a record whole into memory before anything else can look at it (a 2 GiB one took 6.3 GB).
MAX_EXTENDED_HEADER = 16 << 10
EXTENDED_TYPES = frozenset({tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                            tarfile.GNUTYPE_LONGLINK})
# The most extended headers taken in a row before a member. tarfile reads the header after an extended one by calling
# itself, so a chain of 600 ends in a RecursionError. Ours write at most one (a PAX record before a long name); other
# writers two (GNU: a long link, then a long name; PAX: a global record, then the member's).
MAX_EXTENDED_IN_A_ROW = 4
# The largest zstd window taken. Decompression holds one window in memory, and a frame header can ask for 2 GiB (or
# more) in a few bytes. pack writes 2 MiB windows (level 3); 32 MiB takes any level up to 20. libzstd refuses a frame
# over this bound before it allocates anything for it.
MAX_ZSTD_WINDOW = 32 << 20


# -- packing ------------------------------------------------------------------------------------------------------

class _HashingSink:
    """Counts and hashes what is written before passing it on."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


def _header(name: str, size: int, is_dir: bool) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = 0 if is_dir else size
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.mode = 0o755 if is_dir else 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


class _TarStream:
    """The tar format, written sequentially: header, data, padding to 512 bytes; two zero blocks; record padding."""

    def __init__(self, sink):
        self.sink, self.written = sink, 0

    def _write(self, data) -> None:
        self.sink.write(data)
        self.written += len(data)

    def add_dir(self, name: str) -> None:
        self._write(_header(name + "/", 0, is_dir=True))

    def add_file(self, name: str, path: Path) -> tuple[int, str]:
        size = path.stat().st_size
        self._write(_header(name, size, is_dir=False))
        digest, seen = hashlib.sha256(), 0
        with open(path, "rb") as f:
            while chunk := f.read(READ_CHUNK):
                digest.update(chunk)
                seen += len(chunk)
                self._write(chunk)
        if seen != size:
            raise IntegrityError(f"{path} changed size while it was being packed ({size} -> {seen} bytes)")
        if size % BLOCK:
            self._write(b"\0" * (BLOCK - size % BLOCK))
        return size, digest.hexdigest()  # as read: what the manifest records

    def close(self) -> None:
        self._write(b"\0" * (2 * BLOCK))
        if self.written % RECORD:
            self._write(b"\0" * (RECORD - self.written % RECORD))


def _compressor(fmt: str, sink, threads: int):
    """A writer for ``fmt`` over ``sink``, and how to finish it."""
    if fmt == "tar.zst":
        import zstandard

        # threads >= 1: multi-threaded framing, whose output is the same for any number of workers.
        writer = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=max(1, threads), write_checksum=True) \
            .stream_writer(sink, closefd=False)
        return writer, lambda: writer.flush(zstandard.FLUSH_FRAME)
    if fmt == "tar.gz":
        writer = gzip.GzipFile(filename="", mode="wb", fileobj=sink, mtime=0, compresslevel=6)
        return writer, writer.close
    if fmt == "tar":
        return sink, lambda: None
    raise ValueError(f"unknown archive format {fmt!r}: choose one of {list(FORMATS)}")


@dataclass(frozen=True)
class Packed:
    """What ``pack`` wrote: each member's size and sha256 as it was read, and the archive file."""

    members: tuple[Member, ...]
    archive: ArchiveFile


def pack(src_dir: Path, members: list[str], root: str, out_path: Path, fmt: str, threads: int = 0) -> Packed:
    """Write ``out_path`` holding ``root/`` and ``root/<member>`` for each member, in one pass over the inputs."""
    threads = threads or os.cpu_count() or 1
    entries = []
    with open(out_path, "wb") as raw:
        sink = _HashingSink(raw)
        writer, finish = _compressor(fmt, sink, threads)
        tar = _TarStream(writer)
        tar.add_dir(root)
        for name in sorted(members):
            entries.append(Member(name, *tar.add_file(f"{root}/{name}", src_dir / name)))
        tar.close()
        finish()
        raw.flush()
        os.fsync(raw.fileno())
    return Packed(tuple(entries), ArchiveFile(out_path.name, fmt, sink.size, sink.digest.hexdigest(), root))


# -- verification ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VerifiedBuild:
    """A directory whose files were hashed against a manifest, and their file-system stamps at that moment.

    Backends load only these; ``recheck`` (cheap: ``stat`` only) refuses a file that changed since it was hashed.
    """

    directory: Path
    members: tuple[Member, ...]
    stamps: tuple[tuple[str, int, int, int, int], ...]  # (name, size, mtime_ns, ctime_ns, inode)

    def recheck(self) -> None:
        for stamp in self.stamps:
            if file_stamp(self.directory, stamp[0]) != stamp:
                raise IntegrityError(f"{self.directory / stamp[0]} changed after it was verified: refusing to load it")


def require_verified(build: object) -> VerifiedBuild:
    """What every backend's ``load`` starts with: a ``VerifiedBuild``, never a bare path (loading TorchScript runs
    code)."""
    if not isinstance(build, VerifiedBuild):
        raise TypeError("backends load only a VerifiedBuild (archive.extract_verified or verify_build)")
    return build


def file_stamp(directory: Path, name: str) -> tuple[str, int, int, int, int]:
    """What ``stat`` says of a file that any change to it moves: size, mtime, ctime (no user call can set it back)
    and inode."""
    st = (directory / name).stat()
    return name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def check_stat(path: Path, size: int, what: str, source: str = "the manifest") -> None:
    """What ``stat`` can refuse of a file before it is hashed: a link, a missing file, another size."""
    if path.is_symlink():  # its bytes could change after they are hashed, and the stamps are the target's
        raise IntegrityError(f"{what} {path} is a symbolic link: only a regular file is checked and loaded (copy the "
                             "file in its place; for a DVC output, `dvc config cache.type reflink,hardlink,copy`)")
    if not path.is_file():
        raise IntegrityError(f"{what} {path} is missing")
    if path.stat().st_size != size:
        raise IntegrityError(f"{what} {path} has {path.stat().st_size} bytes, {source} says {size}")


def verify_file(path: Path, size: int, sha256: str, what: str) -> None:
    check_stat(path, size, what)
    actual = sha256_file(path)
    if actual != sha256:
        raise IntegrityError(f"{what} {path} has sha256 {actual}, the manifest says {sha256}: it is corrupt or "
                             "was tampered with; fetch it again")


def verify_build(directory: Path, members: tuple[Member, ...]) -> VerifiedBuild:
    """Hash an existing rank directory against ``members``; it must hold exactly those files."""
    directory = Path(directory)
    found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    expected = sorted(m.path for m in members)
    if found != expected:
        raise IntegrityError(f"{directory} holds {found}, expected exactly {expected}")
    stamps = []
    for m in members:
        before = file_stamp(directory, m.path) if (directory / m.path).is_file() else None
        verify_file(directory / m.path, m.size, m.sha256, "rank file")
        if file_stamp(directory, m.path) != before:  # the stamp must be of the bytes that were hashed
            raise IntegrityError(f"rank file {directory / m.path} changed while it was being verified: refusing it")
        stamps.append(before)
    return VerifiedBuild(directory, tuple(members), tuple(stamps))


# -- extraction -----------------------------------------------------------------------------------------------------

def _member_name(info: tarfile.TarInfo, root: str, allowed: dict[str, Member]) -> str:
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
    if info.size > allowed[parts[1]].size:
        raise IntegrityError(f"archive member {name!r} is {info.size} bytes, larger than the "
                             f"{allowed[parts[1]].size} the manifest allows")
    return parts[1]


class _BoundedTarInfo(tarfile.TarInfo):
    """A header as tarfile reads it (``TarInfo.frombuf``, for every header block, the extended ones included), refused
    before tarfile reads the record it announces when that is an extended header larger than
    ``MAX_EXTENDED_HEADER`` or a sparse file (which our archives never hold); and a chain of more than
    ``MAX_EXTENDED_IN_A_ROW`` extended headers, refused before tarfile recurses into the next."""

    @classmethod
    def fromtarfile(cls, tar):
        # tarfile calls this for a member's header and again, from within, for the header after each extended one:
        # how deeply the calls nest is how many extended headers came in a row. Counted on the TarFile being read.
        depth = getattr(tar, "extended_in_a_row", -1) + 1
        if depth > MAX_EXTENDED_IN_A_ROW:
            raise IntegrityError(f"more than {MAX_EXTENDED_IN_A_ROW} extended headers in a row (PAX or GNU "
                                 "long-name records) before a member")
        tar.extended_in_a_row = depth
        try:
            return super().fromtarfile(tar)
        finally:
            tar.extended_in_a_row = depth - 1

    @classmethod
    def frombuf(cls, buf, encoding, errors):
        info = super().frombuf(buf, encoding, errors)
        if info.type in EXTENDED_TYPES and info.size > MAX_EXTENDED_HEADER:
            raise IntegrityError(f"an extended header of {info.size} bytes (at most {MAX_EXTENDED_HEADER} are "
                                 "taken)")
        if info.type == tarfile.GNUTYPE_SPARSE:
            raise IntegrityError("a sparse file")
        return info


class _Bounded:
    """A decompressed stream that refuses to give more than ``limit`` bytes in all (a compressed archive is small
    on disk and may decompress to anything)."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit, self.given = stream, limit, 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.given += len(data)
        if self.given > self.limit:
            raise IntegrityError(f"it decompresses to more than the {self.limit} bytes its manifest's members "
                                 "account for")
        return data


def tar_bytes_bound(members: list[Member]) -> int:
    """The most bytes a tar stream of ``members`` (and their directory) can take as ``pack`` writes it: each
    entry's data in whole blocks behind at most two header blocks and one extended record, the end blocks and the
    record padding."""
    per_entry = 2 * BLOCK + MAX_EXTENDED_HEADER
    data = sum(-(-m.size // BLOCK) * BLOCK for m in members)
    return data + (len(members) + 1) * per_entry + 2 * BLOCK + RECORD


class _Zstd:
    """zstd's stream reader, bounded to ``MAX_ZSTD_WINDOW``, whose refusals (corrupt data, a checksum that does not
    match, a window past the bound) are a ``ValueError``, as a corrupt gzip stream's are: the caller names the archive.
    """

    def __init__(self, raw: BinaryIO):
        import zstandard

        self.error = zstandard.ZstdError
        self.reader = zstandard.ZstdDecompressor(max_window_size=MAX_ZSTD_WINDOW) \
            .stream_reader(raw, read_size=READ_CHUNK, closefd=False)

    def read(self, size: int = -1) -> bytes:
        try:
            return self.reader.read(size)
        except self.error as exc:
            raise ValueError(f"its zstd data is corrupt or needs a window past {MAX_ZSTD_WINDOW >> 20} MiB ({exc})") \
                from None


def _decompressed(fmt: str, raw: BinaryIO):
    if fmt == "tar.zst":
        return _Zstd(raw)
    if fmt == "tar.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if fmt == "tar":
        return raw
    raise IntegrityError(f"archive format {fmt!r} is not one of {list(FORMATS)}")


def extract_verified(archive: Path, manifest: Manifest, dest: Path, staging: Path | None = None) -> VerifiedBuild:
    """Verify ``archive`` against ``manifest`` and unpack its rank files into ``dest`` (a new directory), through a
    temporary directory in ``staging`` (on ``dest``'s file system; default: beside ``dest``).

    ``dest`` ends up holding exactly the manifest's members, each with its manifest sha256, or does not change.
    """
    spec = manifest.archive
    verify_file(archive, spec.size, spec.sha256, "archive")
    if dest.exists():
        raise IntegrityError(f"refusing to unpack into existing {dest}: choose a new directory")
    allowed = {m.path: m for m in manifest.members}
    tmp = temp_dir_beside(staging / dest.name) if staging else temp_dir_beside(dest)
    try:
        seen: set[str] = set()
        try:
            with open(archive, "rb") as raw:
                stream = _Bounded(_decompressed(spec.format, raw), tar_bytes_bound(list(allowed.values())))
                with tarfile.open(fileobj=stream, mode="r|", bufsize=READ_CHUNK, tarinfo=_BoundedTarInfo) as tar:
                    for info in tar:
                        member = _member_name(info, spec.root, allowed)
                        if not member:
                            continue
                        if member in seen:
                            raise IntegrityError(f"archive member {info.name!r} appears twice")
                        seen.add(member)
                        _write_member(tar, info, tmp / member, allowed[member])
        except IntegrityError as exc:  # what the checks above refused, named by the archive
            raise IntegrityError(f"archive {archive} is refused: {exc}") from None
        except (tarfile.TarError, EOFError, OSError, zlib.error, ValueError) as exc:
            if is_out_of_space(exc):  # the destination is full, not the archive broken: the caller says where
                raise
            raise IntegrityError(f"archive {archive} cannot be read: {exc}") from None
        missing = sorted(set(allowed) - seen)
        if missing:
            raise IntegrityError(f"archive {archive} lacks members {missing}")
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return VerifiedBuild(dest, manifest.members, tuple(file_stamp(dest, m) for m in sorted(allowed)))


def _write_member(tar: tarfile.TarFile, info: tarfile.TarInfo, path: Path, expected: Member) -> None:
    source = tar.extractfile(info)
    digest, size = hashlib.sha256(), 0
    with open(path, "xb") as out:
        while chunk := source.read(READ_CHUNK):
            size += len(chunk)
            if size > expected.size:
                raise IntegrityError(f"archive member {info.name!r} runs past its manifest size {expected.size}")
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    if size != expected.size or digest.hexdigest() != expected.sha256:
        raise IntegrityError(f"archive member {info.name!r} does not match the manifest (size {size}, "
                             f"sha256 {digest.hexdigest()})")
