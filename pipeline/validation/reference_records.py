"""What validation judges against, typed: the float reference's record (``ReferenceRecord``, ``reference.json``,
written by the reference stage, read by validate and its validation process) and its prompts.

Apart from the validation records (pipeline/validation/records.py) so that the reference stage's code (and so its
fingerprint: an fp32 run of the whole model) holds only what it writes. Each is a ``Record`` (pipeline/core/records.py)
or a part of one, read strictly; on disk exactly its fields as JSON, keys sorted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from pipeline.core.build_records import HostFigures, NeedFigures
from pipeline.core.errors import PipelineError
from pipeline.core.records import Record


@dataclass(frozen=True)
class SliceErrors:
    """One logit error per slice of the reference's ranking (pipeline/validation/parity.py): over its top 5, 50 and
    1000 tokens, and over every token."""

    top5: float
    top50: float
    top1000: float
    all: float

    def items(self) -> list[tuple[str, float]]:
        """(slice, error) in the slices' order, narrowest first."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


@dataclass(frozen=True)
class Prompt:
    """A validation prompt (pipeline/validation/prompts.py): its name and token budget, its text and its chat-templated
    token ids."""

    name: str
    max_tokens: int
    text: str
    input_ids: tuple[int, ...]


@dataclass(frozen=True)
class DtypeNoise:
    """transformers' own model at a lower dtype, teacher-forced on the fp32 continuation: its logit errors against
    fp32 (the noise a build of that dtype is judged against), how many steps chose another token, and of how many."""

    relative: SliceErrors
    absolute: SliceErrors
    divergences: int
    steps: int


@dataclass(frozen=True)
class ReferencePrompt(Prompt):
    """A prompt with the reference's greedy continuation, and the dtype noise per dtype (``bf16``)."""

    output_ids: tuple[int, ...]
    stopped_on_eos: bool
    dtype_noise: dict[str, DtypeNoise]

    @classmethod
    def of(cls, prompt: Prompt, output_ids: list[int], stopped_on_eos: bool,
           dtype_noise: dict[str, DtypeNoise]) -> ReferencePrompt:
        return cls(**{f.name: getattr(prompt, f.name) for f in fields(Prompt)}, output_ids=tuple(output_ids),
                   stopped_on_eos=stopped_on_eos, dtype_noise=dtype_noise)


@dataclass(frozen=True)
class ReferenceModel:
    name: str
    weights_digest: str


@dataclass(frozen=True)
class LogitsFile:
    """reference.safetensors: its name beside reference.json and its sha256."""

    name: str
    sha256: str


@dataclass(frozen=True)
class ReferenceVersions:
    torch: str
    transformers: str
    pipeline: str


@dataclass(frozen=True)
class ReferencePeak:
    peak_rss_bytes: int


@dataclass(frozen=True)
class ReferencePreflight:
    """The host checked for what the float model needs (pipeline/host/preflight.py), beside the peak it took."""

    need: NeedFigures
    host: HostFigures
    measured: ReferencePeak


@dataclass(frozen=True)
class ReferenceRecord(Record):
    """``reference.json``: the float reference's greedy continuation of every validation prompt (its logits are in
    reference.safetensors, ``logits_file``), what made it, and its fingerprint (pipeline/stages/reference.py)."""

    KIND = "reference record"
    MAKE = "run stage=reference first"
    FIX = "It was written by another release of the pipeline, or edited: run stage=reference force=true"
    ERROR = PipelineError

    fingerprint: str
    model: ReferenceModel
    max_new_tokens: int
    top_k: int
    prompts: tuple[ReferencePrompt, ...]
    logits_file: LogitsFile
    versions: ReferenceVersions
    eos_token_ids: tuple[int, ...]
    preflight: ReferencePreflight
