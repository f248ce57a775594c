"""Stage 6, validate: parity against the float reference and throughput, of the packaged artifact.

The work runs in a fresh interpreter (``pipeline.validation``): verify the archive and its members against the
manifest, unpack safely, load the ranks through the backend's loader, decode the validation prompts and compare with
the reference, and time it. A failing gate fails the stage after writing the numbers.

Writes ``artifacts/<model>/<variant>/metrics.json``: ``parity`` (mode, passed, ...), ``throughput``
(``tokens_per_s``, ``ms_per_token``, ``ttft_ms``, ...), per-prompt details, and the fingerprint.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pipeline.config import PipelineConfig
from pipeline.errors import IntegrityError, ParityError, PipelineError
from pipeline.fsutil import atomic_write_json
from pipeline.log import log
from pipeline.paths import Paths
from pipeline.records import code_digest, fingerprint, read_record, require_record
from pipeline.stages import StageResult
from pipeline.stages import package as package_stage
from pipeline.stages import reference as reference_stage


def metrics_fingerprint(cfg: PipelineConfig, manifest: dict, reference: dict) -> str:
    return fingerprint({
        "archive": manifest["archive"]["sha256"],
        "reference": reference["fingerprint"],
        "validate": {"warmup_prompts": cfg.validate.warmup_prompts, "parity": asdict(cfg.validate.parity)},
        "hardware": cfg.hardware.name,
        "code": code_digest("validation.py", "generation.py", "stages/validate.py"),
    })


def run_fresh(job: dict) -> dict:
    """Run the validation job in a new interpreter; returns its metrics or raises what it raised."""
    with tempfile.TemporaryDirectory(prefix="gemma4-validate-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, "-m", "pipeline.validation", str(job_path), str(result_path)])
        if not result_path.exists():
            raise PipelineError(f"the validation process exited with code {proc.returncode} without a result")
        result = json.loads(result_path.read_text())
    if not result["ok"]:
        cls = IntegrityError if result.get("error_type") == "IntegrityError" else PipelineError
        raise cls(f"validation could not run: {result['error']}")
    return result["metrics"]


def failure_table(report: list[dict]) -> str:
    lines = [f"  {'prompt':<12} {'tokens':>6} {'first divergence':>17}  why"]
    for r in report:
        if r["passed"]:
            continue
        why = "; ".join(r.get("failures") or ["tokens differ"])
        lines.append(f"  {r['prompt']:<12} {r['prompt_tokens']:>6} {str(r['first_divergence']):>17}  {why}")
        d = r.get("divergence")
        if d:
            lines.append(f"      ...{d['context_before']!r} | reference: {d['reference_after']!r} "
                         f"| ours: {d['ours_after']!r}")
            if "reference_top" in d:
                fmt = lambda top: ", ".join(f"{t['text']!r}={t['logit']}" for t in top)  # noqa: E731
                lines.append(f"      reference top: {fmt(d['reference_top'])}")
                lines.append(f"      ours top:      {fmt(d['ours_top'])}")
    return "\n".join(lines)


def run(cfg: PipelineConfig) -> StageResult:
    paths = Paths.of(cfg)
    manifest = package_stage.load(cfg)
    reference, _ = reference_stage.load(cfg)
    fp = metrics_fingerprint(cfg, manifest, reference)
    previous = read_record(paths.metrics)
    if not cfg.force and previous and previous.get("fingerprint") == fp and previous["parity"]["passed"]:
        log.info("validate: %s is up to date (%s)", cfg.variant.name, paths.metrics)
        return StageResult("validate", "skipped")
    started = time.monotonic()
    job = {
        "manifest": manifest,
        "archive": str((paths.dist / manifest["archive"]["name"]).resolve()),
        "reference": reference,
        "reference_tensors": str(paths.reference_tensors.resolve()),
        "parity": asdict(cfg.validate.parity),
        "weights": str(paths.weights.resolve()),
        "text_prefix": cfg.model.text_prefix,
        "head_key": cfg.model.head_key,
        "workdir": str((paths.variant_dir / "validate").resolve()),
        "warmup_prompts": cfg.validate.warmup_prompts,
    }
    log.info("validate: %s (%s) in a fresh process", cfg.variant.name, manifest["version"])
    metrics = run_fresh(job)
    record = {"fingerprint": fp, "version": manifest["version"], "archive_sha256": manifest["archive"]["sha256"],
              "backend": manifest["backend"], "hardware": cfg.hardware.name, **metrics}
    atomic_write_json(paths.metrics, record)
    par, tput = metrics["parity"], metrics["throughput"]
    log.info("validate: %s parity %s (%s, %d/%d prompts), %.1f tok/s, %.1f ms/token, first token %.1f ms",
             cfg.variant.name, "passed" if par["passed"] else "FAILED", par["mode"], par["prompts_matched"],
             par["prompts"], tput["tokens_per_s"] or 0, tput["ms_per_token"] or 0, tput["ttft_ms"] or 0)
    if not par["passed"]:
        raise ParityError(f"{cfg.variant.name}: parity failed ({par['mode']}) on "
                          f"{par['prompts'] - par['prompts_matched']} of {par['prompts']} prompts:\n"
                          + failure_table(metrics["report"]) + f"\nfull report: {paths.metrics}")
    return StageResult("validate", "ran", time.monotonic() - started)


def load(cfg: PipelineConfig) -> dict:
    return require_record(Paths.of(cfg).metrics, "validate")
