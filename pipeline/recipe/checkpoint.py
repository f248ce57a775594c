"""Read tensors of a safetensors checkpoint by name, sliced, without loading the whole model.

A ``Checkpoint`` indexes the headers of every ``*.safetensors`` file in a directory and serves reads through
``safe_open(...).get_slice`` (memory-mapped), so a rank only ever touches its own rows or columns of each tensor and
the host only the embedding rows of the tokens it looks up. ``verify`` checks the checkpoint against the spec before
any work: a missing tensor, an unexpected one or a wrong shape is an error that names it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.core.errors import CheckpointError
from pipeline.recipe.spec import ModelSpec

HEAD = "lm_head.weight"  # the recipe's name for the output head
READ_CHUNK_BYTES = 64 << 20
_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


class Checkpoint:
    """The text-decoder tensors of a checkpoint directory.

    Args:
        directory: a Hugging Face checkpoint directory (``config.json`` and ``*.safetensors``).
        text_prefix: where the decoder's tensors live, ``model.`` for a text checkpoint or
            ``model.language_model.`` for the multimodal Gemma-4 release.
        head_key: the untied output head's key (only read when embeddings are not tied).
    """

    def __init__(self, directory: str | Path, text_prefix: str, head_key: str = "lm_head.weight"):
        self.directory = Path(directory)
        self.text_prefix = text_prefix
        self.head_key = head_key
        self._index = self._read_index()
        self._handles: dict[Path, object] = {}

    def _read_index(self) -> dict[str, TensorInfo]:
        from safetensors import safe_open

        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.directory}")
        index: dict[str, TensorInfo] = {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key in index:
                        raise CheckpointError(f"tensor {key!r} appears in both {index[key].file.name} and {path.name}")
                    info = f.get_slice(key)
                    index[key] = TensorInfo(path, tuple(info.get_shape()), info.get_dtype())
        return index

    def close(self) -> None:
        for handle in self._handles.values():
            with contextlib.suppress(Exception):
                handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- naming -----------------------------------------------------------------------------------------------

    def key(self, name: str, spec: ModelSpec) -> str:
        """The checkpoint key of a recipe tensor name (text-relative, or ``lm_head.weight``)."""
        if name == HEAD:
            return self.text_prefix + "embed_tokens.weight" if spec.tie_word_embeddings else self.head_key
        return self.text_prefix + name

    def shape(self, name: str, spec: ModelSpec) -> tuple[int, ...]:
        return self._index[self.key(name, spec)].shape

    def keys(self) -> list[str]:
        return sorted(self._index)

    def stored_bytes(self, name: str, spec: ModelSpec) -> int:
        """The bytes a recipe tensor takes in the checkpoint (0 when the checkpoint has no such tensor)."""
        info = self._index.get(self.key(name, spec))
        return _prod(info.shape) * _DTYPE_BYTES.get(info.dtype, 4) if info else 0

    # -- verification ------------------------------------------------------------------------------------------

    def verify(self, spec: ModelSpec) -> None:
        """Refuse a checkpoint missing a tensor, with an unexpected one under the text prefix, or with a wrong shape."""
        expected = {self.text_prefix + name: shape for name, shape in spec.text_tensor_shapes().items()}
        if not spec.tie_word_embeddings:
            expected[self.head_key] = (spec.vocab_size, spec.hidden_size)
        ignorable = {self.text_prefix + name for name in spec.ignorable_text_tensors()}
        problems = []
        for key, shape in sorted(expected.items()):
            info = self._index.get(key)
            if info is None:
                problems.append(f"missing tensor {key!r} (expected shape {list(shape)})")
            elif info.shape != shape:
                problems.append(f"tensor {key!r} has shape {list(info.shape)}, config.json implies {list(shape)}")
        for key in sorted(self._index):
            if key.startswith(self.text_prefix) and key not in expected and key not in ignorable:
                problems.append(f"unexpected tensor {key!r} "
                                "(not part of the Gemma-4 text decoder config.json describes)")
        if problems:
            shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise CheckpointError(
                f"checkpoint {self.directory} does not match its config.json (text prefix {self.text_prefix!r}):\n  "
                + "\n  ".join(shown)
                + "\nCheck model.text_prefix, or re-download the checkpoint at the pinned model.revision."
            )

    # -- reads ---------------------------------------------------------------------------------------------------

    def _slice(self, key: str):
        from safetensors import safe_open

        info = self._index.get(key)
        if info is None:
            raise CheckpointError(f"missing tensor {key!r} in {self.directory}")
        handle = self._handles.get(info.file)
        if handle is None:
            handle = safe_open(info.file, framework="pt").__enter__()
            self._handles[info.file] = handle
        return handle.get_slice(key)

    def read(self, name: str, spec: ModelSpec, dim: int | None = None, start: int = 0, stop: int | None = None):
        """Read a recipe tensor, optionally only ``[start:stop]`` along ``dim`` (0 or 1), as an owned copy.

        The file is mapped only while a chunk of at most ``READ_CHUNK_BYTES`` is copied out, so the pages a read
        touches never pile up: loading a rank costs what the rank keeps plus one chunk, never a whole tensor of the
        checkpoint (E4B's tied head alone is 1.25 GiB in bf16).
        """
        from safetensors import safe_open

        key = self.key(name, spec)
        info = self._index.get(key)
        if info is None:
            raise CheckpointError(f"missing tensor {key!r} in {self.directory}")
        if dim not in (None, 0, 1):
            raise ValueError(f"can only slice dim 0 or 1, not {dim}")
        shape = list(info.shape)
        rows = range(*slice(start, stop).indices(shape[0])) if dim == 0 else range(shape[0])
        cols = slice(start, stop) if dim == 1 else slice(None)
        out_shape = [len(rows)] + shape[1:]
        if dim == 1:
            out_shape[1] = len(range(*cols.indices(shape[1])))
        row_bytes = max(1, _DTYPE_BYTES.get(info.dtype, 4) * max(1, _prod(shape[1:])))
        step = max(1, READ_CHUNK_BYTES // row_bytes)
        out = None
        for first in range(rows.start, rows.stop, step):
            last = min(first + step, rows.stop)
            with safe_open(info.file, framework="pt") as f:
                sl = f.get_slice(key)
                part = sl[first:last] if dim != 1 else sl[first:last, cols]
                if out is None:
                    out = torch.empty(out_shape, dtype=part.dtype)
                out[first - rows.start:last - rows.start] = part  # copied out before the mapping goes
        return out if out is not None else torch.empty(out_shape)

    def read_rows(self, name: str, spec: ModelSpec, rows: list[int]) -> torch.Tensor:
        """Gather rows (embedding lookups) without reading the rest of the table."""
        return self._slice(self.key(name, spec))[rows]
