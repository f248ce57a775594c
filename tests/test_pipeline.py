"""One variant end to end through the command line users run, then again (everything up to date)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from pipeline.artifact.manifest import Manifest
from pipeline.core.fsutil import sha256_file
from pipeline.stages.package import version_name

from .conftest import run_cli
from .helpers import CPU_COMPILER

# Every version environment runs these (the mark names no distribution: they depend on many).
pytestmark = pytest.mark.across_versions

REPO = Path(__file__).resolve().parent.parent
VARIANT = "512_fp32"
LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


@pytest.fixture
def built(tiny_512_fp32) -> tuple[Path, subprocess.CompletedProcess]:
    return tiny_512_fp32


def test_every_stage_ran_and_left_its_outputs(built):
    root, first = built
    log = first.stdout + first.stderr
    assert "ran toolchain, model, reference, trace, package, validate, publish" in log
    vdir = root / "gemma4_tiny" / VARIANT
    assert sorted(p.name for p in (vdir / "build").iterdir()) == ["tp_0.pt", "tp_1.pt"]
    manifest = Manifest.read(vdir / "dist" / "manifest.json")
    archive = vdir / "dist" / manifest.archive.name
    assert sha256_file(archive) == manifest.archive.sha256
    build = json.loads((vdir / "build.json").read_text())
    assert manifest.version == version_name(VARIANT, CPU_COMPILER, build["inputs_digest"], "tar.zst", False)
    assert re.fullmatch(rf"{VARIANT}-{re.escape(CPU_COMPILER)}-[0-9a-f]{{8}}", manifest.version)
    assert [m.path for m in manifest.members] == ["tp_0.pt", "tp_1.pt"]
    metrics = json.loads((vdir / "metrics.json").read_text())
    assert metrics["parity"] == {"passed": True, "mode": "exact"}
    assert set(metrics["tokens_per_s"]) == set(metrics["ttft_ms"]) == {"short", "half", "near_max"}
    assert all(v > 0 for v in [*metrics["tokens_per_s"].values(), *metrics["ttft_ms"].values()])
    receipt = json.loads((vdir / "publish.json").read_text())
    assert receipt["tag"] == manifest.version and len(receipt["commit"]) == 40
    toolchain = json.loads((root / "toolchain.json").read_text())
    assert toolchain["backend"] == "cpu" and toolchain["packages"]["neuronx-cc"]["version"] is None


def test_validation_shows_its_progress_in_the_stages_log(built):
    """The validation process's lines (one per prompt, one per context length) are in the command's standard error
    and in the run's log file, in the one format every command uses."""
    root, first = built
    # Results and logs apart: every log line goes to standard error, the rank processes' included (torch 2.8's gloo,
    # the production pin, prints its connection lines on standard output from C++: procinfo.output_to_stderr).
    assert first.stdout == "", first.stdout
    assert first.stderr and all(LINE.match(line) or line.startswith(" ") for line in first.stderr.splitlines())
    judged = [p["prompt"] for p in json.loads((root / "gemma4_tiny" / VARIANT / "validation.json").read_text())[
        "prompts"]]
    shown = re.findall(r"validate: prompt (\d+)/(\d+) (\w+) \(\d+ tokens\): pass \(exact\), ", first.stderr)
    assert shown == [(str(i), str(len(judged)), name) for i, name in enumerate(judged, 1)]
    assert re.findall(r"validate: throughput (\d/\d), (\w+) context \((\d+) tokens\): [\d.]+ tokens/s",
                      first.stderr) == [("1/3", "short", "16"), ("2/3", "half", "256"), ("3/3", "near_max", "495")]
    log_file = next((root / "logs").rglob("*.log")).read_text()
    assert all(line in log_file for line in first.stderr.splitlines() if "validate: prompt " in line)


def test_the_archive_unpacks_to_one_directory_of_rank_files(built, tmp_path):
    root, _ = built
    dist = root / "gemma4_tiny" / VARIANT / "dist"
    manifest = Manifest.read(dist / "manifest.json")
    assert manifest.archive.format == "tar.zst"
    subprocess.run(["tar", "-I", "zstd", "-xf", str(dist / manifest.archive.name), "-C", str(tmp_path)],
                   check=True)
    names = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    top = manifest.archive.root
    assert names == [top, f"{top}/tp_0.pt", f"{top}/tp_1.pt"]


def test_the_published_repo_holds_the_version(built):
    root, _ = built
    repo = root / "published"
    tags = subprocess.run(["git", "tag"], cwd=repo, capture_output=True, text=True).stdout.split()
    assert tags == [Manifest.read(root / "gemma4_tiny" / VARIANT / "dist" / "manifest.json").version]
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", tags[0]], cwd=repo, capture_output=True,
                           text=True).stdout.split()
    assert "README.md" in files and f"{VARIANT}/manifest.json" in files and f"{VARIANT}/metrics.json" in files
    published = json.loads(subprocess.run(["git", "show", f"{tags[0]}:{VARIANT}/manifest.json"], cwd=repo,
                                          capture_output=True, text=True).stdout)
    assert published["validation"]["parity"]["passed"] is True


def test_a_second_run_rebuilds_nothing(built):
    root, _ = built
    # Logs and locks are each run's own bookkeeping (filelock 3.12, the lowest allowed, rewrites a lock file when
    # taken); every output must stay as it was.
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")
              if p.is_file() and not {"logs", ".locks"} & set(p.parts) and p.suffix != ".lock"}
    second = run_cli(f"+variant={VARIANT}", "backend=cpu", f"artifacts_dir={root}")
    assert "ran nothing (all up to date)" in second.stdout + second.stderr  # publish only checks: same archive
    assert "nothing to do" in second.stdout + second.stderr
    after = {p: p.stat().st_mtime_ns for p in before}
    assert after == before
