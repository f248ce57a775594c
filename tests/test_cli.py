"""The command line refuses bad input before any work, naming the setting and the fix, and touches nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def existing_artifacts(tmp_path) -> Path:
    root = tmp_path / "artifacts"
    (root / "gemma4_tiny" / "512_bf16" / "build").mkdir(parents=True)
    (root / "gemma4_tiny" / "512_bf16" / "build" / "tp_0.pt").write_bytes(b"an earlier build")
    return root


@pytest.mark.parametrize(("args", "expected"), [
    (["+variant=nope"], "Could not find 'variant/nope'"),
    ([], "add +variant=NAME (one of 2048_bf16, 2048_bf16_host, 2048_fp32, 256_bf16_host, 512_bf16, 512_bf16_host, "
         "512_fp32)"),
    (["stage=trace"], "stage 'trace' builds one variant: add +variant=NAME"),
    (["+variant=512_bf16", "validate.max_new_tokns=3"], "Key 'max_new_tokns' is not in struct"),
    (["+variant=512_bf16", "variant.kv_max=lots"], "variant.kv_max: Value 'lots' of type 'str' could not be converted"),
    (["+variant=512_bf16", "variant.dtype=int8"], "variant.dtype='int8' is not one of ['bf16', 'fp32']"),
    (["+variant=512_bf16", "variant.tp_degree=0"], "variant.tp_degree=0 must be at least 1"),
])
def test_bad_input_is_refused_before_any_work(existing_artifacts, args, expected):
    before = snapshot(existing_artifacts)
    proc = cli(*args, f"artifacts_dir={existing_artifacts}", "hydra.run.dir=" + str(existing_artifacts.parent / "log"))
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr
    after = snapshot(existing_artifacts)
    assert after == before  # nothing built, nothing removed, nothing overwritten


def test_unknown_variant_lists_the_available_ones(tmp_path):
    proc = cli("+variant=nope", f"artifacts_dir={tmp_path}")
    out = proc.stdout + proc.stderr
    for name in ("256_bf16_host", "512_fp32", "2048_bf16"):
        assert name in out


def test_ctrl_c_says_one_line_and_exits_130(tmp_path):
    """Interrupted in the middle of a stage: one line saying so, no tracebacks, the shell's 130."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "+variant=512_fp32", "backend=cpu",
                             f"artifacts_dir={tmp_path / 'artifacts'}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,  # Hydra logs to stdout
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal gives it
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "trace: 512_fp32 on cpu" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stdout.read()
    proc.wait(timeout=60)
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted: nothing half-written was kept" in rest and "Traceback" not in rest
    assert not (tmp_path / "artifacts" / "gemma4_tiny" / "512_fp32" / "build").exists()


def test_help_lists_the_subcommands_and_common_overrides_before_hydras_groups():
    from pipeline.__main__ import SUBCOMMANDS
    from pipeline.stages import ORDER

    shown = cli("--help")
    assert shown.returncode == 0, shown.stderr
    ours, hydras = shown.stdout.split("== Configuration groups ==")
    assert all(f"  {name} " in ours for name in SUBCOMMANDS) and ", ".join(ORDER) in ours
    assert "+variant=NAME" in ours and "python -m pipeline is powered by Hydra" in ours
    assert "variant: " in hydras and "512_bf16" in hydras


def test_a_misspelt_subcommand_is_named_with_the_nearest_one():
    wrong = cli("pul", "x")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert "'pul' is not a subcommand: did you mean 'pull'?" in wrong.stderr
    assert "missing EQUAL" not in wrong.stderr and "Traceback" not in wrong.stderr
