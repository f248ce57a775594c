"""``python -m pipeline neuron-check``: the first run on an inf2 host, in minutes instead of an E4B compile.

Runs the embedded tiny model through the neuron backend for every layout the pipeline builds, at tp_degree 2, and
prints a verdict per check:

1. the Neuron packages: installed, and exactly one known SDK release (pipeline/backends/neuron_sdk.py);
2. the NeuronCores: ``neuron-ls`` sees enough of them and a lease can be taken;
3. device prefill (ModelBuilder, ``model.pt``): compile; then package, load in a fresh process and decode the
   validation prompts token for token against the float reference (fp32, ``exact``);
4. host prefill (``parallel_model_trace``, ``tp_0.pt``/``tp_1.pt``): compile; then load, seed each rank's KV state and
   decode several prompts (every prompt after the first proves the state is written where the loaded model reads
   it), within bf16 noise of the reference;
5. both again at batch 4 (``variant.batch_size=4``): graphs taking each call's cache lines (``seq_ids``), the prompts
   decoded alone and then together, each bit for bit as alone, one taking a line another left mid-flight; host
   prefill seeds one line of each rank's state (read back whole, changed in that line, written whole).

A failed check marks the checks that depend on it as skipped; the exit code is 0 only when every check passed.
Everything is written under a temporary folder (``--keep DIR`` keeps it there), nothing is published.

    python -m pipeline neuron-check
    python -m pipeline neuron-check --keep /tmp/neuron-check backend.visible_cores=0-1
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.cli import plain
from pipeline.core.errors import PipelineError

LAYOUTS = (  # (what, the variant built, its overrides)
    ("device prefill (ModelBuilder, model.pt)", "512_fp32", ()),
    ("host prefill (parallel_model_trace, tp_N.pt)", "256_bf16_host", ()),
    ("device prefill at batch 4", "512_fp32", ("variant.batch_size=4",)),
    ("host prefill at batch 4", "256_bf16_host", ("variant.batch_size=4",)),
)
QUICK_VALIDATION = ["validate.prompt_names=[capital,near_64,spans_64]", "validate.max_new_tokens=16",
                    "validate.throughput.contexts=[short]",
                    "validate.throughput.runs=1", "validate.throughput.warmup_runs=0",
                    "validate.throughput.decode_tokens=8", "validate.warmup_prompts=0"]


@dataclass
class Verdict:
    check: str
    status: str  # pass | FAIL | skipped
    detail: str
    seconds: float = 0.0


def _run(check: str, step: Callable[[], str], verdicts: list[Verdict], blocked: bool) -> bool:
    """Run one check unless an earlier one it needs failed; record its verdict. True when it passed."""
    if blocked:
        verdicts.append(Verdict(check, "skipped", "an earlier check failed"))
        return False
    started = time.monotonic()
    try:
        detail = step()
    except PipelineError as exc:
        verdicts.append(Verdict(check, "FAIL", str(exc), time.monotonic() - started))
        return False
    except Exception as exc:  # noqa: BLE001 - a first run reports whatever breaks, then goes on to the next layout
        verdicts.append(Verdict(check, "FAIL", f"{type(exc).__name__}: {exc}", time.monotonic() - started))
        return False
    verdicts.append(Verdict(check, "pass", detail, time.monotonic() - started))
    return True


def check_packages() -> str:
    from pipeline.backends import neuron_sdk
    from pipeline.backends.neuron import missing_api
    from pipeline.core.errors import BuildError

    reason = missing_api("device")
    if reason:
        raise BuildError(reason)
    installed = neuron_sdk.installed_versions()
    row = neuron_sdk.identify(installed)
    return f"Neuron SDK {row.release}: " + ", ".join(f"{k} {v}" for k, v in installed.items())


def check_cores(spec: str | None) -> str:
    from pipeline.backends.neuron import core_lease, host_neuron_cores

    total = host_neuron_cores()
    lease = core_lease(2, spec, "neuron-check", total)
    lease.release()
    return f"{total} NeuronCores on this host; tp_degree 2 can use {lease.visible_cores}"


def compose(artifacts: Path, variant: str | None, overrides: list[str]):
    from pipeline.run import compose as compose_config

    args = [f"artifacts_dir={artifacts}", "model=gemma4_tiny", "backend=neuron", "publish=local", *QUICK_VALIDATION,
            *overrides] + ([f"+variant={variant}"] if variant else [])
    return compose_config(args, variant)


def stages(cfg, names: tuple[str, ...]) -> None:
    from pipeline.run import run_pipeline

    for name in names:
        cfg.stage = name
        run_pipeline(cfg)


def prepare(artifacts: Path, overrides: list[str]) -> str:
    stages(compose(artifacts, None, overrides), ("toolchain", "model", "reference"))
    return "toolchain recorded; the tiny checkpoint and its fp32 reference made"


def compile_layout(artifacts: Path, variant: str, overrides: list[str]) -> str:
    from pipeline.core.build_records import BuildRecord
    from pipeline.paths import Paths

    cfg = compose(artifacts, variant, overrides)
    stages(cfg, ("trace",))
    record = BuildRecord.read(Paths.of(cfg).build_record)
    files = ", ".join(f"{m.path} {m.size / 1e6:.1f} MB" for m in record.members)
    return f"{record.trace['api']}: {files} in {record.trace['wall_s']:.0f} s"


def decode_layout(artifacts: Path, variant: str, overrides: list[str]) -> str:
    from pipeline.paths import Paths
    from pipeline.validation.records import ValidationRecord

    cfg = compose(artifacts, variant, overrides)
    stages(cfg, ("package", "validate"))  # validate raises ParityError on a mismatch
    report = ValidationRecord.read(Paths.of(cfg).validation_report)
    parity, throughput, batch = report.parity, report.throughput, report.batch_parity
    together = (f"; {batch.sequences} decoded together in {batch.batch_size} lines as alone, "
                f"{report.concurrency[str(batch.batch_size)].aggregate_tokens_per_s:.1f} tok/s in all"
                if batch is not None else "")
    return (f"{parity.mode} parity on {parity.prompts_matched}/{parity.prompts} prompts{together}; "
            f"{throughput.tokens_per_s:.1f} tok/s, first token {throughput.ttft_ms:.0f} ms")


def run_checks(artifacts: Path, overrides: list[str], visible_cores: str | None) -> list[Verdict]:
    verdicts: list[Verdict] = []
    ready = _run("Neuron packages", check_packages, verdicts, False)
    ready = _run("NeuronCores", lambda: check_cores(visible_cores), verdicts, not ready) and ready
    shared = _run("tiny model and float reference", lambda: prepare(artifacts, overrides), verdicts, not ready)
    for what, variant, own in LAYOUTS:
        settings = [*overrides, *own]
        built = _run(f"{what}: compile", lambda v=variant, o=settings: compile_layout(artifacts, v, o), verdicts,
                     not (ready and shared))
        _run(f"{what}: load and decode", lambda v=variant, o=settings: decode_layout(artifacts, v, o), verdicts,
             not built)
    return verdicts


def table(verdicts: list[Verdict]) -> str:
    width = max(len(v.check) for v in verdicts)
    lines = [f"{'check':<{width}}  {'verdict':<7}  {'s':>5}  detail"]
    for v in verdicts:
        first, *rest = v.detail.splitlines() or [""]
        lines.append(f"{v.check:<{width}}  {v.status:<7}  {v.seconds:>5.0f}  {first}")
        lines += [f"{'':<{width + 18}}{line}" for line in rest[:12]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline neuron-check",
                                     description=plain(__doc__.split("\n\n")[0]),
                                     epilog="Other arguments are Hydra overrides (e.g. backend.visible_cores=0-1).")
    parser.add_argument("--keep", type=Path, help="build under this folder and keep it (default: a temporary one)")
    args, overrides = parser.parse_known_args(argv)
    from pipeline.core.log import setup

    setup()
    visible = next((o.split("=", 1)[1] for o in overrides if o.startswith("backend.visible_cores=")), None)
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="gemma4-neuron-check-"))
    try:
        verdicts = run_checks(work / "artifacts", overrides, visible)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(verdicts))
    failed = [v.check for v in verdicts if v.status != "pass"]
    print(f"\n{len(verdicts) - len(failed)} of {len(verdicts)} checks passed"
          + (f"; not passed: {', '.join(failed)}" if failed else "; this host builds and runs every layout"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
