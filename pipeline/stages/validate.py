"""Stage 6, validate: parity against the float reference and throughput, of the packaged artifact; then the gates.

The prompts are chosen (and refused when they cannot serve the variant), and the host checked for the memory and
NeuronCores loading the build needs (the preflight, from the checkpoint's weights), before anything is loaded. The work
runs in a fresh interpreter (``pipeline.validation.worker``): verify the archive and its members against the manifest,
unpack safely, load the ranks through the backend's loader, decode the validation prompts and judge them, and time three
context lengths. Then the gates: parity must pass, and throughput must meet the floor configured for this backend
and hardware. A failing gate fails the stage with a table of the numbers, after writing them.

The worker logs one line per prompt and per context length as it goes; they show in this stage's output.

Writes, under ``artifacts/<model>/<variant>/``:
  ``metrics.json``     the headline figures for ``dvc metrics show`` / ``diff`` (``Metrics``): parity verdict and
                       mode, decode tokens/s and time to first token per context length, peak RSS
  ``validation.json``  everything else: what was validated and how, the gates, parity and throughput in full
                       (NxDI's ``latency_ms_p50`` ... ``throughput`` keys beside ``tokens_per_s``, ``ms_per_token``,
                       ``ttft_ms``, overall and per context), costs, per-prompt verdicts and the failure report; the
                       preflight's estimate and the measured peak RSS it can be checked against
and for ``dvc plots``: ``artifacts/<model>/plots/<variant>.json``, one row per context length, and
``artifacts/<model>/plots/concurrency/<variant>.json``, one row per count of sequences in flight (1 .. batch_size).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, fields
from pathlib import Path

from pipeline.artifact import signing
from pipeline.artifact.manifest import Manifest
from pipeline.backends.registry import backend_entry
from pipeline.config import PipelineConfig
from pipeline.core.errors import ConfigError, ParityError, PipelineError, ThroughputError
from pipeline.core.fsutil import atomic_write_json
from pipeline.core.log import log, relay, relay_env
from pipeline.core.records import fingerprint
from pipeline.host import bf16_matmul, preflight
from pipeline.host.procinfo import peak_rss_bytes
from pipeline.paths import Paths
from pipeline.recipe.spec import load_spec
from pipeline.stages import StageResult, StageStatus, code_of
from pipeline.stages import package as package_stage
from pipeline.stages import reference as reference_stage
from pipeline.validation.records import (
    BatchParity,
    ConcurrencyFigures,
    ContextFigures,
    Coverage,
    GateCheck,
    Gates,
    Measured,
    Metrics,
    PromptVerdict,
    ThroughputGate,
    ThroughputSummary,
    TopToken,
    ValidationPeaks,
    ValidationPreflight,
    ValidationRecord,
    WorkerResult,
)
from pipeline.validation.reference_records import ReferenceRecord
from pipeline.validation.worker import ValidationJob, select_prompts

TAIL_LINES = 20  # of the worker's output, in the error when it could not run


def require_floor(cfg: PipelineConfig, backend: str, hardware: str) -> None:
    """A neuron build is validated against a throughput floor for its hardware, or not at all: without one the gate
    would pass anything, and a release would ship unmeasured."""
    key, _ = cfg.validate.throughput.floor(backend, hardware)
    if backend_entry(backend).needs_throughput_floor and key is None:
        known = sorted(cfg.validate.throughput.floors.get(backend, {}))
        raise ConfigError(f"hardware={hardware!r} has no {backend} throughput floor (validate.throughput.floors."
                          f"{backend} has {known}): validate {backend} builds on an inf2 host (hardware=auto detects "
                          "its instance type), name it (hardware=inf2_8xlarge), or add validate.throughput.floors."
                          f"{backend}.{hardware} for this hardware")


def metrics_fingerprint(cfg: PipelineConfig, manifest: Manifest, reference_fingerprint: str, hardware: str) -> str:
    return fingerprint({
        "manifest": fingerprint(manifest.to_json()),  # the whole manifest: members, variant, compiler, archive
        "reference": reference_fingerprint,
        "signing": {"public_key": cfg.package.signing.public_key, "private_key": cfg.package.signing.private_key,
                    "allow_unsigned": cfg.package.signing.allow_unsigned},
        "validate": {"warmup_prompts": cfg.validate.warmup_prompts, "parity": asdict(cfg.validate.parity),
                     "throughput": asdict(cfg.validate.throughput), "prompt_names": cfg.validate.prompt_names},
        "hardware": hardware,
        "code": code_of("validate"),
    })


def read_result(path: Path) -> WorkerResult:
    """The validation process's RESULT.json, read strictly but by json's own reader: it is our own child's file, and
    the figures of a broken build can be NaN or infinite, which the bounded reader for files from outside refuses
    (a parity failure must say so, not that the result is unreadable)."""
    return WorkerResult.from_json(json.loads(path.read_text()), "the validation process's result")


def run_fresh(job: ValidationJob, host: preflight.Resources | None = None, need: preflight.Need | None = None,
              env: dict | None = None) -> Measured:
    """Run the validation job in a new interpreter; returns its metrics or raises what it raised.

    The worker's log lines are logged here as they come (relay): its progress shows in this stage's output and log
    file. A PipelineError it reports is raised again as the same class; anything else (a bug, a crash) is "could not
    run", with the last lines it wrote.
    """
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with tempfile.TemporaryDirectory(prefix="gemma4-validate-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job.to_json()))
        with subprocess.Popen([sys.executable, "-m", "pipeline.validation.worker", str(job_path), str(result_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                              env={**os.environ, **(env or {}), **relay_env()}) as proc:
            try:
                relay(proc.stdout, tail, "pipeline.validation.worker")
            except BaseException:
                proc.kill()  # interrupted here: the worker must not go on holding the artifact and the cores
                raise
        if proc.returncode == -9:
            raise PipelineError(preflight.oom_message("the validation process", host, need))
        if not result_path.exists():
            raise PipelineError(f"validation could not run: the validation process exited with code "
                                f"{proc.returncode} without a result; its last lines:\n" + "\n".join(tail))
        result = read_result(result_path)
    if result.failure is not None:
        failure = result.failure
        raise failure.raised_again() or PipelineError(
            f"validation could not run: {failure.error_type}: {failure.error}\nits last lines:\n" + "\n".join(tail))
    return result.metrics


def throughput_gate(cfg: PipelineConfig, backend: str, hardware: str, prefill: str,
                    summary: ThroughputSummary) -> ThroughputGate:
    """Compare the summary with the floor for this backend and hardware."""
    key, floor = cfg.validate.throughput.floor(backend, hardware)
    rows = []
    enforced = backend_entry(backend).timings_compare if floor is None or floor.enforced is None else floor.enforced
    if floor is not None:
        ttft_limit = floor.ttft_ms_device if prefill == "device" else floor.ttft_ms_host
        if floor.tokens_per_s is not None:
            rows.append(GateCheck("decode tokens/s (slowest context)", summary.tokens_per_s, floor.tokens_per_s,
                                  summary.tokens_per_s >= floor.tokens_per_s))
        if ttft_limit is not None:
            rows.append(GateCheck(f"time to first token ms ({prefill} prefill, short context)", summary.ttft_ms,
                                  ttft_limit, summary.ttft_ms <= ttft_limit))
    return ThroughputGate(key, tuple(rows), all(r.passed for r in rows), enforced)


def parity_table(report: tuple[PromptVerdict, ...]) -> str:
    lines = [f"  {'prompt':<12} {'tokens':>6} {'mode':<14} {'result':<7} {'first div.':>10} {'tf match':>8} "
             f"{'max|dlogit|':>11}"]
    for r in report:
        tf = r.teacher_forced_match
        lines.append(f"  {r.prompt:<12} {r.prompt_tokens:>6} {r.mode:<14} "
                     f"{'pass' if r.passed else 'FAIL':<7} {str(r.first_divergence):>10} "
                     f"{'' if tf is None else f'{tf:.3f}':>8} {r.max_abs_dlogit:>11.2e}")
    return "\n".join(lines)


def throughput_table(contexts: dict[str, ContextFigures], gate: ThroughputGate) -> str:
    lines = [f"  {'context':<9} {'tokens':>6} {'ttft ms':>9} {'tok/s':>8} {'ms/tok':>8} {'p50':>8} {'p90':>8} "
             f"{'p99':>8}"]
    for name, c in sorted(contexts.items(), key=lambda item: item[1].context_tokens):
        lines.append(f"  {name:<9} {c.context_tokens:>6} {c.ttft_ms:>9.1f} {c.tokens_per_s:>8.1f} "
                     f"{c.ms_per_token:>8.2f} {c.latency_ms_p50:>8.2f} {c.latency_ms_p90:>8.2f} "
                     f"{c.latency_ms_p99:>8.2f}")
    if gate.floor is None:
        lines.append("  no throughput floor configured for this backend and hardware: not gated")
    for row in gate.checks:
        verdict = "pass" if row.passed else "FAIL" if gate.enforced else "beyond it (reported, not enforced)"
        lines.append(f"  gate {gate.floor}: {row.check} {row.value:.1f} vs limit {row.limit}: {verdict}")
    if gate.checks and not gate.enforced:
        lines.append(f"  the {gate.floor} floor is reported, not enforced: this backend's timings are this machine's "
                     "CPU and load (validate.throughput.floors.<backend>.<hardware>.enforced=true enforces it)")
    return "\n".join(lines)


def concurrency_table(concurrency: dict[str, ConcurrencyFigures]) -> str:
    """Throughput with 1 .. batch_size sequences in flight (pipeline/validation/batch.py says how it is measured)."""
    lines = [f"  {'in flight':<9} {'tok/s all':>9} {'tok/s each':>10} {'ms/tok':>8} {'itl p50':>8} {'itl p99':>8} "
             f"{'ttft ms':>9} {'worst':>9}"]
    for c in concurrency.values():
        lines.append(f"  {c.sequences:<9} {c.aggregate_tokens_per_s:>9.1f} {c.tokens_per_s:>10.1f} "
                     f"{c.ms_per_token:>8.2f} {c.itl_ms_p50:>8.2f} {c.itl_ms_p99:>8.2f} {c.ttft_ms:>9.1f} "
                     f"{c.ttft_ms_max:>9.1f}")
    return "\n".join(lines)


def batch_failures(batch: BatchParity | None) -> str:
    """What a batched build decoded together that it did not decode alone, or that no line was reused mid-flight."""
    if batch is None or batch.passed:
        return ""
    lines = [f"  {v.prompt} in line {v.line}: decoded together, it differs from itself alone from step "
             f"{v.first_difference} (a sequence's answer must not depend on what is decoded beside it)"
             for v in batch.together if not v.identical]
    if not batch.reused_mid_flight:
        lines.append(f"  of {batch.sequences} sequences in {batch.batch_size} lines, none took a line another had "
                     "left while others decoded: the reuse of a line was not exercised")
    return "\n".join(lines)


def top_tokens(top: tuple[TopToken, ...]) -> str:
    return ", ".join(f"{t.text!r}={t.logit}" for t in top)


def failure_table(report: tuple[PromptVerdict, ...]) -> str:
    lines = []
    for r in report:
        if r.passed:
            continue
        why = "; ".join(r.failures or ["tokens differ"])
        lines.append(f"  {r.prompt} ({r.prompt_tokens} tokens), first divergence at new token "
                     f"{r.first_divergence}: {why}")
        d = r.divergence
        if d:
            lines.append(f"      ...{d.context_before!r} | reference: {d.reference_after!r} | ours: {d.ours_after!r}")
            if d.reference_top is not None:
                lines.append(f"      reference top: {top_tokens(d.reference_top)}")
                lines.append(f"      ours top:      {top_tokens(d.ours_top)}")
    return "\n".join(lines)


def worker_job(cfg: PipelineConfig, manifest: Manifest, reference: ReferenceRecord,
               chosen: list[int]) -> ValidationJob:
    """What the fresh validation process is given (pipeline/validation/worker.py)."""
    paths = Paths.of(cfg)
    return ValidationJob(
        manifest=manifest,
        archive=str((paths.dist / manifest.archive.name).resolve()),
        reference=reference,
        reference_tensors=str(paths.reference_tensors.resolve()),
        prompts=chosen,
        parity=cfg.validate.parity,
        throughput=cfg.validate.throughput,
        weights=str(paths.weights.resolve()),
        text_prefix=cfg.model.text_prefix,
        head_key=cfg.model.head_key,
        workdir=str((paths.variant_dir / "validate").resolve()),
        warmup_prompts=cfg.validate.warmup_prompts,
    )


def measure_in_fresh_process(cfg: PipelineConfig, manifest: Manifest, job: ValidationJob, host: preflight.Resources,
                             need: preflight.Need) -> Measured:
    """Run the job in its own process, which gets its own NeuronCores where its backend runs on them (held until it
    ends), and return what it measured."""
    with contextlib.ExitStack() as held:
        env = None
        lease = backend_entry(manifest.backend).lease_cores(
            manifest.shape, cfg.backend.visible_cores, f"validating {cfg.variant.name}", host.neuron_cores)
        if lease is not None:
            held.callback(lease.release)
            env = lease.env()
        return run_fresh(job, host, need, env)


def validation_record(fp: str, manifest: Manifest, hardware: str, coverage: Coverage, signature: str,
                      passed: preflight.Passed, measured: Measured, gate: ThroughputGate) -> ValidationRecord:
    """validation.json: the measurement with its gates, and what was validated, where and how."""
    return ValidationRecord(
        **{f.name: getattr(measured, f.name) for f in fields(Measured)},
        fingerprint=fp, version=manifest.version, archive_sha256=manifest.archive.sha256, backend=manifest.backend,
        hardware=hardware, coverage=coverage, signature=signature,
        preflight=ValidationPreflight(*passed.figures(), ValidationPeaks(peak_rss_bytes(), measured.peak_rss_mb)),
        gates=Gates(parity=measured.parity.passed, throughput=gate.holds,
                    passed=measured.parity.passed and gate.holds),
        throughput_gate=gate)


def write_records(cfg: PipelineConfig, record: ValidationRecord, measured: Measured) -> None:
    """metrics.json, validation.json (written last: its fingerprint says all is written) and the plot rows."""
    paths = Paths.of(cfg)
    Metrics.of(measured).write(paths.metrics)
    atomic_write_json(paths.plot_rows, [
        {"context": name, "context_tokens": c.context_tokens, "tokens_per_s": c.tokens_per_s,
         "ms_per_token": c.ms_per_token, "ttft_ms": c.ttft_ms}
        for name, c in sorted(record.contexts.items(), key=lambda item: item[1].context_tokens)])
    paths.concurrency_rows.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(paths.concurrency_rows, [
        {"sequences": c.sequences, "aggregate_tokens_per_s": c.aggregate_tokens_per_s, "tokens_per_s": c.tokens_per_s,
         "ms_per_token": c.ms_per_token, "ttft_ms": c.ttft_ms} for c in record.concurrency.values()])
    record.write(paths.validation_report)


def judge(cfg: PipelineConfig, record: ValidationRecord, where: str) -> None:
    """Log the parity and throughput tables (``where``: backend/hardware); raise for the first gate that failed."""
    log.info("validate: %s parity (%s):\n%s", cfg.variant.name, record.parity.mode, parity_table(record.prompts))
    log.info("validate: %s throughput on %s:\n%s", cfg.variant.name, where,
             throughput_table(record.contexts, record.throughput_gate))
    log.info("validate: %s with sequences in flight at once:\n%s", cfg.variant.name,
             concurrency_table(record.concurrency))
    if not record.gates.parity:
        par = record.parity
        together = batch_failures(record.batch_parity)
        raise ParityError(f"{cfg.variant.name}: parity failed ({par.mode}) on {par.prompts - par.prompts_matched} "
                          f"of {par.prompts} prompts" + (", and decoding them together" if together else "")
                          + ":\n" + "\n".join(x for x in (failure_table(record.prompts), together) if x)
                          + f"\nfull report: {Paths.of(cfg).validation_report}")
    if not record.gates.throughput:
        raise ThroughputError(f"{cfg.variant.name}: throughput below the {record.throughput_gate.floor} floor:\n"
                              + throughput_table(record.contexts, record.throughput_gate))


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    manifest = package_stage.load(cfg)
    hardware = preflight.resolve_hardware(cfg.hardware.name)
    require_floor(cfg, manifest.backend, hardware)
    reference, _ = reference_stage.load(cfg)
    fp = metrics_fingerprint(cfg, manifest, reference.fingerprint, hardware)
    previous = ValidationRecord.read_if_valid(paths.validation_report)
    if not cfg.force and previous and previous.fingerprint == fp and paths.metrics.exists() and previous.gates.passed:
        log.info("validate: %s is up to date (%s)", cfg.variant.name, paths.metrics)
        return StageResult("validate", StageStatus.skipped)
    shape = manifest.shape
    chosen, coverage = select_prompts(reference.prompts, shape, reference.max_new_tokens, cfg.validate.prompt_names)
    backend, entry = manifest.backend, backend_entry(manifest.backend)
    entry.create().check_load(shape)  # before the preflight, the signature and the archive
    est = preflight.estimate(load_spec(paths.weights), shape, entry, cfg.model.resources.get(backend),
                             fp32_route=bf16_matmul.rank_graphs_widened(shape))  # 0 where ranks are elsewhere
    passed = preflight.run(est, preflight.validate_need(est.resources, entry, shape, est.describe()), cfg.preflight)
    sig = cfg.package.signing
    accepted = signing.check(paths.dist, manifest.archive.name, sig.verifying_key(), sig.allow_unsigned,
                             f"the artifact in {paths.dist}")
    log.info("validate: %s signature %s", cfg.variant.name, accepted)
    started = time.monotonic()
    log.info("validate: %s (%s) in a fresh process, prompts %s", cfg.variant.name, manifest.version,
             [reference.prompts[i].name for i in chosen])
    measured = measure_in_fresh_process(cfg, manifest, worker_job(cfg, manifest, reference, chosen), passed.host,
                                       passed.need)
    gate = throughput_gate(cfg, manifest.backend, hardware, shape.prefill, measured.throughput)
    record = validation_record(fp, manifest, hardware, coverage, accepted, passed, measured, gate)
    write_records(cfg, record, measured)
    judge(cfg, record, f"{manifest.backend}/{hardware}")
    log.info("validate: %s passed every gate", cfg.variant.name)
    return StageResult("validate", StageStatus.ran, time.monotonic() - started)


def load(cfg: PipelineConfig) -> Metrics:
    """metrics.json (the headline figures)."""
    return Metrics.read(Paths.of(cfg).metrics)


def load_report(cfg: PipelineConfig) -> ValidationRecord:
    """validation.json: every figure, the gates, the per-prompt verdicts."""
    return ValidationRecord.read(Paths.of(cfg).validation_report)
