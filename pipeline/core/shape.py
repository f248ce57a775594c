"""The build shape: the variant fields that decide what is traced, declared once, their allowed values (``Dtype`` and
``Prefill``), and the rank files a build holds.
Imported by the config schema, the preflight and every backend; it imports nothing heavy (no torch), so commands
that only read a configuration start fast.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from pipeline.core.choices import StrEnum, values
from pipeline.core.records import added

if TYPE_CHECKING:
    import torch

MAX_BATCH_SIZE = 64
"""The most sequences a build may decode at once: a bound on what a typo can ask the trace for. What fits a NeuronCore
is the trace's own refusal (pipeline/backends/neuron_memory.py): E4B's caches are small (one KV head per rank), so its
2048-position variants fit all 64 and its 8192-position device-prefill one about 22."""


class Dtype(StrEnum):
    """``variant.dtype``: weights, matmuls and KV caches (the residual stream is fp32 either way)."""

    bf16 = "bf16"
    fp32 = "fp32"

    @property
    def torch_name(self) -> str:
        """The torch dtype's name (torch is imported lazily)."""
        return {"bf16": "bfloat16", "fp32": "float32"}[self.value]


class Prefill(StrEnum):
    """``variant.prefill``: ``device`` (prefill and decode graphs over one weight set) or ``host`` (host prefill
    seeds the KV)."""

    device = "device"
    host = "host"


