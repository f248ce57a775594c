"""What validation measured, typed: the validation process's result (``WorkerResult``, RESULT.json, holding
``Measured``) and the validate stage's record of it with its gates (``ValidationRecord``, ``validation.json``), read by
publish, the multirun summary and ``neuron-check``; what it judges against is pipeline/validation/reference_records.py.

Each is a ``Record`` (pipeline/core/records.py): read through its class, which refuses a missing, unknown or
wrong-typed key by name. On disk each is exactly its fields as JSON, keys sorted; a validation record is the
measurement plus what was validated and its gates. A prompt's verdict (``PromptVerdict``) holds the keys of its parity
mode only: the others are left out. The preflight's figures are core's (pipeline/core/build_records.py), as in
build.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.core.build_records import CheckedFigures
from pipeline.core.errors import ErrorRecord, InputError, PipelineError, PublishError
from pipeline.core.records import Record, added
from pipeline.validation.reference_records import SliceErrors


@dataclass(frozen=True)
class Latency:
    """neuronx-distributed-inference's report keys over per-step decode latencies, in milliseconds."""

    latency_ms_p50: float
    latency_ms_p90: float
    latency_ms_p95: float
    latency_ms_p99: float
    latency_ms_p100: float
    latency_ms_avg: float


@dataclass(frozen=True)
class ContextFigures(Latency):
    """Throughput at one context length: the prompt's tokens, its time to first token (median), and decode speed."""

    context_tokens: int
    ttft_ms: float
    tokens_per_s: float
    ms_per_token: float


@dataclass(frozen=True)
class ThroughputSummary(Latency):
    """The figures the gates and the regression gate compare: the slowest context's decode speed, the short
    context's first token, the pooled latencies, and NxDI's end-to-end ``throughput`` (worker.measure_throughput)."""

    tokens_per_s: float
    ms_per_token: float
    ttft_ms: float
    throughput: float
    decode_steps: int


@dataclass(frozen=True)
class ConcurrencyFigures:
    """Throughput with ``sequences`` in flight, submitted together, each a prompt of the short context fed the same
    continuation (pipeline/validation/batch.py): every sequence's new tokens over the wall time from submission to
    the last token (``aggregate_tokens_per_s``); one sequence's rate beside the others, 1 / its mean inter-token
    latency, the prefill calls interleaved with its decode steps included (``tokens_per_s``, ``ms_per_token``,
    the latency's percentiles); the time to first token from submission, median and worst (the later sequences
    wait for the prefills ahead of them)."""

    sequences: int
    context_tokens: int
    aggregate_tokens_per_s: float
    tokens_per_s: float
    ms_per_token: float
    itl_ms_p50: float
    itl_ms_p99: float
    ttft_ms: float
    ttft_ms_max: float


@dataclass(frozen=True)
class TogetherVerdict:
    """One sequence of the prompts decoded together: its cache line, whether another sequence had held that line
    before it and how many were decoding when it took it, and whether it decoded bit for bit what its prompt decoded
    alone (else the first step that differs)."""

    prompt: str
    line: int
    line_reused: bool
    decoding_beside: int
    identical: bool
    first_difference: int | None


@dataclass(frozen=True)
class BatchParity:
    """The prompts decoded together (pipeline/validation/batch.py): passed when every sequence is identical to its
    prompt decoded alone and at least one took a line another had left while others decoded."""

    batch_size: int
    sequences: int
    passed: bool
    reused_mid_flight: int
    together: tuple[TogetherVerdict, ...]


@dataclass(frozen=True)
class ParitySummary:
    """Every prompt's verdict in one: passed only if every prompt passed, and the worst figures."""

    mode: str
    passed: bool
    prompts: int
    prompts_matched: int
    teacher_forced_match: float | None
    max_abs_dlogit: float


@dataclass(frozen=True)
class Costs:
    """Seconds each part of the validation took."""

    verify_unpack: float
    load: float
    parity: float
    throughput: float


@dataclass(frozen=True)
class PeakRss:
    """Peak resident memory in MiB: the validation process's, and its largest rank process's (null where the ranks
    run inside it)."""

    ranks: float | None
    host: float


@dataclass(frozen=True)
class ThreadPolicy:
    """torch's threads per phase on the host (pipeline/validation/generation.py): host prefill's (0 where the
    device prefills), each decode step's, and the CPUs this process may use."""

    host_prefill: int
    decode: int
    usable_cpus: int


@dataclass(frozen=True)
class Bf16Matmuls:
    """How a bf16 build's matmuls of ``min_rows`` rows or more ran on this host (pipeline/host/bf16_matmul.py):
    ``native`` (torch's bf16 kernels) or ``fp32`` (fp32 over the same bf16 values); the ranks' route (null where they
    do not run on this CPU: neuron, xla), host prefill's (null where the device prefills), the CPU's bf16 flags the
    route was chosen from, and whether PIPELINE_BF16_MATMUL chose it instead."""

    ranks: str | None
    host_prefill: str | None
    cpu_bf16_flags: tuple[str, ...]
    min_rows: int
    overridden: bool


