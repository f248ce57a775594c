"""Faults and bad input: interrupted traces, killed ranks, a full disk, invalid configurations, concurrent runs,
idempotent rebuilds, and TorchScript loaded only after verification (shared/reference/reliability.md §5).

Faults are injected from outside the code under test: signals sent to real processes, ``ulimit -f``
(RLIMIT_FSIZE) on the process, and two shims in tests/faults/sitecustomize.py that every Python process of a test
loads (a rank that pauses after writing its file; an audit of every ``torch.jit.load``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from pipeline.artifact.manifest import Manifest
from pipeline.core.build_records import ModelRecord, NeuronxCcBuild, PackageVersion, ToolchainRecord
from pipeline.core.errors import ConfigError
from pipeline.core.fsutil import sha256_file
from pipeline.host.preflight import resolve_hardware
from pipeline.paths import Paths
from pipeline.run import load_config
from pipeline.stages import reference as reference_stage
from pipeline.stages import trace as trace_stage
from pipeline.stages import validate as validate_stage

from .helpers import FAST_VALIDATE, a_manifest, config, run
from .test_config import composed
from .test_dvc import checkout_copy, dvc, quicker_validation

REPO = Path(__file__).resolve().parent.parent
FAULTS = REPO / "tests" / "faults"
VARIANT = "512_fp32"


def env_with(**extra: str) -> dict:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    return {**os.environ, "PATH": path, "PYTHONPATH": str(FAULTS), **extra}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:  # gone, or a zombie
        return []


def stage_and_ranks(dvc_pid: int) -> tuple[psutil.Process, list[psutil.Process]]:
    """The `python -m pipeline` process DVC started, and its rank processes."""
    def find():
        for proc in psutil.Process(dvc_pid).children(recursive=True):
            if cmdline(proc)[1:3] == ["-m", "pipeline"]:
                ranks = [c for c in proc.children(recursive=True) if "spawn_main" in " ".join(cmdline(c))]
                if len(ranks) == 2:
                    return proc, ranks
        return None

    return wait_for(find, 60, "the trace stage and its two ranks")


def interruptible() -> None:
    """Ctrl-C's default action for the run under test. A test runner started in the background of a shell without
    job control (``cmd &`` in a script) has SIGINT ignored, and every process it starts inherits that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def process_report(pid: int) -> str:
    """What is left of a process tree, and where each Python process of it is (py-spy, when installed)."""
    lines = []
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            lines.append(f"{proc.pid} {proc.status()} {' '.join(cmdline(proc))[:150]}")
            if shutil.which("py-spy"):
                lines.append(subprocess.run(["py-spy", "dump", "--pid", str(proc.pid)], capture_output=True,
                                            text=True).stdout[-1500:])
    return "\n".join(lines)


# -- interrupted traces -------------------------------------------------------------------------------------------

