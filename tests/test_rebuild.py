"""Rebuilding at scale: the regression gate between two builds, the scheduler's decisions for given budgets, and a
multirun on the joblib launcher sharing one artifacts directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pipeline.cli.schedule import Budget, Scheduler, Task, choose, variant_tasks
from pipeline.config import RegressionConfig, ResourceNeed
from pipeline.core.errors import PublishError
from pipeline.core.records import encode
from pipeline.core.shape import BuildShape
from pipeline.publishing import regression
from pipeline.validation.records import ValidationSummary

from .helpers import FAST_VALIDATE, a_manifest, config, run
from .test_spec_and_plan import E4B_CONFIG

GIB = 1 << 30
E4B_NEURON = ResourceNeed(trace_base_gb=20, trace_per_graph_gb=80, validate_gb=15, host_prefill_gb=17, disk_gb=120)
REPO = Path(__file__).resolve().parent.parent


# -- the regression gate ---------------------------------------------------------------------------------------------

def summary(tokens_per_s: float, ttft_ms: float, matched: int = 2, tf: float | None = 0.97,
            hardware: str = "inf2_8xlarge", backend: str = "neuron",
            aggregate: float | None = None) -> ValidationSummary:
    latency = {f"latency_ms_{k}": 1000 / tokens_per_s for k in ("p50", "p90", "p95", "p99", "p100", "avg")}
    # k sequences in flight, the full batch's four at ``aggregate`` tokens/s
    concurrency = {} if aggregate is None else {str(k): {
        "sequences": k, "context_tokens": 16, "aggregate_tokens_per_s": aggregate * k / 4, "tokens_per_s": 30.0,
        "ms_per_token": 33.3, "itl_ms_p50": 33.0, "itl_ms_p99": 40.0, "ttft_ms": 150.0, "ttft_ms_max": 300.0}
        for k in range(1, 5)}
    return ValidationSummary.from_json({**({"concurrency": concurrency} if concurrency else {}),
        "parity": {"mode": "logits", "passed": True, "prompts": 2, "prompts_matched": matched,
                   "teacher_forced_match": tf, "max_abs_dlogit": 0.5},
        "throughput": {**latency, "tokens_per_s": tokens_per_s, "ms_per_token": 1000 / tokens_per_s,
                       "ttft_ms": ttft_ms, "throughput": tokens_per_s, "decode_steps": 8},
        "contexts": {}, "gates": {"parity": True, "throughput": True, "passed": True}, "backend": backend,
        "hardware": hardware, "throughput_floor": None}, "a test's summary")


def test_regression_rows_and_verdicts():
    tol = RegressionConfig()
    same = regression.compare(summary(36.0, 120.0), summary(35.0, 130.0), tol)
    assert same.passed and [r.check for r in same.checks] == [
        "parity passed", "prompts matched", "teacher-forced match", "decode tokens/s", "time to first token ms"]
    slower = regression.compare(summary(36.0, 120.0), summary(30.0, 120.0), tol)
    row = next(r for r in slower.checks if r.check == "decode tokens/s")
    assert not slower.passed and not row.passed and row.change == -0.1667 and row.limit == ">= 32.4"
    assert not regression.compare(summary(36.0, 120.0), summary(36.0, 150.0), tol).passed  # first token +25 %
    assert not regression.compare(summary(36.0, 120.0), summary(36.0, 120.0, tf=0.94), tol).passed
    assert not regression.compare(summary(36.0, 120.0), summary(36.0, 120.0, matched=1), tol).passed
    other = regression.compare(summary(36.0, 120.0), summary(3.0, 900.0, hardware="inf2_xlarge"), tol)
    assert other.passed and not other.comparable_throughput  # not measured alike: throughput not compared
    assert "different backends or hardware" in regression.table(other)
    cpu = summary(3.0, 900.0, backend="cpu")
    assert regression.compare(summary(36.0, 120.0, backend="cpu"), cpu, tol).comparable_throughput is False


def test_a_batched_builds_full_batch_throughput_is_gated_too():
    """With its four lines in flight, every sequence's tokens/s together may fall by as much as one sequence's
    may; a summary from before batching (no figures in flight) is compared on the rest."""
    tol = RegressionConfig()
    ok = regression.compare(summary(36.0, 120.0, aggregate=120.0), summary(36.0, 120.0, aggregate=115.0), tol)
    assert ok.passed and ok.checks[-1].check == "tokens/s, 4 in flight"
    worse = regression.compare(summary(36.0, 120.0, aggregate=120.0), summary(36.0, 120.0, aggregate=100.0), tol)
    row = worse.checks[-1]
    assert not worse.passed and not row.passed and row.limit == ">= 108.0" and row.change == -0.1667
    before = regression.compare(summary(36.0, 120.0), summary(36.0, 120.0, aggregate=100.0), tol)
    assert before.passed and "in flight" not in " ".join(r.check for r in before.checks)


SAME = "d" * 64  # a_manifest's model.weights_digest


def test_the_gate_refuses_or_records_an_allowed_regression():
    previous = a_manifest(version="2048_bf16-ncc2.23.6484.0", fingerprint="f" * 64,
                          validation=encode(summary(36.0, 120.0)))
    with pytest.raises(PublishError, match=r"(?s)regressed against 2048_bf16-ncc2.23.6484.0.*decode tokens/s.*"
                                           r"REGRESSED.*publish.allow_regression=true"):
        regression.gate(previous, "2048_bf16-ncc2.24.0.0", "a" * 64, summary(20.0, 120.0), RegressionConfig(), False,
                        SAME)
    record = regression.gate(previous, "2048_bf16-ncc2.24.0.0", "a" * 64, summary(20.0, 120.0), RegressionConfig(),
                             True, SAME)
    assert record.allowed and not record.passed and record.against == "2048_bf16-ncc2.23.6484.0"
    assert regression.gate(None, "v", "a" * 64, summary(1.0, 1.0), RegressionConfig(), False, SAME) is None  # the first
    # An earlier attempt of this very publish (same fingerprint) is not a previous version: its record is kept.
    landed = replace(previous, regression=record)
    assert regression.gate(landed, "v", "f" * 64, summary(1.0, 1.0), RegressionConfig(), False, SAME) == record
    # A previous summary this release cannot read (another release published it) is refused by its field, and
    # skipped only where a regression would be allowed anyway.
    foreign = replace(previous, validation={**encode(summary(36.0, 120.0)), "parity": {"passed": True}})
    with pytest.raises(PublishError, match=r"manifest \(the target's head\) is not a valid validation summary:\n"
                                           r"  - missing field parity.mode"):
        regression.gate(foreign, "v", "a" * 64, summary(20.0, 120.0), RegressionConfig(), False, SAME)
    assert regression.gate(foreign, "v", "a" * 64, summary(20.0, 120.0), RegressionConfig(), True, SAME) is None


def test_a_build_of_other_weights_is_compared_and_recorded_but_not_gated():
    """Issue 53: each build's parity figures are against its own reference, so a rebuild from other weights
    (``+model.tiny.seed=7``: teacher-forced match 0.9375 -> 0.9062) was refused for a difference that measures
    nothing. Now it publishes when its own parity passed, the comparison recorded as not gated."""
    previous = a_manifest(version="512_fp32-a", fingerprint="f" * 64, validation=encode(summary(36.0, 120.0)))
    lower = summary(36.0, 120.0, tf=0.90)
    with pytest.raises(PublishError, match="teacher-forced match"):
        regression.gate(previous, "512_fp32-b", "a" * 64, lower, RegressionConfig(), False, SAME)
    record = regression.gate(previous, "512_fp32-b", "a" * 64, lower, RegressionConfig(), False, "e" * 64)
    assert not record.passed and not record.same_weights and not record.allowed
    assert "not gated: 512_fp32-a is a build of other weights" in regression.table(record)


def _tags(root: Path) -> list[str]:
    return subprocess.run(["git", "tag"], cwd=root / "published", capture_output=True, text=True).stdout.split()


@pytest.mark.slow  # `make test-slow` (and `.ci/run`) runs it
def test_a_rebuild_is_compared_with_the_last_published_version(tmp_path):
    cfg = config(tmp_path, *FAST_VALIDATE, "publish.regression.throughput_backends=[cpu,neuron]")
    run(cfg)
    manifest_path = tmp_path / "gemma4_tiny" / "512_fp32" / "dist" / "manifest.json"
    first = json.loads(manifest_path.read_text())["version"]
    assert _tags(tmp_path) == [first]
    # A toolchain upgrade, simulated: the record names another torch, so the next build has another version name.
    toolchain = json.loads((tmp_path / "toolchain.json").read_text())
    toolchain["packages"]["torch"]["version"] = "2.13.1+cpu"
    (tmp_path / "toolchain.json").write_text(json.dumps(toolchain))
    for stage in ("trace", "package", "validate"):
        run(cfg, stage)
    second = json.loads(manifest_path.read_text())["version"]
    assert second.startswith("512_fp32-cpu-torch2.13.1-") and second != first
    report_path = tmp_path / "gemma4_tiny" / "512_fp32" / "validation.json"
    measured = report_path.read_text()
    slower = json.loads(measured)
    # As if the new compiler's code were ten times slower: a wide margin, since the first version was timed on a
    # shared machine, perhaps while it was busier (halving failed to regress once under a 9x load).
    slower["throughput"]["tokens_per_s"] /= 10
    report_path.write_text(json.dumps(slower))
    with pytest.raises(PublishError, match=rf"(?s){second} regressed against {first}.*decode "
                                           r"tokens/s [^\n]*REGRESSED"):
        run(cfg, "publish")
    assert _tags(tmp_path) == [first]  # nothing published
    report_path.write_text(measured)
    # The honest figures, with tolerances wide enough for a shared 2-core machine's timing noise.
    run(config(tmp_path, *FAST_VALIDATE, "publish.regression.throughput_backends=[cpu,neuron]",
               "publish.regression.tokens_per_s_drop=0.9",
               "publish.regression.ttft_ms_rise=10"), "publish")
    assert sorted(_tags(tmp_path)) == sorted([first, second])
    published = subprocess.run(["git", "show", f"{second}:512_fp32/manifest.json"],
                               cwd=tmp_path / "published", capture_output=True, text=True, check=True).stdout
    record = json.loads(published)["regression"]
    assert record["against"] == first and record["passed"] and not record["allowed"]
    # Both versions stay published and listed; the variant's name pulls the newest, and says which.
    card = (tmp_path / "published" / "README.md").read_text()
    assert f"`{first}`" in card and f"`{second}`" in card
    pulled = subprocess.run([sys.executable, "-m", "pipeline", "pull", str(tmp_path / "published"), "512_fp32",
                             "--dest", str(tmp_path / "pulled"), "--allow-unsigned"], capture_output=True, text=True,
                            timeout=300)
    assert pulled.returncode == 0, pulled.stderr
    assert f"512_fp32 resolves to {second}, the newest published version" in pulled.stderr
    assert Path(pulled.stdout.strip()).name == f"gemma4_tiny-{second}"


@pytest.mark.slow  # `make test-slow` (and `.ci/run`) runs it: two builds
def test_a_build_of_other_weights_publishes_beside_the_last_with_its_comparison_recorded_not_gated(tmp_path):
    """Issue 53, through the publish stage: a build from other weights (``+model.tiny.seed=7``) after one published
    from the default weights is published whatever its parity figures say against the other's, and its manifest
    records the comparison as not gated (``same_weights: false``)."""
    run(config(tmp_path, *FAST_VALIDATE))
    first = json.loads((tmp_path / "gemma4_tiny" / "512_fp32" / "dist" / "manifest.json").read_text())
    run(config(tmp_path, *FAST_VALIDATE, "+model.tiny.seed=7"))
    second = json.loads((tmp_path / "gemma4_tiny" / "512_fp32" / "dist" / "manifest.json").read_text())
    assert second["model"]["weights_digest"] != first["model"]["weights_digest"]
    assert sorted(_tags(tmp_path)) == sorted([first["version"], second["version"]])
    published = subprocess.run(["git", "show", f"{second['version']}:512_fp32/manifest.json"],
                               cwd=tmp_path / "published", capture_output=True, text=True, check=True).stdout
    record = json.loads(published)["regression"]
    assert record["against"] == first["version"] and record["same_weights"] is False and not record["allowed"]


@pytest.mark.slow  # `make test-slow` (and `.ci/run`) runs it
def test_a_rebuild_that_makes_the_same_rank_files_is_the_same_version_and_publishes_nothing(tmp_path, monkeypatch):
    """What rebuilds without changing the rank files (the host's Neuron driver packages, simulated in the toolchain
    record; another compressor library packing the same files into other bytes, simulated by the zstd level) names
    the same version, and publishing it again makes no commit: a version names its rank files' inputs."""
    from pipeline.artifact import archive

    cfg = config(tmp_path, *FAST_VALIDATE)
    run(cfg)
    manifest_path = tmp_path / "gemma4_tiny" / "512_fp32" / "dist" / "manifest.json"
    first = json.loads(manifest_path.read_text())
    toolchain = json.loads((tmp_path / "toolchain.json").read_text())
    toolchain["system_packages"]["aws-neuronx-dkms"] = "2.99.0.0"  # a driver update: rebuilds, same bytes
    (tmp_path / "toolchain.json").write_text(json.dumps(toolchain))
    monkeypatch.setattr(archive, "ZSTD_LEVEL", 9)
    results = [run(cfg, stage)[0] for stage in ("trace", "package", "validate", "publish")]
    assert [r.status for r in results] == ["ran", "ran", "ran", "skipped"]
    again = json.loads(manifest_path.read_text())
    assert again["version"] == first["version"] and again["members"] == first["members"]
    assert again["archive"]["sha256"] != first["archive"]["sha256"]  # other archive bytes, the same rank files
    assert _tags(tmp_path) == [first["version"]]


