"""Rank files that do not say where they were built: TorchScript archives without their debug records.

``torch.jit.save`` writes, beside each code file of the archive, a ``<file>.debug_pkl`` record: the source range of
every graph node, each naming the absolute path of a Python file on the stack when it was traced (the checkout's
``pipeline/recipe/model.py``, the virtual environment's ``torch/nn/modules/module.py``,
``multiprocessing/spawn.py``). So the same commit built in two directories, or two virtual environments, gave
different rank files, and the scheduled runner never reproduced a developer's build. Nothing else in the archive
names a path, a user, a host or a time: the code records name modules (``__torch__.pipeline.recipe.model``), and
PyTorch's zip writer stamps no dates.

The debug records are optional: ``torch.jit.load`` reads one only when it is there
(torch/csrc/jit/serialization/import.cpp, ``reader_->hasRecord(debug_file)``) and uses it only for the source lines
of error messages. ``strip_debug_records`` rewrites an archive without them, record by record, through PyTorch's own
zip reader and writer (the writer aligns data records as torch.load expects and recomputes the archive's
``.data/serialization_id``, a digest of its records, from what is left). The same on every backend: the cpu
backend's ranks, and the neuron backend's files (NxD's ``parallel_model_trace`` and ModelBuilder save TorchScript
archives the same way; their compiled NEFFs are records like any other and are copied unchanged).
"""

from __future__ import annotations

import errno
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path

import torch

from pipeline.core.errors import BuildError
from pipeline.core.fsutil import TMP_MARK

# Rewritten by the writer itself: the format version (set from the original with set_min_version) and the digest of
# the records (over what is kept, so it no longer depends on the dropped records).
WRITTEN_BY_WRITER = ("version", ".data/version", ".data/serialization_id")


def is_debug_record(name: str) -> bool:
    return name.endswith(".debug_pkl")


def format_version(reader) -> int:
    for name in ("version", ".data/version"):
        if reader.has_record(name):
            return int(reader.get_record(name).decode().strip())
    raise ValueError("no format version record: not a TorchScript archive")


def record_sizes(path: Path) -> dict[str, int]:
    """Each record's size, by the reader's names (the archive's zip entries without their top folder): the reader
    of torch 2.8, the production pin, has no ``get_record_size``."""
    with zipfile.ZipFile(path) as archive:
        return {info.filename.split("/", 1)[1]: info.file_size for info in archive.infolist() if "/" in info.filename}


def strip_debug_records(path: Path) -> bool:
    """Rewrite the TorchScript archive ``path`` without its debug records (in place, atomically). False when it has
    none; the result is the same bytes whatever path, environment, user, host or time the archive was saved from."""
    path = Path(path)
    reader = torch._C.PyTorchFileReader(str(path))
    names = reader.get_all_records()
    if not any(is_debug_record(n) for n in names):
        return False
    kept = [n for n in names if not is_debug_record(n) and n not in WRITTEN_BY_WRITER]
    sizes = record_sizes(path)
    # The rewrite is a second copy beside the original: a write failing inside PyTorch's zip writer aborts the
    # process (``save`` says why), so the room is checked first (an OSError, ENOSPC or EFBIG).
    require_room(path, path.stat().st_size)
    tmp = path.with_name(f".{path.name}{TMP_MARK}strip")
    try:
        with open(tmp, "wb") as f:
            writer = torch._C.PyTorchFileWriter(f)  # a stream: the archive is named "archive", as torch.jit.save does
            writer.set_min_version(format_version(reader))
            for name in kept:
                # One record in memory at a time (a weight, a NEFF), read once into a tensor's storage: get_record
                # would return a bytes object copied from its own buffer, twice the largest record (E4B's head
                # shard is 0.67 GB).
                if sizes[name]:
                    data = reader.get_storage_from_record(name, sizes[name], torch.uint8)
                    writer.write_record(name, data.untyped_storage(), sizes[name])
                    del data
                else:
                    writer.write_record(name, b"", 0)
            writer.write_end_of_file()
            f.flush()
            os.fsync(f.fileno())
        rewritten = torch._C.PyTorchFileReader(str(tmp))  # whole, and holding every record kept, before it replaces
        missing = set(kept) - set(rewritten.get_all_records())
        if missing or format_version(rewritten) != format_version(reader):
            raise BuildError(f"rewriting {path} without its debug records lost {sorted(missing)[:5]}: the original "
                             "is left as it was")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True


SAVE_SLACK_BYTES = 64 << 20  # beyond the tensors: the archive's code, pickles and zip records


def archive_bytes(module, held: Iterable[torch.Tensor] = ()) -> int:
    """What ``torch.jit.save`` writes for ``module``, bounded from above: its tensors' storages, plus slack.
    ``held``: tensors the module holds beyond its parameters and buffers (in attributes, as NxD's ``NxDModel`` holds
    every rank's weights), each storage counted once."""
    storages, unshared = {}, 0
    for tensor in [*module.parameters(), *module.buffers(), *held]:
        try:  # a device tensor (NxD's loaded weights) may not expose its storage: counted by its own bytes
            storage = tensor.untyped_storage()
            key, size = (str(tensor.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = None, tensor.numel() * tensor.element_size()
        if key is None or key[1] == 0:
            unshared += size
        else:
            storages[key] = size
    return sum(storages.values()) + unshared + SAVE_SLACK_BYTES


def require_room(path: Path, size: int, copies: int = 1) -> None:
    """Refuse (``OSError``: EFBIG for ``ulimit -f``, else ENOSPC) a file of ``size`` bytes at ``path`` that the
    process's file size limit cannot hold, or ``copies`` of which its file system cannot, before a byte is written."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size > limit:
        raise OSError(errno.EFBIG, f"a {size}-byte file is over this process's file size limit of {limit} bytes",
                      str(path))
    stat = os.statvfs(path.parent)
    if copies * size > stat.f_bavail * stat.f_frsize:
        raise OSError(errno.ENOSPC, f"{copies} x {size} bytes do not fit in the {stat.f_bavail * stat.f_frsize} "
                      "bytes free", str(path))


def save(module, path: Path, strip: bool = True, held: Iterable[torch.Tensor] = ()) -> None:
    """``torch.jit.save(module)`` into the new file ``path``, holding no copy of the archive in memory, then
    ``strip_debug_records``; refused with an ``OSError`` before writing when the file system or ``ulimit -f`` cannot
    hold the file and the stripped copy ``strip_debug_records`` writes beside it.

    ``torch.jit.save`` to a file object first builds the whole archive in memory (``save_to_buffer``): at E4B's
    widths, a rank of 1.18 GiB of weights peaked 3.6 GiB above it. To a path it writes record by record, but a failed
    write throws from the zip writer's destructor and aborts the process (C++ terminate, torch 2.13 and 2.8 alike,
    tried under ``ulimit -f``; a pipe does not do either: the writer checks its stream's position), hence the check
    first. What the check cannot see (another process filling the disk during the save) still aborts the rank
    process, which its parent reports with the signal. ``strip=False`` leaves the rewrite to the caller (the neuron
    backend's stage does it once ModelBuilder's work files are gone). ``held``: as for ``archive_bytes``.
    """
    path = Path(path)
    require_room(path, archive_bytes(module, held), copies=2 if strip else 1)
    torch.jit.save(module, str(path))
    if strip:
        strip_debug_records(path)