@pytest.mark.slow  # `make test-slow` (and `.ci/run`) runs it
def test_interrupted_traces_leave_nothing_and_the_rerun_succeeds(tmp_path):
    """Four interruptions of `dvc repro trace@512_fp32` while both ranks have written their files under the staging
    name: Ctrl-C (SIGINT to the process group), the OOM killer's SIGKILL of one rank, SIGKILL of the stage process,
    SIGKILL of everything. None leaves a rank file under its final name or changes dvc.lock; Ctrl-C and the killed
    rank leave no temporary files; the others' leftovers, and the stale lock, are reclaimed by the rerun."""
    repo = checkout_copy(tmp_path / "repo", [VARIANT], quicker_validation)
    dvc(repo, "repro", "toolchain", "model")  # what trace depends on, recorded in dvc.lock
    variant_dir = repo / "artifacts" / "gemma4_tiny" / VARIANT
    lock_before = (repo / "dvc.lock").read_bytes()
    leftovers = []
    for how in ("sigint-group", "sigkill-rank", "sigkill-stage", "sigkill-group"):
        proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", f"trace@{VARIANT}"], cwd=repo,
                                env=env_with(FAULT_SLOW_JIT_SAVE_S="300"), start_new_session=True,
                                preexec_fn=interruptible, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            stage, ranks = stage_and_ranks(proc.pid)
            wait_for(lambda: len(list(variant_dir.glob(".build.tmp-*/tp_*.pt"))) == 2, 120, "both rank files")
            if how == "sigint-group":
                os.killpg(proc.pid, signal.SIGINT)
            elif how == "sigkill-rank":
                ranks[0].send_signal(signal.SIGKILL)
            elif how == "sigkill-stage":
                stage.send_signal(signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
            try:
                out = proc.communicate(timeout=120)[0]
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{how}: the interrupted run did not end; still running:\n"
                                     f"{process_report(proc.pid)}") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode != 0, (how, out)
        _, alive = psutil.wait_procs([stage, *ranks], timeout=30)
        assert not alive, f"{how}: {alive} outlived the run"  # ranks die with their parent (PR_SET_PDEATHSIG)
        assert not (variant_dir / "build").exists() and not (variant_dir / "build.json").exists(), how
        assert (repo / "dvc.lock").read_bytes() == lock_before, how
        temps = sorted(variant_dir.glob(".*tmp-*"))
        if how in ("sigint-group", "sigkill-rank"):
            assert temps == [], (how, temps)
        else:
            assert temps, how  # a SIGKILLed stage cannot clean up: the next run must
            leftovers += temps
        if how == "sigkill-rank":
            assert "rank 0 was killed by SIGKILL (exit -9): most likely the out-of-memory killer" in out, out
            assert "At the preflight: available RAM" in out, out

    out = dvc(repo, "repro", f"trace@{VARIANT}")
    assert "left by an interrupted run" in out
    assert f"reclaimed lock gemma4_tiny-{VARIANT} from a run that ended without releasing it" in out
    assert sorted(p.name for p in (variant_dir / "build").iterdir()) == ["tp_0.pt", "tp_1.pt"]
    assert not list(variant_dir.glob(".*tmp-*")) and not any(p.exists() for p in leftovers)
    assert f"trace@{VARIANT}" in yaml.safe_load((repo / "dvc.lock").read_text())["stages"]


# -- one built variant, shared by the tests below ------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(validated_512_fp32) -> Path:
    return validated_512_fp32  # shared: every test below works on copy_of(built, ...)


def copy_of(root: Path, dst: Path) -> Path:
    shutil.copytree(root, dst, ignore=shutil.ignore_patterns("logs", ".locks"))
    return dst


def cli(*args: str, file_size_limit: int | None = None, **env: str) -> subprocess.CompletedProcess:
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          env=env_with(**env), preexec_fn=limit if file_size_limit else None, timeout=600)


def stage_args(root: Path, stage: str) -> list[str]:
    return [f"+variant={VARIANT}", f"stage={stage}", "backend=cpu", f"artifacts_dir={root}", *FAST_VALIDATE]


def no_temps(directory: Path) -> bool:
    return not [p for p in directory.rglob("*") if ".tmp-" in p.name]


# -- a full disk ----------------------------------------------------------------------------------------------------