@pytest.mark.parametrize("backend, renamed_by", [
    ("cpu", {"torch"}),
    ("neuron", {"torch", "neuronx-cc", "torch-neuronx", "neuronx-distributed", "libneuronxla"}),
    ("xla", {"torch", "torch-xla"}),
])
def test_a_version_names_the_packages_that_make_its_backends_files_and_no_others(tmp_path, backend, renamed_by):
    """An upgrade renames the builds whose files it changes and no others: a Neuron compiler upgrade on an inf2 host
    that also builds backend=cpu (for a comparison) leaves the cpu versions as they were; torch renames every
    backend's (pipeline/backends/registry.py, build_packages)."""
    from pipeline.core.build_records import ModelRecord, NeuronxCcBuild, PackageVersion, ToolchainRecord
    from pipeline.stages import trace

    cfg = config(tmp_path, f"backend={backend}")
    record = ModelRecord(fingerprint="f", source_fingerprint="s", name="gemma4_tiny", source="tiny", hub_id=None,
                         revision=None, text_prefix="model.", head_key="lm_head.weight", config_digest="c",
                         weights_digest="w" * 64, files={}, spec={})
    installed = ("torch", "transformers", "neuronx-cc", "torch-neuronx", "neuronx-distributed", "libneuronxla",
                 "torch-xla", "aws-neuronx-runtime-lib")
    toolchain = ToolchainRecord(2, backend, {name: PackageVersion("1.0.0") for name in installed},
                                NeuronxCcBuild(None, None), {})
    first = trace.inputs_digest(cfg, record, toolchain, backend)
    renamed = set()
    for name in installed:
        upgraded = replace(toolchain, packages={**toolchain.packages, name: PackageVersion("1.0.1")})
        if trace.inputs_digest(cfg, record, upgraded, backend) != first:
            renamed.add(name)
    assert renamed == renamed_by