@dataclass(frozen=True)
class TopToken:
    token: int
    text: str
    logit: float


@dataclass(frozen=True)
class Divergence:
    """Where a failed prompt left the reference (``step``, a new token's index): the text before it, both sides'
    text after it, and each side's top tokens there where both have logits at that step."""

    step: int
    context_before: str
    reference_after: str
    ours_after: str
    ours_top: tuple[TopToken, ...] | None = None
    reference_top: tuple[TopToken, ...] | None = None


@dataclass(frozen=True)
class PromptVerdict:
    """One prompt's parity verdict (pipeline/validation/worker.py, judge). The fields with a default belong to some
    modes only and are left out in the others: the teacher-forced figures in ``teacher_forced`` and ``logits``
    mode, ``route`` in ``logits`` mode (left out where no route passed the prompt), ``failures`` where a check
    failed (always in ``logits`` mode), ``divergence`` in a failed prompt that left the reference."""

    prompt: str
    prompt_tokens: int
    mode: str
    passed: bool
    new_tokens: int
    reference_tokens: int
    first_divergence: int | None
    max_abs_dlogit: float
    ttft_ms: float
    prefill_calls: int
    teacher_forced_match: float | None = None
    relative_error: SliceErrors | None = None
    divergences: int | None = None
    route: str | None = None
    failures: tuple[str, ...] | None = None
    divergence: Divergence | None = None


@dataclass(frozen=True)
class Measured(Record):
    """What the validation process measured (RESULT.json's ``metrics``); the stage applies the gates."""

    KIND = "validation result"
    MAKE = "the validation process wrote none"
    FIX = "The validation process is of another version of the pipeline than the stage: reinstall it"
    ERROR = InputError

    parity: ParitySummary
    throughput: ThroughputSummary
    """The summary. tokens_per_s is decode speed at the slowest context (1 / mean decode step); throughput is NxDI's
    end-to-end (prompt + new tokens) / (prefill + decode time): worker.measure_throughput."""
    contexts: dict[str, ContextFigures]
    """Every figure per context length (the same two rates, per context)."""
    costs_s: Costs
    peak_rss_mb: PeakRss
    threads: ThreadPolicy
    prompts: tuple[PromptVerdict, ...]
    concurrency: dict[str, ConcurrencyFigures] = field(default_factory=dict, kw_only=True)
    """Throughput with 1 .. batch_size sequences in flight, by their count (empty in a record from before batching)."""
    batch_parity: BatchParity | None = field(default=None, kw_only=True)
    """A batched build's prompts decoded together (left out at batch 1)."""
    bf16_matmul: Bf16Matmuls | None = field(default=None, kw_only=True)
    """A bf16 build's: how this CPU ran its matmuls of many rows (left out of an fp32 build's)."""
    rank_collectives: str | None = field(default=None, kw_only=True)
    """How the rank processes exchanged their collectives on this host (pipeline/backends/cpu_collectives.py:
    ``shared_memory`` or ``gloo``); left out where there are none to exchange here (one rank; neuron and xla)."""


@dataclass(frozen=True)
class WorkerResult(Record):
    """RESULT.json: what the validation process (pipeline/validation/worker.py) tells the stage, which reads it as soon
    as the process ends: what it measured, or the error it raised."""

    KIND = "validation process's result"
    MAKE = "the validation process wrote none"
    FIX = "The validation process is of another version of the pipeline than the stage: reinstall it"
    ERROR = InputError

    metrics: Measured | None = None
    failure: ErrorRecord | None = None

    def problems(self) -> list[str]:
        if (self.metrics is None) == (self.failure is None):
            return ["it holds metrics or a failure, exactly one of them"]
        return []


@dataclass(frozen=True)
class Coverage:
    """Which validation prompts cover the variant's buckets: one near a bucket's size, one spanning several, and for
    each smaller bucket of the ladder those whose last prefill call runs in it."""

    near_bucket: tuple[str, ...]
    multi_bucket: tuple[str, ...]
    smaller_buckets: dict[str, tuple[str, ...]] = added(default_factory=dict)


@dataclass(frozen=True)
class GateCheck:
    check: str
    value: float
    limit: float
    passed: bool


@dataclass(frozen=True)
class ThroughputGate:
    """The throughput floor for this backend and hardware (``floor``: its key, null where none is configured), each
    of its checks, whether all passed, and whether a check that did not fails the stage (``enforced``; the cpu
    backend's are reported: config.py FloorConfig.enforced)."""

    floor: str | None
    checks: tuple[GateCheck, ...]
    passed: bool
    enforced: bool

    @property
    def holds(self) -> bool:
        """The gate lets the build through: its checks passed, or they are reported only."""
        return self.passed or not self.enforced