@dataclass(unsafe_hash=True)
class BuildShape:
    """The variant fields that decide what is traced, declared here once: a variant's config
    (``pipeline.config.VariantConfig``) and its record in build.json and the manifest
    (``pipeline.core.build_records.Variant``) are a ``BuildShape`` with a name.

    Not frozen, as a value would be: OmegaConf's schema subclasses it, and a frozen schema cannot be overridden. Still
    hashed by value, so a shape can key a table (the tests key their builds by it); nothing changes a shape once it is
    made. The subclasses, whose name the config's loader sets, are not hashable, and never equal a bare shape: compare
    their ``shape``."""

    kv_max: int
    """KV cache length: prompt plus generated tokens must fit."""
    bucket: int
    """Prefill bucket: device prefill runs the prompt in chunks of this many tokens."""
    dtype: Dtype
    prefill: Prefill
    tp_degree: int
    batch_size: int = added(default=1)
    """Sequences the graphs decode at once (NxDI's and optimum-neuron's ``batch_size``): the KV caches hold this many,
    a decode step takes one token of each, and a prefill fills one of them (its cache line, ``seq_ids``). 1 keeps
    the graphs every batch-1 build has always had."""
    smaller_buckets: tuple[int, ...] = added(default=())
    """Prefill buckets below ``bucket``, increasing: with ``bucket`` they are the ladder (NxDI's
    ``context_encoding_buckets``), a prefill graph each. A prompt runs ``bucket`` tokens per call while more remain,
    and its last part (all of a short prompt) in the smallest bucket that holds it, so a chat turn does not pay for a
    whole ``bucket``. Empty: one bucket, the graphs a build without a ladder has always had."""

    def __post_init__(self) -> None:
        # OmegaConf hands a list (and a record's reader a tuple); a tuple keeps the shape hashable.
        self.smaller_buckets = tuple(self.smaller_buckets)

    @property
    def shape(self) -> BuildShape:
        """The shape alone: a variant's config or record without its name."""
        return BuildShape(**{f.name: getattr(self, f.name) for f in fields(BuildShape)})

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, Dtype(self.dtype).torch_name)

    def problems(self) -> list[str]:
        """Everything wrong with these settings, each naming the ``variant.*`` key and the fix."""
        found = []
        # The config schema's enums refuse these first; a shape read back from a record or a job is checked here.
        if self.dtype not in values(Dtype):
            found.append(f"variant.dtype={self.dtype!r} is not one of {values(Dtype)}")
        if self.prefill not in values(Prefill):
            found.append(f"variant.prefill={self.prefill!r} is not one of {values(Prefill)}")
        if self.tp_degree < 1:
            found.append(f"variant.tp_degree={self.tp_degree} must be at least 1")
        if not 1 <= self.batch_size <= MAX_BATCH_SIZE:
            found.append(f"variant.batch_size={self.batch_size} must be between 1 and {MAX_BATCH_SIZE} (the sequences "
                         "decoded at once; the largest that fits a NeuronCore is smaller: the trace stage says which)")
        if self.bucket < 1 or self.kv_max < 1:
            found.append(f"variant.kv_max={self.kv_max} and variant.bucket={self.bucket} must be positive")
        elif self.bucket > self.kv_max:
            found.append(f"variant.bucket={self.bucket} is larger than variant.kv_max={self.kv_max}: "
                         "a prefill bucket must fit in the KV cache; lower bucket or raise kv_max")
        elif self.kv_max % self.bucket:
            fit = self.kv_max - self.kv_max % self.bucket
            found.append(f"variant.kv_max={self.kv_max} is not a multiple of variant.bucket={self.bucket}: a padded "
                         f"last bucket would run past the cache; use kv_max={fit} or {fit + self.bucket}")
        ladder = list(self.smaller_buckets)
        if ladder and self.prefill != Prefill.device:
            found.append(f"variant.smaller_buckets={ladder} is for prefill=device: host prefill runs a prompt on the "
                         "host, with no prefill graph on the ranks; set smaller_buckets=[]")
        elif ladder and (any(b < 1 for b in ladder) or ladder != sorted(set(ladder)) or ladder[-1] >= self.bucket):
            found.append(f"variant.smaller_buckets={ladder} must be increasing, each at least 1 and below "
                         f"variant.bucket={self.bucket} (the largest bucket, a full prefill call)")
        return found

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The ladder: ``smaller_buckets`` and ``bucket``, increasing (empty for host prefill)."""
        return (*self.smaller_buckets, self.bucket) if self.prefill == Prefill.device else ()

    def bucket_for(self, tokens: int) -> int:
        """The smallest prefill bucket that holds ``tokens`` (at most ``bucket``; ``bucket`` for host prefill, whose
        coverage of the validation prompts is still told in buckets)."""
        return next(b for b in (*self.smaller_buckets, self.bucket) if b >= min(tokens, self.bucket))

    def prefill_entry(self, tokens: int) -> str:
        """The prefill graph of a bucket: ``prefill`` for ``bucket`` (as every build without a ladder names it),
        ``prefill_<tokens>`` for a smaller one."""
        if tokens not in self.prefill_buckets:
            raise ValueError(f"{tokens} tokens is none of this build's prefill buckets {list(self.prefill_buckets)}")
        return "prefill" if tokens == self.bucket else f"prefill_{tokens}"

    def entry_rows(self, entry: str) -> tuple[int, int]:
        """``(sequences, tokens)`` one call of ``entry`` runs: a decode step one token of every line, a prefill one
        sequence's bucket."""
        if entry == "decode":
            return self.batch_size, 1
        if entry == "prefill":
            return 1, self.bucket
        tokens = entry.removeprefix("prefill_")
        if not (tokens.isdigit() and int(tokens) in self.smaller_buckets):
            raise ValueError(f"{entry!r} is none of this build's entry points {list(self.entries)}")
        return 1, int(tokens)

    @property
    def batched(self) -> bool:
        """Whether the graphs decode several sequences: their entry points then take each call's cache lines
        (``seq_ids``) as a fifth input."""
        return self.batch_size > 1

    @property
    def entries(self) -> tuple[str, ...]:
        """The traced entry points: device prefill has a prefill graph per bucket next to decode (the ladder's
        smaller ones first); host prefill decodes only."""
        smaller = tuple(self.prefill_entry(b) for b in self.smaller_buckets)
        return (*smaller, "prefill", "decode") if self.prefill == "device" else ("decode",)

    @property
    def prefill_entries(self) -> tuple[str, ...]:
        """The prefill graphs, one per bucket of the ladder (none for host prefill)."""
        return tuple(e for e in self.entries if e != "decode")


def rank_members(tp_degree: int) -> list[str]:
    return [f"tp_{rank}.pt" for rank in range(tp_degree)]