# -- the scheduler's decisions ------------------------------------------------------------------------------------

class SimulatedRunner:
    """Tasks that take fixed times on a simulated clock."""

    def __init__(self, seconds: dict[str, float], failing: tuple[tuple[str, str], ...] = ()):
        self.seconds, self.failing = seconds, failing
        self.now, self.finishing, self.starts = 0.0, {}, []

    def start(self, task: Task) -> None:
        self.finishing[task] = self.now + self.seconds[task.name]
        self.starts.append((self.now, task, tuple(self.finishing)))

    def wait(self) -> tuple[Task, bool]:
        task = min(self.finishing, key=self.finishing.get)
        self.now = self.finishing.pop(task)
        return task, (task.variant, task.name) not in self.failing

    def clock(self) -> float:
        return self.now


def e4b_plans(names: list[str], quiet: bool = False) -> list[list[Task]]:
    shapes = {"2048_bf16": BuildShape(2048, 512, "bf16", "device", 2), "512_bf16": BuildShape(512, 128, "bf16",
              "device", 2), "2048_bf16_host": BuildShape(2048, 512, "bf16", "host", 2)}
    return [variant_tasks(n, "neuron", shapes[n], E4B_NEURON, 0, quiet) for n in names]


def simulate(plans, budget: Budget, failing=()) -> tuple[Scheduler, SimulatedRunner]:
    runner = SimulatedRunner({"build": 3600.0, "validate": 300.0, "publish": 60.0}, failing)
    scheduler = Scheduler(budget, runner)
    scheduler.run(plans, clock=runner.clock)
    return scheduler, runner


