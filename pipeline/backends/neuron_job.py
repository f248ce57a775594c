"""What the neuron backend (pipeline/backends/neuron.py) and its compile process (pipeline/backends/neuron_rank.py)
hand each other through files: ``NeuronJob`` (job.json: what to compile, and where) and ``CompileResult``
(result.json: how it went). Both are typed records (pipeline/core/records.py), read strictly on the other side.

Imports nothing heavy (no torch, no Neuron package): what the two sides agree on, and nothing else.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.errors import BuildError
from pipeline.core.records import Record
from pipeline.core.shape import BuildShape

if TYPE_CHECKING:
    from pipeline.backends.base import CheckpointRef

_SAME_CHECKOUT = ("The neuron backend and its compile process are one checkout's code: this is a bug, or a file "
                  "edited while the compile ran; run stage=trace again")


@dataclass(frozen=True)
class JobCheckpoint:
    """The checkpoint to compile from (``CheckpointRef`` as JSON: its directory as a string)."""

    directory: str
    text_prefix: str
    head_key: str


@dataclass(frozen=True)
class NeuronJob(Record):
    """job.json: what the compile process traces, with which arguments, and where it writes (``out_dir``: the rank
    files; ``workdir``: the compiler's scratch directory, ModelBuilder's beneath it)."""

    KIND = "neuron compile job"
    MAKE = "the neuron backend writes it before it starts the compile process (stage=trace)"
    FIX = _SAME_CHECKOUT
    ERROR = BuildError

    checkpoint: JobCheckpoint
    shape: BuildShape
    compiler_args: tuple[str, ...]
    out_dir: str
    workdir: str
    max_parallel: int
    """Ranks compiled at once by parallel_model_trace; 0: all."""
    compile_cache_dir: str | None
    """NEURON_COMPILE_CACHE_URL for the compiler; null keeps the compiler's default."""

    def problems(self) -> list[str]:
        return self.shape.problems()


def make_job(checkpoint: CheckpointRef, shape: BuildShape, compiler_args: list[str], out_dir: Path, workdir: Path,
             max_parallel: int, compile_cache_dir: str | None) -> NeuronJob:
    return NeuronJob(
        checkpoint=JobCheckpoint(str(checkpoint.directory), checkpoint.text_prefix, checkpoint.head_key),
        shape=shape.shape,  # the bare shape: a variant's config is a subclass the record would not write
        compiler_args=tuple(compiler_args),
        # Absolute: the compile runs in its work directory, not where the stage was started.
        out_dir=str(Path(out_dir).resolve()),
        workdir=str(Path(workdir).resolve()),
        max_parallel=max_parallel,
        compile_cache_dir=compile_cache_dir,
    )


@dataclass(frozen=True)
class CompileResult(Record):
    """result.json: the compile's outcome. ``ok``: its time, its peak RSS and the flags ModelBuilder passed per
    bucket (none on the parallel_model_trace path, which takes no flag hook); else the error and its traceback."""

    KIND = "neuron compile result"
    MAKE = "the compile process writes it when it ends (python -m pipeline.backends.neuron_rank)"
    FIX = _SAME_CHECKOUT
    ERROR = BuildError

    ok: bool
    seconds: float | None = None
    peak_rss_bytes: int | None = None
    compiler_flags: dict[str, str] | None = None
    error: str | None = None
    traceback: str | None = None

    @classmethod
    def succeeded(cls, seconds: float, peak_rss_bytes: int, compiler_flags: dict[str, str]) -> CompileResult:
        return cls(ok=True, seconds=seconds, peak_rss_bytes=peak_rss_bytes, compiler_flags=compiler_flags)

    @classmethod
    def failed(cls, exc: BaseException) -> CompileResult:
        """The exception being handled, as the stage process reports it."""
        return cls(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())

    def problems(self) -> list[str]:
        outcome = ("seconds", "peak_rss_bytes", "compiler_flags")
        given = [name for name in outcome if getattr(self, name) is not None]
        if self.ok and (len(given) < len(outcome) or self.error is not None or self.traceback is not None):
            return [f"ok is true: it needs {', '.join(outcome)} and no error or traceback"]
        if not self.ok and (given or self.error is None):
            return [f"ok is false: it needs an error, and none of {', '.join(outcome)}"]
        return []