@dataclass(frozen=True)
class Gates:
    parity: bool
    throughput: bool
    passed: bool


@dataclass(frozen=True)
class ValidationPeaks:
    stage_peak_rss_bytes: int
    validation_peak_rss_mb: PeakRss
    """The validation process's (and its largest rank process's)."""


@dataclass(frozen=True)
class ValidationPreflight(CheckedFigures):
    """validation.json's ``preflight``: the check loading the build passed, and the peaks the validation measured."""

    measured: ValidationPeaks


@dataclass(frozen=True)
class ValidationRecord(Measured):
    """``validation.json``: the measurement, what was validated and how, and the gates."""

    KIND = "validation record"
    MAKE = "run stage=validate first"
    FIX = "It was written by another release of the pipeline, or edited: run stage=validate force=true"
    ERROR = PipelineError

    fingerprint: str
    version: str
    archive_sha256: str
    backend: str
    hardware: str
    coverage: Coverage
    signature: str
    """How the archive's signature was judged (pipeline/artifact/signing.py, check)."""
    preflight: ValidationPreflight
    """The host checked for what loading the build needs, and the measured peaks."""
    gates: Gates
    throughput_gate: ThroughputGate


@dataclass(frozen=True)
class ParityVerdict:
    passed: bool
    mode: str


@dataclass(frozen=True)
class ConcurrencyHeadline:
    """metrics.json's figures with ``k`` sequences in flight (``ConcurrencyFigures`` has them all)."""

    aggregate_tokens_per_s: float
    tokens_per_s: float
    ms_per_token: float
    ttft_ms: float

    @classmethod
    def of(cls, figures: ConcurrencyFigures) -> ConcurrencyHeadline:
        return cls(figures.aggregate_tokens_per_s, figures.tokens_per_s, figures.ms_per_token, figures.ttft_ms)


@dataclass(frozen=True)
class Metrics(Record):
    """``metrics.json``: the figures a person compares across builds, few enough for ``dvc metrics show`` to print one
    short row per variant (everything else is in validation.json); published beside each version.

    ``tokens_per_s.<context>``: decode speed at that context length, new tokens per second (1 / the mean decode step
    latency; not NxDI's end-to-end ``throughput``). ``ttft_ms.<context>``: time to the first new token, median over
    the runs. ``peak_rss_mb``: the validation process's and its largest rank process's peak resident memory.
    ``concurrency.<k>``: with k sequences in flight at once (1 .. batch_size), the aggregate rate, one sequence's
    rate and its ms per token beside the others, and the median time to first token.
    """

    KIND = "metrics record"
    MAKE = "run stage=validate first"
    FIX = "It was written by another release of the pipeline, or edited: run stage=validate force=true"
    ERROR = PipelineError

    parity: ParityVerdict
    tokens_per_s: dict[str, float]
    ttft_ms: dict[str, float]
    peak_rss_mb: PeakRss
    concurrency: dict[str, ConcurrencyHeadline] = field(default_factory=dict)

    @classmethod
    def of(cls, measured: Measured) -> Metrics:
        contexts = measured.contexts
        return cls(ParityVerdict(measured.parity.passed, measured.parity.mode),
                   {name: c.tokens_per_s for name, c in contexts.items()},
                   {name: c.ttft_ms for name, c in contexts.items()}, measured.peak_rss_mb,
                   {k: ConcurrencyHeadline.of(f) for k, f in measured.concurrency.items()})


@dataclass(frozen=True)
class ValidationSummary(Record):
    """A published manifest's ``validation``, from validation.json: what the regression gate compares with the next
    version of the variant (pipeline/publishing/regression.py) and the model card shows."""

    KIND = "validation summary"
    MAKE = "the manifest has none"
    FIX = ("It was published by another release of the pipeline, whose figures this one cannot compare: "
           "publish.allow_regression=true publishes without the comparison")
    ERROR = PublishError

    parity: ParitySummary
    throughput: ThroughputSummary
    contexts: dict[str, ContextFigures]
    gates: Gates
    backend: str
    hardware: str
    throughput_floor: str | None
    concurrency: dict[str, ConcurrencyFigures] = added(default_factory=dict)
    """Empty in a summary published before batching."""

    @classmethod
    def of(cls, report: ValidationRecord) -> ValidationSummary:
        return cls(report.parity, report.throughput, report.contexts, report.gates, report.backend, report.hardware,
                   report.throughput_gate.floor, report.concurrency)

    @property
    def full_batch(self) -> ConcurrencyFigures | None:
        """The figures with every line in use (the most sequences measured), or None."""
        return self.concurrency[max(self.concurrency, key=int)] if self.concurrency else None