def test_an_inf2_8xlarge_with_swap_compiles_one_e4b_variant_at_a_time():
    # 125 GiB RAM + 75 GiB swap: one 180 GiB compile fits, two do not. Its 2 NeuronCores are held by a compile as by
    # a validate (each initialises the runtime on them), so only a publish runs beside either.
    scheduler, runner = simulate(e4b_plans(["2048_bf16", "512_bf16"]), Budget(200 * GIB, 32, 2))
    assert scheduler.peak_memory <= 200 * GIB
    builds = [(t, task.variant) for t, task, _ in runner.starts if task.name == "build"]
    assert builds == [(0.0, "2048_bf16"), (3900.0, "512_bf16")]  # after 2048_bf16's validate (3600-3900)
    for _, _task, running in runner.starts:
        assert sum(t.neuron_cores for t in running) <= 2, running
    assert any({t.name for t in running} == {"publish", "build"} for _, _, running in runner.starts)
    assert all(o.ok for o in scheduler.outcomes) and len(scheduler.outcomes) == 6
    # With 4 NeuronCores (and the memory), 2048_bf16 validates while 512_bf16 compiles.
    roomy, runner = simulate(e4b_plans(["2048_bf16", "512_bf16"]), Budget(400 * GIB, 32, 4))
    assert any({t.name for t in running} == {"validate", "build"} for _, _, running in runner.starts)


