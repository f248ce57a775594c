"""`dvc repro` builds the variants of params.yaml; a second run re-runs only the toolchain stage; editing one
variant's conf file re-runs only that variant; `dvc push` / `dvc pull` restore the artifacts from a remote; a compiler
upgrade re-runs trace, package, validate and publish of every variant, and nothing else."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.fsutil import sha256_file

from . import fake_sdk
from .helpers import STAND_IN_REGRESSION, stand_in_floors

REPO = Path(__file__).resolve().parent.parent
COPY = ["conf", "pipeline", "hydra_plugins", "dvc.yaml", "params.yaml", ".dvc/config", ".dvc/plots", ".dvcignore",
        ".gitignore"]
VARIANTS = ["512_fp32", "256_bf16_host"]


def checkout_copy(dst: Path, variants: list[str], edit=None, **params_set) -> Path:
    """A fresh checkout of this repository (its tracked files), building only ``variants``; ``edit(dst)`` may change
    it before it is committed, and ``params_set`` sets params.yaml keys."""
    for rel in COPY:
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, dst / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst / rel)
    if edit:
        edit(dst)
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params.update(params_set, variants=variants)
    (dst / "params.yaml").write_text(yaml.safe_dump(params))
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "checkout"]):
        subprocess.run(["git", *args], cwd=dst, check=True, capture_output=True)
    return dst


def dvc(repo: Path, *args: str, env: dict | None = None) -> str:
    path = os.pathsep.join(filter(None, [(env or {}).get("PATH"), str(Path(sys.executable).parent),
                                         os.environ["PATH"]]))
    env = {**os.environ, **(env or {}), "PATH": path}
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def quicker_validation(dst: Path) -> None:
    """Two prompts and one timed run per context: what these tests check does not need more."""
    validate = yaml.safe_load((dst / "conf" / "validate" / "default.yaml").read_text())
    validate.update(prompt_names=["capital", "spans_64"], warmup_prompts=0)
    validate["throughput"].update(runs=1, warmup_runs=0)
    (dst / "conf" / "validate" / "default.yaml").write_text(yaml.safe_dump(validate))


def as_sweep_stage(stage: dict) -> dict:
    """A named per-variant stage as its sweep_ twin: over sweep.base, each knob passed (params.yaml's sweep, `base`
    for the base's own value), every path in the sweep's folder."""
    knobs = " ".join(f"variant.{k}=${{sweep.{k}}}" for k in ("kv_max", "bucket", "dtype", "prefill", "batch_size"))
    text = json.dumps(stage["do"]).replace("${model}/${item}/", "${model}/sweep-${item}/").replace(
        "plots/${item}.json", "plots/sweep-${item}.json").replace(
        "plots/concurrency/${item}.json", "plots/concurrency/sweep-${item}.json").replace(
        "+variant=${item} ", f"+variant=${{item}} {knobs} variant_folder=sweep-${{item}} ")
    return {"foreach": "${sweep.base}", "do": json.loads(text)}


def test_dvc_yaml_has_exactly_the_registrys_stages_and_the_code_each_fingerprints():
    """One registry (pipeline.stages.STAGES) says which stages there are, in what order, which run per variant and
    what code each runs; dvc.yaml is its copy for `dvc repro`."""
    from pipeline.stages import BY_NAME, CODE, ORDER

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    sweeps = {name: stage for name, stage in stages.items() if name.startswith("sweep_")}
    stages = {name: stage for name, stage in stages.items() if name not in sweeps}
    assert list(stages) == list(ORDER)
    # the sweep's stages are the per-variant stages over sweep.base, with the knobs and the sweep's folder
    assert {name.removeprefix("sweep_"): stage for name, stage in sweeps.items()} == {
        name: as_sweep_stage(stages[name]) for name in ORDER if not BY_NAME[name].shared}
    for name, stage in stages.items():
        assert ("foreach" in stage) == (not BY_NAME[name].shared), f"dvc.yaml's {name}: per variant or not"
        deps = (stage.get("do") or stage)["deps"]
        listed = sorted(d.removeprefix("pipeline/") for d in deps if d.startswith("pipeline/"))
        assert listed == sorted(CODE[name]), f"dvc.yaml's {name} deps disagree with pipeline.stages.CODE"
        for rel in CODE[name]:
            assert (REPO / "pipeline" / rel).exists(), rel


def test_every_module_a_stage_runs_is_in_its_code(monkeypatch, tmp_path):
    """Editing any file of a stage's code changes that stage's code digest (what its fingerprint hashes), and the
    stage modules' own imports of pipeline code are covered (a module a stage imports to compute its outputs and that
    is missing from CODE would reuse stale outputs)."""
    import ast

    from pipeline import stages
    from pipeline.core import records

    shutil.copytree(REPO / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(records, "PACKAGE_DIR", tmp_path / "pipeline")
    plumbing = {"config", "paths", "core", "host", "stages", "__init__"}  # moves files, does not decide content
    for stage, code in stages.CODE.items():
        files = [f for rel in code for f in ([tmp_path / "pipeline" / rel] if rel.endswith(".py")
                                             else sorted((tmp_path / "pipeline" / rel).rglob("*.py")))]
        before = stages.code_of(stage)
        for path in files:
            original = path.read_text()
            path.write_text(original + "\n_edited = 1\n")
            assert stages.code_of(stage) != before, f"{stage}: editing {path.name} left its digest unchanged"
            path.write_text(original)
        tree = ast.parse((REPO / "pipeline" / "stages" / f"{stage}.py").read_text())
        imported = {alias.name if node.module == "pipeline" else node.module.removeprefix("pipeline.")
                    for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("pipeline") for alias in node.names}
        for module in imported:
            top = module.split(".")[0]
            if top in plumbing or module.startswith(("stages", "__")):
                continue
            as_path = module.replace(".", "/")
            covered = any(rel in (f"{as_path}.py", f"{as_path}/__init__.py", top) for rel in code)
            assert covered, f"stage {stage} imports pipeline.{module}, which pipeline.stages.CODE[{stage!r}] omits"


@pytest.fixture(scope="module")
def first_repro(tmp_path_factory) -> tuple[Path, str]:
    """A checkout built by its first `dvc repro`, and what that printed: every test below starts from a built
    checkout, so each passes alone or in any subset (`pytest -k NAME`)."""
    repo = checkout_copy(tmp_path_factory.mktemp("dvc") / "repo", VARIANTS, quicker_validation)
    return repo, dvc(repo, "repro")


@pytest.fixture
def repo(first_repro) -> Path:
    return first_repro[0]


# first_repro builds two variants through `dvc repro` (two minutes on 2 cores): make test-slow runs these
@pytest.mark.slow
def test_dvc_repro_builds_every_listed_variant(first_repro):
    repo, out = first_repro
    assert {"toolchain", "model", "reference"} <= set(ran(out))
    for variant in VARIANTS:
        vdir = repo / "artifacts" / "gemma4_tiny" / variant
        assert sorted(p.name for p in (vdir / "build").iterdir()) == ["tp_0.pt", "tp_1.pt"]
        assert json.loads((vdir / "metrics.json").read_text())["parity"]["passed"] is True
        assert (vdir / "publish.json").is_file()
    shown = dvc(repo, "metrics", "show")
    assert all(f"artifacts/gemma4_tiny/{v}/metrics.json" in shown for v in VARIANTS)


@pytest.mark.slow
def test_a_second_repro_runs_only_the_toolchain(repo):
    out = dvc(repo, "repro")
    assert ran(out) == ["toolchain"]


@pytest.mark.slow
def test_dvc_repro_then_a_direct_run_rebuilds_nothing(repo):
    """The other order: after `dvc repro`, the same build run by hand skips every stage, and DVC still sees
    everything up to date."""
    params = yaml.safe_load((repo / "params.yaml").read_text())
    same_as_dvc = [f"model={params['model']}", f"backend={params['backend']}", f"publish={params['publish']}",
                   f"hardware={params['hardware']}"]
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--multirun", f"+variant={','.join(VARIANTS)}",
                           *same_as_dvc], cwd=repo, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert log.count("ran nothing (all up to date)") == len(VARIANTS), log[-3000:]
    assert dvc(repo, "status").split() == ["toolchain:", "always", "changed"]


@pytest.mark.slow
def test_editing_one_variant_rebuilds_only_that_variant(repo):
    """The trace stages depend on the conf/variant folder (params.yaml may list a derived name, whose file DVC cannot
    name), so DVC runs every variant's trace command; each skips by its fingerprint but the edited one, and DVC stops
    at the first unchanged output."""
    conf = repo / "conf" / "variant" / "256_bf16_host.yaml"
    conf.write_text(conf.read_text().replace("kv_max: 256", "kv_max: 256  # touched"))
    other = repo / "artifacts" / "gemma4_tiny" / "512_fp32" / "build.json"
    before = sha256_file(other)
    out = dvc(repo, "repro")
    stages = set(ran(out))
    assert {"toolchain", "trace@256_bf16_host"} <= stages
    assert stages <= {"toolchain", "trace@512_fp32"} | {f"{s}@256_bf16_host" for s in ("trace", "package", "validate",
                                                                                         "publish")}
    assert "trace: 512_fp32 is up to date" in out and sha256_file(other) == before  # its command rebuilt nothing
    assert "package@512_fp32" not in ran(out)


@pytest.mark.slow
def test_metrics_diff_and_plots_read_cleanly(repo):
    """Commit a build's metrics with dvc.lock, validate again: the diff is figures only, the plots render."""
    for args in (["add", "-A"], ["commit", "-q", "-m", "build"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    dvc(repo, "repro", "--force", "--single-item", "validate@512_fp32")
    diff = dvc(repo, "metrics", "diff", "--all")
    assert "tokens_per_s.short" in diff and "ttft_ms.near_max" in diff and "latency_ms_p50" not in diff
    assert not re.search(r"[0-9a-f]{40}", diff)  # no checksums or fingerprints among the figures
    plots = json.loads(dvc(repo, "plots", "show", "--json"))
    assert not plots.get("errors")
    for variant in VARIANTS:
        spec = plots["data"][f"artifacts/gemma4_tiny/plots/{variant}.json"][0]["content"]
        fields = {layer["encoding"]["y"]["field"] for layer in spec["hconcat"]}
        assert fields == {"tokens_per_s", "ms_per_token"}
        kv_max = int(variant.split("_")[0])
        lengths = sorted(row["context_tokens"] for row in spec["data"]["values"])
        assert lengths == [16, kv_max // 2, kv_max - 16 - 1]  # short, half, near kv_max
        spec = plots["data"][f"artifacts/gemma4_tiny/plots/concurrency/{variant}.json"][0]["content"]
        assert {layer["encoding"]["y"]["field"] for layer in spec["hconcat"]} == {"aggregate_tokens_per_s",
                                                                                 "ms_per_token"}
        assert [row["sequences"] for row in spec["data"]["values"]] == [1]  # a batch-1 build: one in flight


@pytest.mark.slow
def test_dvc_push_and_pull_restore_the_artifacts_from_a_remote(repo, tmp_path):
    dvc(repo, "remote", "add", "--local", "-d", "shared", str(tmp_path / "remote"))
    dvc(repo, "push")
    model_dir = repo / "artifacts" / "gemma4_tiny"
    files = [p for v in VARIANTS for p in (model_dir / v).glob("*/*")] + list(model_dir.glob("reference.*"))
    built = {p.relative_to(repo): sha256_file(p) for p in files if p.is_file()}
    assert any(p.name == "tp_0.pt" for p in built) and any(p.suffix == ".zst" for p in built)
    for variant in VARIANTS:
        for folder in ("build", "dist"):
            shutil.rmtree(repo / "artifacts" / "gemma4_tiny" / variant / folder)
    for path in model_dir.glob("reference.*"):
        path.unlink()
    shutil.rmtree(repo / ".dvc" / "cache")  # a fresh machine: nothing local
    dvc(repo, "pull")
    assert {p: sha256_file(repo / p) for p in built} == built
    status = dvc(repo, "status")  # (publish@512_fp32 is behind: the metrics test re-validated it on its own)
    assert not re.search(r"^(reference|trace@|package@|validate@)", status, re.M), status


@pytest.mark.slow  # a minute on 2 cores: `make test-slow` (and `.ci/run`) runs it
def test_a_direct_run_then_dvc_repro_rebuilds_nothing(tmp_path):
    """A direct run first (here the cluster recipe's Hydra sweep, docs/scale.md "Across hosts", with the joblib launcher
    standing in for Slurm's: two variants at once in the checkout), then `dvc repro`: DVC runs each stage's command
    once, since dvc.lock does not know the outputs yet, and every stage finds them current (outputs are persistent,
    the stage's fingerprint decides): nothing is rebuilt, no byte changes, and DVC is up to date afterwards."""
    repo = checkout_copy(tmp_path / "repo", VARIANTS, quicker_validation)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    same_as_dvc = [f"model={params['model']}", f"backend={params['backend']}", f"publish={params['publish']}"]
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--multirun", f"+variant={','.join(VARIANTS)}",
                           "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *same_as_dvc],
                          cwd=repo, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout + proc.stderr
    built = sorted((repo / "artifacts" / "gemma4_tiny").glob("*/build/tp_*.pt"))
    assert len(built) == 2 * len(VARIANTS)
    outputs = [p for p in (repo / "artifacts").rglob("*") if p.is_file() and "logs" not in p.parts
               and "published" not in p.parts]
    # Contents, not times: DVC moves a cached output into its cache and back while it records it.
    stamps = {p: sha256_file(p) for p in outputs}

    out = dvc(repo, "repro")
    assert "ran trace" not in out and "ran model" not in out and "ran validate" not in out
    # Every stage's command ran once (toolchain, model, reference, then four per variant); none built anything.
    assert out.count("ran nothing (all up to date)") == 3 + 4 * len(VARIANTS), out[-3000:]
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert {f"{s}@{v}" for v in VARIANTS for s in ("trace", "package", "validate", "publish")} <= set(lock)
    assert {p: sha256_file(p) for p in outputs} == stamps
    assert dvc(repo, "status").split() == ["toolchain:", "always", "changed"]
    assert ran(dvc(repo, "repro")) == ["toolchain"]


# -- a compiler upgrade, on the stand-in Neuron SDK -----------------------------------------------------------------

NEURON_VARIANTS = {  # tp_degree 1 keeps this DAG test quick; tests/test_neuron.py builds tp_degree 2
    "t1_device": {"kv_max": 512, "bucket": 128, "dtype": "fp32", "prefill": "device", "tp_degree": 1},
    "t1_host": {"kv_max": 256, "bucket": 64, "dtype": "bf16", "prefill": "host", "tp_degree": 1},
}
UPGRADE = ("2.28.1", "2.29.0")  # neuronx-cc 2.23.6484.0 -> 2.24.5133.0, with the rest of each release


def neuron_env(site: Path, release: str) -> dict:
    """The stand-in SDK installed as ``release`` (reinstalled in place: an upgrade); dvc() puts its bin/ first."""
    return {**fake_sdk.env(fake_sdk.install(site, release)), "PATH": str(site / "bin")}


def stand_in_variants(dst: Path) -> None:
    for name, fields in NEURON_VARIANTS.items():
        (dst / "conf" / "variant" / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, **fields}))
    backend = yaml.safe_load((dst / "conf" / "backend" / "neuron.yaml").read_text())
    backend["allow_unsupported_host_prefill"] = True  # 2.29 does not build host prefill unless asked
    (dst / "conf" / "backend" / "neuron.yaml").write_text(yaml.safe_dump(backend))
    quicker_validation(dst)
    validate = yaml.safe_load((dst / "conf" / "validate" / "default.yaml").read_text())
    validate["throughput"].update(contexts=["short"], decode_tokens=4)
    stand_in_floors(validate)
    (dst / "conf" / "validate" / "default.yaml").write_text(yaml.safe_dump(validate))
    # Timings of a tiny model on a shared 2-core machine swing by up to two orders of magnitude (helpers.py says when):
    # the regression gate (tested on its own in test_rebuild.py) must not turn that noise into a failed rebuild here.
    publish = yaml.safe_load((dst / "conf" / "publish" / "local.yaml").read_text())
    publish["regression"].update(STAND_IN_REGRESSION)
    (dst / "conf" / "publish" / "local.yaml").write_text(yaml.safe_dump(publish))


@pytest.fixture(scope="module")
def neuron_repo(tmp_path_factory) -> Path:
    return checkout_copy(tmp_path_factory.mktemp("dvc-neuron") / "repo", list(NEURON_VARIANTS), stand_in_variants,
                         backend="neuron")


@pytest.mark.slow  # `make test-slow`; the rehearsal checks the same on the production settings
def test_a_compiler_upgrade_reruns_trace_to_publish_of_every_variant_and_nothing_else(neuron_repo, tmp_path):
    site = tmp_path / "neuron-sdk"
    first = dvc(neuron_repo, "repro", env=neuron_env(site, UPGRADE[0]))
    assert {"model", "reference", "trace@t1_device", "publish@t1_host"} <= set(ran(first))
    upgraded = dvc(neuron_repo, "repro", env=neuron_env(site, UPGRADE[1]))
    expected = {"toolchain"} | {f"{stage}@{v}" for v in NEURON_VARIANTS
                                 for stage in ("trace", "package", "validate", "publish")}
    assert set(ran(upgraded)) == expected
    tags = subprocess.run(["git", "tag"], cwd=neuron_repo / "artifacts" / "published", capture_output=True,
                          text=True, check=True).stdout.split()
    assert sorted(t.rsplit("-", 1)[0] for t in tags) == sorted(f"{v}-ncc{c}" for v in NEURON_VARIANTS
                                                                for c in ("2.23.6484.0", "2.24.5133.0"))
    for variant in NEURON_VARIANTS:  # each new version was compared with the one it replaces, throughput included
        regression = json.loads((neuron_repo / "artifacts" / "published" / variant / "manifest.json").read_text())[
            "regression"]
        assert regression["against"].startswith(f"{variant}-ncc2.23.6484.0-") and regression["passed"]
        checks = {row["check"] for row in regression["checks"]}
        assert {"parity passed", "decode tokens/s", "tokens/s, 1 in flight"} <= checks


def wait_for_queue(repo: Path, timeout: float = 1200) -> str:
    """`dvc queue start`, then what `dvc queue status` says once nothing is queued or running."""
    import time

    dvc(repo, "queue", "start", "-j", "1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = dvc(repo, "queue", "status")
        if not re.search(r"\b(Queued|Running)\b", status):
            return status
        time.sleep(3)
    raise AssertionError(f"the queue did not finish in {timeout} s:\n{status}")


SWEEP = "artifacts/gemma4_tiny/sweep-512_fp32"


@pytest.mark.slow
def test_a_knob_sweep_the_dvc_way_queued_and_in_the_workspace(tmp_path):
    """docs/scale.md's "Sweeps, the DVC way" as a DVC user runs it: `dvc exp run --queue -S 'sweep.base=[512_fp32]'
    -S 'sweep.kv_max=A'` (docs/scale.md queues a list, A,B: one queued run shows what each does, for make test-slow's
    time), `dvc queue start`, then one more in the workspace. Each experiment builds its derived
    variant in the sweep's folder (so `dvc exp show` has one column per figure across them), publishes into the
    user's publish repository (the queued runs published into DVC's temporary copy, deleted afterwards), takes the
    checkpoint from the workspace instead of materialising it again, and neither rebuilds nor removes the named
    builds."""
    repo = checkout_copy(tmp_path / "repo", ["512_fp32"], quicker_validation)
    dvc(repo, "repro")
    for args in (["add", "dvc.lock"], ["commit", "-q", "-m", "the named builds"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    named = repo / "artifacts" / "gemma4_tiny" / "512_fp32"
    before = {p.name: sha256_file(p) for p in (named / "build").iterdir()}

    dvc(repo, "exp", "run", "--queue", "-S", "sweep.base=[512_fp32]", "-S", "sweep.kv_max=384")
    status = wait_for_queue(repo)
    assert status.count("Success") == 1 and "Failed" not in status, status
    logs = [dvc(repo, "queue", "logs", name) for name in re.findall(r"^\S+\s+(\S+)\s.*Success", status, re.M)]
    for log in logs:
        assert {s for s in ran(log) if "@" in s} == {f"sweep_{stage}@512_fp32"
                                                     for stage in ("trace", "package", "validate", "publish")}, log
        assert "from the DVC workspace's" in log and "Stage 'reference' didn't change" in log, log
        assert ".dvc/tmp/exps" not in re.search(r"publish: .*", log).group(0), log

    out = dvc(repo, "exp", "run", "-S", "sweep.base=[512_fp32]", "-S", "sweep.kv_max=256", "-n", "kv256")
    assert {s for s in ran(out) if "@" in s} == {f"sweep_{stage}@512_fp32"
                                                 for stage in ("trace", "package", "validate", "publish")}
    assert {p.name: sha256_file(p) for p in (named / "build").iterdir()} == before  # still there, untouched
    manifest = json.loads((repo / SWEEP / "dist" / "manifest.json").read_text())
    assert manifest["variant"]["kv_max"] == 256 and manifest["version"].startswith("512_fp32+kv256-")

    shown = json.loads(dvc(repo, "exp", "show", "--json"))
    runs = [e for row in shown for e in (row.get("experiments") or []) for e in (e.get("revs") or [])]
    by_kv = {r["data"]["params"]["params.yaml"]["data"]["sweep"]["kv_max"]: r["data"]["metrics"] for r in runs}
    assert set(by_kv) == {256, 384}
    for metrics in by_kv.values():  # one path, so one column per figure
        assert metrics[f"{SWEEP}/metrics.json"]["data"]["parity"]["passed"] is True
    listed = subprocess.run([sys.executable, "-m", "pipeline", "versions", str(repo / "artifacts" / "published")],
                            capture_output=True, text=True, cwd=REPO)
    for kv in (256, 384):
        assert f"512_fp32+kv{kv}-" in listed.stdout, listed.stdout + listed.stderr
