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

import os
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


def strip_debug_records(path: Path) -> bool:
    """Rewrite the TorchScript archive ``path`` without its debug records (in place, atomically). False when it has
    none; the result is the same bytes whatever path, environment, user, host or time the archive was saved from."""
    path = Path(path)
    reader = torch._C.PyTorchFileReader(str(path))
    names = reader.get_all_records()
    if not any(is_debug_record(n) for n in names):
        return False
    kept = [n for n in names if not is_debug_record(n) and n not in WRITTEN_BY_WRITER]
    tmp = path.with_name(f".{path.name}{TMP_MARK}strip")
    try:
        with open(tmp, "wb") as f:
            writer = torch._C.PyTorchFileWriter(f)  # a stream: the archive is named "archive", as torch.jit.save does
            writer.set_min_version(format_version(reader))
            for name in kept:
                data = reader.get_record(name)  # one record in memory at a time (a weight, a NEFF)
                writer.write_record(name, data, len(data))
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