def test_host_prefill_neuron_compiles_never_run_side_by_side():
    # parallel_model_trace always rendezvous on port 2022: two at once would collide, whatever the cores.
    plans = [variant_tasks(n, "neuron", BuildShape(2048, 512, "bf16", "host", 2), E4B_NEURON, 0)
             for n in ("a_host", "b_host")] + e4b_plans(["2048_bf16"])
    scheduler, runner = simulate(plans, Budget(768 * GIB, 192, 12))
    for _, _task, running in runner.starts:
        assert sum(t.exclusive == "trace-port" for t in running) <= 1, running
    assert any({t.variant for t in running if t.name == "build"} == {"a_host", "2048_bf16"}
               for _, _, running in runner.starts)  # a device-prefill compile may run beside one


def test_more_memory_compiles_more_variants_at_once_and_cores_cap_them():
    scheduler, _ = simulate(e4b_plans(["2048_bf16", "512_bf16", "2048_bf16_host"]), Budget(768 * GIB, 192, 12))
    assert scheduler.peak_tasks == 3 and scheduler.peak_memory == 3 * 180 * GIB
    capped, _ = simulate(e4b_plans(["2048_bf16", "512_bf16", "2048_bf16_host"]), Budget(768 * GIB, 2, 12))
    assert capped.peak_tasks == 2


