"""Validation of what batching adds: sequences decoded together, a cache line reused mid-flight, and throughput with
1 to ``batch_size`` sequences in flight. Run by the validation process (pipeline/validation/worker.py) after the
prompts were decoded alone and judged against the reference.

Together. Every chosen prompt is submitted at once to the decode engine, as ``serve`` submits its requests (continuous
batching: ``batch_size`` sequences decode at a time, the rest take the lines the finished ones leave). At least
``batch_size + 1`` sequences are submitted (the prompts again, in turn, when there are fewer), so that at least one
takes a line another sequence left while the others still decode. Each sequence's tokens and logits must be, bit for
bit, those its prompt decoded alone: what a sequence decodes never depends on what is decoded beside it.

Concurrency. ``k`` sequences of the short context (``validate.throughput.short_tokens``), submitted together, each
fed the same fixed continuation of ``decode_tokens`` steps, for k = 1 .. ``batch_size``: the aggregate rate (every
sequence's new tokens over the wall time from submission to the last token), one sequence's rate beside the others
(1 / its mean inter-token latency, the interleaved prefill calls included), the inter-token latency's percentiles,
and the time to first token (from submission; later sequences wait for the prefills ahead of them).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from pipeline.config import ThroughputConfig
from pipeline.core.log import log
from pipeline.core.shape import BuildShape
from pipeline.decoding.engine import BatchEngine
from pipeline.decoding.runner import BatchRunner
from pipeline.decoding.sequence import Sequence, Step
from pipeline.validation.records import BatchParity, ConcurrencyFigures, TogetherVerdict


@dataclass
class Decoded:
    """One sequence decoded together with others: its steps and when each arrived (its ``on_step``)."""

    sequence: Sequence
    steps: list[Step] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)

    def __call__(self, _: Sequence, step: Step) -> bool:
        self.steps.append(step)
        self.arrived.append(time.perf_counter())
        return True


def decode_together(runner: BatchRunner, sequences: list[Sequence]) -> list[Decoded]:
    """Submit every sequence at once and decode until all are done; each one's steps and arrival times."""
    decoded = [Decoded(seq) for seq in sequences]
    for d in decoded:
        d.sequence.on_step = d
    BatchEngine(runner).run(*sequences)
    for d in decoded:
        if d.sequence.error is not None:
            raise d.sequence.error
    return decoded


def first_difference(tokens: list[int], logits: torch.Tensor, alone_tokens: list[int],
                     alone_logits: torch.Tensor) -> int | None:
    """The first step whose token or logits differ by a single bit from the run alone (None: identical)."""
    for step in range(max(len(tokens), len(alone_tokens))):
        if (step >= len(tokens) or step >= len(alone_tokens) or tokens[step] != alone_tokens[step]
                or not torch.equal(logits[step], alone_logits[step])):
            return step
    return None


def together(runner: BatchRunner, eos_ids: frozenset[int], names: list[str], prompts: list[list[int]],
             new_tokens: int, forced: list[list[int] | None],
             alone: list[tuple[list[int], torch.Tensor]]) -> BatchParity:
    """Decode the prompts together (repeated in turn up to ``lines + 1`` sequences) and compare each with ``alone``
    (its prompt's tokens and logits decoded alone)."""
    count = max(len(prompts), runner.lines + 1)
    order = [i % len(prompts) for i in range(count)]
    sequences = [Sequence(list(prompts[i]), new_tokens, eos_ids, forced=forced[i]) for i in order]
    decoded = decode_together(runner, sequences)
    verdicts = []
    for i, d in zip(order, decoded):
        tokens = [s.token for s in d.steps]
        logits = torch.stack([s.logits for s in d.steps])
        diff = first_difference(tokens, logits, *alone[i])
        verdicts.append(TogetherVerdict(prompt=names[i], line=d.sequence.admitted.line,
                                        decoding_beside=d.sequence.admitted.decoding_beside,
                                        line_reused=d.sequence.admitted.line_reused, identical=diff is None,
                                        first_difference=diff))
    reused = sum(v.line_reused and v.decoding_beside > 0 for v in verdicts)
    passed = all(v.identical for v in verdicts) and reused > 0
    log.info("validate: %d sequences decoded together in %d lines: %s, %d took a line mid-flight", count,
             runner.lines, "each as it decoded alone" if all(v.identical for v in verdicts) else "DIFFERENT from alone",
             reused)
    return BatchParity(batch_size=runner.lines, sequences=count, passed=passed, reused_mid_flight=reused,
                       together=tuple(verdicts))


def concurrency_prompt(shape: BuildShape, settings: ThroughputConfig, filler: list[int]) -> tuple[list[int], list[int]]:
    """The short context's prompt and the continuation fed after it (as worker.measure_throughput makes them)."""
    steps = settings.decode_tokens + 1
    length = max(1, min(settings.short_tokens, shape.kv_max - steps))
    prompt = (filler * (length // len(filler) + 1))[:length]
    feed = (filler * (steps // len(filler) + 1))[:steps]
    return prompt, feed


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (what NxDI's benchmark report uses via numpy's default, within a sample)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def measure_concurrency(runner: BatchRunner, shape: BuildShape, settings: ThroughputConfig,
                        filler: list[int]) -> dict[str, ConcurrencyFigures]:
    """Throughput with 1 .. ``batch_size`` sequences in flight (the module's docstring says how), keyed by their
    count; warm-up rounds with every line in use first, never timed."""
    prompt, feed = concurrency_prompt(shape, settings, filler)

    def round_of(k: int) -> tuple[float, list[Decoded]]:
        started = time.perf_counter()
        return started, decode_together(runner, [Sequence(list(prompt), len(feed), forced=feed) for _ in range(k)])

    for _ in range(settings.warmup_runs):
        round_of(shape.batch_size)
    figures = {}
    for k in range(1, shape.batch_size + 1):
        tokens, wall, ttft, itl = 0, 0.0, [], []
        for _ in range(settings.runs):
            started, decoded = round_of(k)
            tokens += sum(len(d.steps) for d in decoded)
            wall += max(d.arrived[-1] for d in decoded) - started
            ttft += [d.arrived[0] - started for d in decoded]
            itl += [b - a for d in decoded for a, b in zip(d.arrived, d.arrived[1:])]
        mean = sum(itl) / len(itl)
        figures[str(k)] = ConcurrencyFigures(
            sequences=k, context_tokens=len(prompt), aggregate_tokens_per_s=round(tokens / wall, 3),
            tokens_per_s=round(1 / mean, 3), ms_per_token=round(1e3 * mean, 3),
            itl_ms_p50=round(1e3 * percentile(itl, 50), 3), itl_ms_p99=round(1e3 * percentile(itl, 99), 3),
            ttft_ms=round(1e3 * statistics.median(ttft), 3), ttft_ms_max=round(1e3 * max(ttft), 3))
        f = figures[str(k)]
        log.info("validate: %d of %d sequences in flight: %.1f tokens/s in all, %.1f each, first token %.1f ms "
                 "(median)", k, shape.batch_size, f.aggregate_tokens_per_s, f.tokens_per_s, f.ttft_ms)
    return figures