# the trace step rebuilds from scratch: make test-slow, for make test's budget
@pytest.mark.parametrize("step", [pytest.param("trace", marks=pytest.mark.slow), "package", "pull"])
def test_a_full_disk_fails_cleanly_and_the_rerun_works_once_there_is_room(built, tmp_path, step):
    root = copy_of(built, tmp_path / "artifacts")
    paths = Paths.of(config(root, *FAST_VALIDATE))
    rank_size = (paths.build / "tp_0.pt").stat().st_size
    manifest = Manifest.read(paths.manifest)
    if step == "trace":
        shutil.rmtree(paths.build)
        paths.build_record.unlink()
        args, final = stage_args(root, "trace"), paths.build
    elif step == "package":
        shutil.rmtree(paths.dist)
        args, final = stage_args(root, "package"), paths.dist
    else:
        dest = tmp_path / "serving"
        args = ["pull", str(root / "published"), manifest.version, "--dest", str(dest), "--allow-unsigned"]
        final = dest / manifest.archive.root
    full = cli(*args, file_size_limit=rank_size // 2)
    said = full.stdout + full.stderr  # (Hydra logs to stdout)
    assert full.returncode == 1, said[-2000:]
    assert "out of space writing" in said and "ulimit -f" in said, said[-2000:]
    assert "Traceback" not in said
    assert not final.exists()
    assert no_temps(final.parent)

    again = cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    if step == "trace":
        assert {m.path: m.sha256 for m in manifest.members} == {
            p.name: sha256_file(p) for p in paths.build.iterdir()}
    elif step == "package":
        assert sha256_file(paths.dist / manifest.archive.name) == manifest.archive.sha256
    else:
        assert again.stdout.strip() == str(final)
        assert sorted(p.name for p in final.iterdir()) == ["tp_0.pt", "tp_1.pt"]


# -- idempotency and concurrency ------------------------------------------------------------------------------------

def published_history(repo: Path) -> tuple[list[str], list[str]]:
    """Every commit and every tag of a publish=local repository."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.split()

    return git("rev-list", "--all"), git("tag")


@pytest.mark.slow  # a whole build and validation (make test-slow), for make test's budget
def test_a_forced_rebuild_gives_the_same_archive_and_publishes_nothing(built, tmp_path):
    root = copy_of(built, tmp_path / "artifacts")
    paths = Paths.of(config(root, *FAST_VALIDATE))
    before, history = Manifest.read(paths.manifest).archive.sha256, published_history(root / "published")
    results = run(config(root, *FAST_VALIDATE, "force=true"))
    # Every build stage really ran again; the toolchain record and the published repository had nothing to change.
    assert [(r.stage, r.status) for r in results] == [("toolchain", "skipped")] + [
        (s, "ran") for s in ("model", "reference", "trace", "package", "validate")] + [("publish", "skipped")]
    assert Manifest.read(paths.manifest).archive.sha256 == before
    assert sha256_file(paths.dist / Manifest.read(paths.manifest).archive.name) == before
    assert published_history(root / "published") == history  # no new commit, no new tag


def test_two_publishes_of_one_variant_at_once_make_one_commit(built, tmp_path):
    root = copy_of(built, tmp_path / "artifacts")
    args = [*stage_args(root, "publish"), "publish.local_dir=published_again"]
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=REPO, env=env_with(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    commits, tags = published_history(root / "published_again")
    assert len(tags) == 1 and len(commits) == len(published_history(root / "published")[0])
    # One after the other (the variant's lock): the first made the commit, the second found it there.
    assert sorted("(new commit)" in out for out in outs) == [False, True], outs
    assert sorted("(already there)" in out for out in outs) == [False, True], outs


@pytest.mark.slow  # `make test-slow` (and `.ci/run`) runs it
def test_two_dvc_repros_at_once_one_refused_nothing_corrupted(tmp_path):
    repo = checkout_copy(tmp_path / "repo", [VARIANT], quicker_validation)
    dvc(repo, "repro", "model")
    procs = [subprocess.Popen([sys.executable, "-m", "dvc", "repro", f"package@{VARIANT}"], cwd=repo, env=env_with(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0 and codes[1] != 0, outs
    refused = outs[[p.returncode for p in procs].index(codes[1])]
    # DVC refuses the second run: its repository lock, or the read/write lock on the outputs the first one holds.
    assert "Unable to acquire lock" in refused or "is busy, it is being blocked by" in refused, refused
    status = dvc(repo, "status", "model", f"trace@{VARIANT}", f"package@{VARIANT}")
    assert "Data and pipelines are up to date" in status, status
    dist = repo / "artifacts" / "gemma4_tiny" / VARIANT / "dist"
    manifest = Manifest.read(dist / "manifest.json")
    assert sha256_file(dist / manifest.archive.name) == manifest.archive.sha256


# -- TorchScript is loaded only after verification ------------------------------------------------------------------

@pytest.mark.slow  # `make test-slow` (and `.ci/run`) runs it
def test_torchscript_is_loaded_only_from_verified_files(built, tmp_path):
    """Every torch.jit.load, in every process, is audited: each file loaded is a verified extraction whose sha256 the
    manifest records; a tampered archive is refused with no load at all."""
    root = copy_of(built, tmp_path / "artifacts")
    paths = Paths.of(config(root, *FAST_VALIDATE))
    manifest = Manifest.read(paths.manifest)
    audit = tmp_path / "jit_load.log"
    ok = cli(*stage_args(root, "validate"), "force=true", AUDIT_JIT_LOAD=str(audit))
    assert ok.returncode == 0, ok.stderr[-2000:]
    loads = [line.split(" ", 1) for line in audit.read_text().splitlines()]
    assert len(loads) == 2  # both ranks
    recorded = {m.sha256 for m in manifest.members}
    for digest, path in loads:
        assert digest in recorded
        assert not Path(path).is_relative_to(paths.build)  # the verified extraction, not the build directory

    pulled = cli("pull", str(root / "published"), manifest.version, "--dest", str(tmp_path / "serving"),
                 "--allow-unsigned")
    assert pulled.returncode == 0, pulled.stderr
    gen = cli("generate", pulled.stdout.strip(), "--checkpoint", str(paths.weights), "--prompt", "Hi",
              "--max-new-tokens", "2", AUDIT_JIT_LOAD=str(audit))
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert len(audit.read_text().splitlines()) == 4 and all(
        line.split(" ", 1)[0] in recorded for line in audit.read_text().splitlines())

    archive = paths.dist / manifest.archive.name
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 1
    archive.write_bytes(bytes(data))
    audit.unlink()
    bad = cli(*stage_args(root, "validate"), "force=true", AUDIT_JIT_LOAD=str(audit))
    assert bad.returncode == 1 and "sha256" in bad.stderr
    assert not audit.exists()  # nothing was loaded


# -- bad configurations and fingerprints ----------------------------------------------------------------------------

WORD = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True).filter(
    lambda w: w not in {"true", "false", "null", "nan", "inf", "none", "yes", "no", "on", "off"})
BAD_OVERRIDES = st.one_of(
    st.integers(max_value=0).map(lambda n: ("variant.kv_max", f"variant.kv_max={n}")),
    st.integers(min_value=1, max_value=4096).filter(lambda n: 512 % n).map(
        lambda n: ("variant.bucket", f"variant.bucket={n}")),
    WORD.filter(lambda w: w not in {"bf16", "fp32"}).map(lambda w: ("variant.dtype", f"variant.dtype={w}")),
    WORD.filter(lambda w: w not in {"device", "host"}).map(lambda w: ("variant.prefill", f"variant.prefill={w}")),
    WORD.filter(lambda w: w not in {"auto", "cpu", "neuron"}).map(lambda w: ("backend.name", f"backend.name={w}")),
    WORD.filter(lambda w: w not in {"exact", "teacher_forced", "logits"}).map(
        lambda w: ("validate.parity.bf16", f"validate.parity.bf16={w}")),
    WORD.filter(lambda w: w not in {"tar.zst", "tar.gz", "tar"}).map(
        lambda w: ("package.format", f"package.format={w}")),
    st.integers(max_value=0).map(lambda n: ("validate.max_new_tokens", f"validate.max_new_tokens={n}")),
    WORD.map(lambda w: ("variant.tp_degree", f"variant.tp_degree={w}")),
    WORD.map(lambda w: (f"validate.{w}_x", f"+validate.{w}_x=1")),  # an unknown key
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.lists(BAD_OVERRIDES, min_size=1, max_size=3, unique_by=lambda b: b[0]), order=st.randoms())
def test_invalid_overrides_never_start_work_and_name_each_key(bad, order, tmp_path):
    artifacts = tmp_path / "never-made"
    overrides = [f"+variant={VARIANT}", f"artifacts_dir={artifacts}", *(o for _, o in bad)]
    order.shuffle(overrides)
    with pytest.raises(ConfigError) as err:
        load_config(composed(overrides), VARIANT)
    for key, _ in bad:
        assert key in str(err.value), (key, str(err.value))
    assert not artifacts.exists()


MODEL_RECORD = ModelRecord(fingerprint="m" * 64, source_fingerprint="s" * 64, name="gemma4_tiny", source="tiny",
                           hub_id=None, revision=None, text_prefix="model.", head_key="lm_head.weight",
                           config_digest="c" * 64, weights_digest="w" * 64, files={}, spec={})
TOOLCHAIN = ToolchainRecord(2, "cpu", {"torch": PackageVersion("2.13.0")}, NeuronxCcBuild(None, None), {})
MANIFEST = a_manifest()
REFERENCE_FP = "r" * 64


def fingerprints(overrides: list[str]) -> tuple[str, str, str]:
    cfg = load_config(composed([f"+variant={VARIANT}", "backend=cpu", *overrides]), VARIANT)
    return (trace_stage.build_fingerprint(cfg, MODEL_RECORD, TOOLCHAIN, "cpu"),
            reference_stage.expected_fingerprint(cfg, MODEL_RECORD, []),
            validate_stage.metrics_fingerprint(cfg, MANIFEST, REFERENCE_FP, resolve_hardware(cfg.hardware.name)))


@functools.cache
def default_fingerprints() -> tuple[str, str, str]:
    return fingerprints([])


def leaves(node, prefix=""):
    """(dotted key, value) for every scalar setting of the composed default configuration."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, f"{prefix}{key}.")
    elif isinstance(node, (bool, int, float, str)):
        yield prefix[:-1], node


def written_out(key: str, value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else f"'{value}'"
    return f"{key}={text}"


DEFAULTS = [(k, v) for k, v in leaves(OmegaConf.to_container(composed([f"+variant={VARIANT}", "backend=cpu"]),
                                                              resolve=True))
            if k not in ("variant.name", "artifacts_dir", "stage", "force")]
SEMANTIC = ["variant.kv_max=1024", "variant.bucket=64", "variant.dtype=bf16", "variant.prefill=host",
            "model.text_prefix='model.language_model.'", "validate.max_new_tokens=40", "validate.throughput.runs=3",
            "validate.parity.fp32=teacher_forced", "validate.warmup_prompts=0", "hardware=inf2_xlarge",
            "validate.throughput.contexts=[short]", "validate.prompt_names=[capital,spans_64]"]


@settings(max_examples=25, deadline=None)
@given(written=st.lists(st.sampled_from(DEFAULTS), max_size=8, unique_by=lambda kv: kv[0]), order=st.randoms())
def test_equivalent_configurations_have_the_same_fingerprints(written, order):
    """Defaults written out, in any order, with settings no output depends on: the same fingerprints."""
    overrides = [written_out(k, v) for k, v in written] + ["publish.allow_regression=true", "force=true", "stage=trace"]
    order.shuffle(overrides)
    assert fingerprints(overrides) == default_fingerprints()


@pytest.mark.parametrize("change", SEMANTIC)
def test_every_semantic_change_changes_a_fingerprint(change):
    assert fingerprints([change]) != default_fingerprints()


LOADERS = ("torch.jit.load", "torch.load", "parallel_model_load")


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def load_calls(tree: ast.AST, function: ast.AST | None = None):
    """(call, the innermost function around it) for every call of a TorchScript / pickle loader."""
    for child in ast.iter_child_nodes(tree):
        inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        if isinstance(child, ast.Call) and dotted(child.func).endswith(LOADERS):
            yield child, function
        yield from load_calls(child, inner)


def test_every_loader_call_takes_a_verified_build():
    """Statically: torch.jit.load, torch.load and NxD's parallel_model_load are called only in functions that take a
    VerifiedBuild (which only archive verification creates), and torch.load, if ever used, with weights_only=True."""
    sites = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for call, function in load_calls(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{call.lineno}"
            assert function is not None, f"{where}: a loader called outside any function"
            args = function.args.args + function.args.kwonlyargs
            assert any(dotted(a.annotation) == "VerifiedBuild" for a in args if a.annotation), (
                f"{where}: {dotted(call.func)} in {function.name}(), which takes no VerifiedBuild")
            if dotted(call.func) == "torch.load":
                assert any(k.arg == "weights_only" and getattr(k.value, "value", None) is True
                           for k in call.keywords), f"{where}: torch.load without weights_only=True"
            sites.append(where)
    assert len(sites) >= 3  # the cpu rank loader, and the neuron backend's two (torch.jit.load, parallel_model_load)