def test_neuroncores_and_quiet_validation_serialise_what_must_run_alone():
    scheduler, runner = simulate(e4b_plans(["2048_bf16", "512_bf16"], quiet=True), Budget(768 * GIB, 32, 2))
    for _, task, running in runner.starts:
        if task.name == "validate":
            assert running == (task,)  # nothing else ran while it measured
    two_cores = [t for t in e4b_plans(["2048_bf16", "512_bf16"])]
    validates = [plan[1] for plan in two_cores]
    assert choose(validates, [], Budget(768 * GIB, 32, 2)) == validates[:1]  # 2 NeuronCores: one validate at a time


def test_a_task_too_big_for_the_host_runs_alone_and_a_failure_stops_only_its_variant():
    big = e4b_plans(["2048_bf16"])[0]
    assert choose([big[0]], [], Budget(100 * GIB, 32, 2)) == [big[0]]  # idle host: its preflight will say why
    assert choose([big[0]], [big[1]], Budget(100 * GIB, 32, 2)) == []
    scheduler, _ = simulate(e4b_plans(["2048_bf16", "512_bf16"]), Budget(400 * GIB, 32, 2),
                            failing=(("2048_bf16", "build"),))
    ran = {(o.task.variant, o.task.name): o.ok for o in scheduler.outcomes}
    assert ran == {("2048_bf16", "build"): False, ("512_bf16", "build"): True, ("512_bf16", "validate"): True,
                   ("512_bf16", "publish"): True}


def test_the_schedule_command_reports_needs_and_budget(tmp_path):
    # The needs are derived from the checkpoint's config.json (here E4B's, alone): the seed's figures for E4B, and
    # its prefill model at the variant's dtype for host prefill (pipeline/host/preflight.py).
    checkpoint = tmp_path / "e4b"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(E4B_CONFIG))
    out = subprocess.run([sys.executable, "-m", "pipeline", "schedule", "--dry-run", "--memory-gib", "189",
                          "--variants", "2048_bf16,2048_bf16_host", "model=gemma4_e4b", "backend=neuron",
                          f"model.path={checkpoint}", f"artifacts_dir={tmp_path}"], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert "budget 189.0 GiB of RAM + swap" in out.stderr
    # 2048_bf16's ladder (32, 128, 512) and decode: four graphs ModelBuilder compiles at once, 80 GiB each as the
    # seed measured its prefill graph (a smaller bucket's likely needs less: unverified)
    assert "2048_bf16 needs build 340.0 GiB, validate 15.0 GiB" in out.stderr
    assert "2048_bf16_host needs build 180.0 GiB, validate 24.1 GiB" in out.stderr
    offline = subprocess.run([sys.executable, "-m", "pipeline", "schedule", "--dry-run", "--variants", "2048_bf16",
                              "model=gemma4_e4b", "backend=neuron", f"artifacts_dir={tmp_path}"], cwd=REPO,
                             capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and "run stage=model first, or give model.path=DIR" in offline.stderr
    bad = subprocess.run([sys.executable, "-m", "pipeline", "schedule", "--variants", "9999_bf16"], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "--variants ['9999_bf16'] are not in conf/variant/" in bad.stderr


# -- Hydra's launchers (a joblib sweep through DVC: tests/test_dvc.py) -------------------------------------------------

def test_the_inf2_slurm_launcher_composes_over_the_pipelines_slurm_launcher():
    proc = subprocess.run([sys.executable, "-m", "pipeline", "hydra/launcher=inf2_slurm",
                           "hydra.launcher.partition=inf2", "+variant=512_bf16", "--cfg", "hydra"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    launcher = yaml.safe_load(proc.stdout)["hydra"]["launcher"]
    assert launcher["_target_"] == "hydra_plugins.gemma4_pipeline_slurm.launcher.PipelineSlurmLauncher"
    assert launcher["partition"] == "inf2" and launcher["cpus_per_task"] == 32 and launcher["nodes"] == 1
    assert launcher["additional_parameters"] == {"exclusive": True}
