"""The regression gate: a rebuild goes out only if it is no worse than the version of the same variant published
before it (what the target's head holds in ``<variant>/manifest.json``: the last version published there), when both
are builds of the same weights (``model.weights_digest``). A build of other weights (a new checkpoint revision, a
fine-tune) is compared all the same and the rows recorded, but not gated: each build's parity figures are against its
own reference, so across weights they measure nothing; its own parity must pass, as every publish's must.

Compared, from the validation summaries both manifests carry: parity must still pass on at least as many prompts,
and its teacher-forced match may fall by at most ``teacher_forced_drop``; decode tokens/s (the slowest context) may
fall by at most ``tokens_per_s_drop``, as may every sequence's tokens/s together with the batch's lines all in flight
(where both summaries measured it), and time to first token rise by at most ``ttft_ms_rise`` (fractions of the
previous figures). Throughput is compared only between builds measured on the same backend and hardware, and only for
the backends in ``throughput_backends`` (by default those whose entry says their timings compare, neuron: the cpu
backend's timings swing with the machine's load); other pairs are recorded as not comparable. The outcome, every
row, is recorded in the published manifest (``regression``), including when ``publish.allow_regression=true`` let a
regression through.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.artifact.manifest import Manifest, RegressionCheck, RegressionResult
from pipeline.backends.registry import BACKENDS
from pipeline.core.errors import PublishError
from pipeline.validation.records import ValidationSummary


def _row(check: str, previous, current, limit: str, passed: bool) -> RegressionCheck:
    change = None
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (previous, current))
    if numbers and previous:
        change = round((current - previous) / previous, 4)
    return RegressionCheck(check, previous, current, change, limit, bool(passed))


def compared_backends(tolerances) -> list[str]:
    """``publish.regression.throughput_backends``, or where it is null the backends whose timings compare."""
    if tolerances.throughput_backends is not None:
        return list(tolerances.throughput_backends)
    return [name for name, entry in BACKENDS.items() if entry.timings_compare]


@dataclass(frozen=True)
class Comparison:
    """Rows comparing two validation summaries, and whether throughput was comparable."""

    checks: tuple[RegressionCheck, ...]
    comparable_throughput: bool

    @property
    def passed(self) -> bool:
        return all(row.passed for row in self.checks)


def compare(previous: ValidationSummary, current: ValidationSummary, tolerances) -> Comparison:
    """The rows comparing ``current`` with ``previous``, each with its limit and verdict."""
    prev_parity, cur_parity = previous.parity, current.parity
    rows = [
        _row("parity passed", prev_parity.passed, cur_parity.passed, "must pass",
             cur_parity.passed or not prev_parity.passed),
        _row("prompts matched", prev_parity.prompts_matched, cur_parity.prompts_matched, ">= previous",
             cur_parity.prompts_matched >= prev_parity.prompts_matched),
    ]
    prev_tf, cur_tf = prev_parity.teacher_forced_match, cur_parity.teacher_forced_match
    if prev_tf is not None and cur_tf is not None:
        floor = round(prev_tf - tolerances.teacher_forced_drop, 4)
        rows.append(_row("teacher-forced match", prev_tf, cur_tf, f">= {floor}", cur_tf >= floor))
    comparable = ((previous.backend, previous.hardware) == (current.backend, current.hardware)
                  and current.backend in compared_backends(tolerances))
    if comparable:
        prev_tps, cur_tps = previous.throughput.tokens_per_s, current.throughput.tokens_per_s
        least = round(prev_tps * (1 - tolerances.tokens_per_s_drop), 3)
        rows.append(_row("decode tokens/s", prev_tps, cur_tps, f">= {least}", cur_tps >= least))
        prev_ttft, cur_ttft = previous.throughput.ttft_ms, current.throughput.ttft_ms
        most = round(prev_ttft * (1 + tolerances.ttft_ms_rise), 3)
        rows.append(_row("time to first token ms", prev_ttft, cur_ttft, f"<= {most}", cur_ttft <= most))
        before, now = previous.full_batch, current.full_batch
        if before is not None and now is not None and before.sequences == now.sequences:
            least = round(before.aggregate_tokens_per_s * (1 - tolerances.tokens_per_s_drop), 3)
            rows.append(_row(f"tokens/s, {now.sequences} in flight", before.aggregate_tokens_per_s,
                             now.aggregate_tokens_per_s, f">= {least}", now.aggregate_tokens_per_s >= least))
    return Comparison(tuple(rows), comparable)


def table(result: Comparison | RegressionResult) -> str:
    lines = [f"  {'check':<24} {'previous':>12} {'current':>12} {'change':>8}  {'limit':<14} result"]
    for r in result.checks:
        change = "" if r.change is None else f"{100 * r.change:+.1f}%"
        lines.append(f"  {r.check:<24} {r.previous!s:>12} {r.current!s:>12} {change:>8}  "
                     f"{r.limit!s:<14} {'ok' if r.passed else 'REGRESSED'}")
    if isinstance(result, RegressionResult) and not result.same_weights:
        lines.append(f"  not gated: {result.against} is a build of other weights (model.weights_digest), so its "
                     "figures are not this build's to meet; recorded only")
    if not result.comparable_throughput:
        lines.append("  throughput not compared: the builds were measured on different backends or hardware, or on a "
                     "backend outside publish.regression.throughput_backends")
    return "\n".join(lines)


def gate(previous: Manifest | None, version: str, fingerprint: str, summary: ValidationSummary, tolerances,
         allow: bool, weights_digest: str) -> RegressionResult | None:
    """The regression record for the manifest, or None when there is nothing to compare with (``previous``: the
    manifest the target's head holds for this variant).

    Raises ``PublishError`` with the table when the rebuild regressed and ``allow`` is off, and when the previous
    summary cannot be read (another release published it) unless ``allow`` is on.
    """
    if previous is None or previous.validation is None:
        return None
    if previous.fingerprint == fingerprint:
        # An earlier attempt of this very publish landed (its answer was lost): keep the record it made, so the
        # retry sends the same bytes and makes no second commit.
        return previous.regression
    try:
        before = ValidationSummary.from_json(previous.validation, f"{previous.version}'s manifest (the target's head)")
    except PublishError:
        if not allow:
            raise
        return None
    found = compare(before, summary, tolerances)
    same = previous.model.weights_digest == weights_digest
    record = RegressionResult(previous.version, previous.fingerprint, found.comparable_throughput, found.checks,
                              found.passed, allowed=bool(same and allow and not found.passed), same_weights=same)
    if not found.passed and not allow and same:
        raise PublishError(f"{version} regressed against {record.against}, the last published version of this "
                           f"variant:\n{table(record)}\nNothing was published. publish.allow_regression=true "
                           "publishes it anyway (recorded in its manifest); the tolerances are "
                           "publish.regression.*")
    return record
