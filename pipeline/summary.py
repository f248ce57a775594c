"""One summary at the end of a multirun (``make demo`` is one): a row per variant, and an exit status that says
whether every variant was built.

Each job of ``python -m pipeline --multirun ...`` records its outcome in ``outcome.json`` in its own output folder
(``hydra.sweep.dir/<job number>/``; every launcher gives a job one, on a shared file system for Slurm): the variant,
whether it succeeded, its error, and what its records say (parity, decode tokens/s, time to first token, the version
and where it was published). A job that fails no longer stops the sweep: the others still run. Once every job has
ended, ``MultirunSummary`` (a Hydra callback, conf/config.yaml ``hydra.callbacks``) logs the table and exits 1 naming
the variants that failed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from hydra.experimental.callback import Callback

from pipeline.core.records import Record

log = logging.getLogger("pipeline")
OUTCOME = "outcome.json"


@dataclass(frozen=True)
class JobOutcome(Record):
    """What one job of a multirun did (``outcome.json``): the variant, whether it succeeded, its error, and what its
    records say (absent where they say nothing)."""

    KIND = "multirun job outcome"
    MAKE = "the job wrote none"

    variant: str | None
    ok: bool
    error: str | None
    parity: bool | None = None
    tokens_per_s: float | None = None
    ttft_ms: float | None = None
    batch_tokens_per_s: float | None = None
    """Every sequence's tokens/s together with the batch's lines all in flight."""
    version: str | None = None
    published: str | None = None
    """``<repo> @ <commit>`` of the version's publish."""


def outcome(cfg, error: str | None) -> JobOutcome:
    """What one job of a multirun did, from the variant's records (absent ones left out)."""
    from pipeline.core.build_records import PublishReceipt
    from pipeline.paths import Paths
    from pipeline.validation.records import ValidationRecord

    row = JobOutcome(cfg.variant.name if cfg.variant else None, error is None, error)
    if cfg.variant is None:
        return row
    paths = Paths.of(cfg)
    report = ValidationRecord.read_if_valid(paths.validation_report)
    if report is not None:
        full = report.concurrency.get(str(cfg.variant.batch_size))
        row = replace(row, parity=report.parity.passed, tokens_per_s=report.throughput.tokens_per_s,
                      ttft_ms=report.throughput.ttft_ms, version=report.version,
                      batch_tokens_per_s=full.aggregate_tokens_per_s if full else None)
    receipt = PublishReceipt.read_if_valid(paths.receipt)
    if receipt is not None:
        row = replace(row, version=receipt.version, published=f"{receipt.repo} @ {receipt.commit[:12]}")
    return row


def write(folder: Path, row: JobOutcome) -> None:
    row.write(Path(folder) / OUTCOME)


def read_all(sweep_dir: Path) -> list[JobOutcome]:
    """Every job's outcome, in job order; one that cannot be read is left out (its job ended before writing it)."""
    paths = sorted(Path(sweep_dir).glob(f"*/{OUTCOME}"),
                   key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    return [row for row in (JobOutcome.read_if_valid(path) for path in paths) if row is not None]


def table(rows: list[JobOutcome]) -> str:
    def cell(value, fmt="{}"):
        return "-" if value is None else fmt.format(value)

    lines = [f"  {'variant':<22} {'result':<7} {'parity':<7} {'tok/s':>7} {'batch':>7} {'TTFT ms':>8}  {'version':<44} "
             "published"]
    for row in rows:
        parity = "-" if row.parity is None else ("pass" if row.parity else "FAIL")
        lines.append(f"  {cell(row.variant):<22} {'ok' if row.ok else 'FAILED':<7} {parity:<7} "
                     f"{cell(row.tokens_per_s, '{:.1f}'):>7} {cell(row.batch_tokens_per_s, '{:.1f}'):>7} "
                     f"{cell(row.ttft_ms, '{:.0f}'):>8}  {cell(row.version):<44} {cell(row.published)}")
    return "\n".join(lines)


class MultirunSummary(Callback):
    """Logs the table once every job of a multirun has ended; exits 1 naming the variants that failed."""

    def on_multirun_end(self, config, **kwargs) -> None:
        # The sweep's own configuration: its ${now:...} resolves as it did for the jobs (Hydra caches the resolver).
        rows = read_all(Path(str(config.hydra.sweep.dir)))
        if not rows:
            return
        failed = [r for r in rows if not r.ok]
        log.info("multirun: %d variant(s), %d succeeded, %d failed:\n%s", len(rows),
                 len(rows) - len(failed), len(failed), table(rows))
        if config.model.get("source") == "tiny" and config.model.get("path") is None:
            from pipeline.models.tiny_model import MEANINGLESS

            log.info("multirun: built from %s", MEANINGLESS)  # make demo's last words: what a newcomer reads first
        if failed:
            for row in failed:
                log.error("multirun: %s failed: %s", row.variant, row.error)
            # SystemExit: Hydra turns a callback's Exception into a warning and carries on.
            raise SystemExit(f"multirun: {len(failed)} of {len(rows)} variant(s) failed: "
                             + ", ".join(str(r.variant) for r in failed))
