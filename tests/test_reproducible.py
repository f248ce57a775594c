"""The same commit builds the same bytes from any checkout: another directory, another virtual environment's path,
another time. The scheduled runner reproduces a developer's build, so the version (which names the inputs) and the
archive (which the version's checksum covers) agree wherever they are built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from pipeline.artifact.manifest import Manifest

# `make test-slow`, and under the production and lowest versions
pytestmark = [pytest.mark.slow, pytest.mark.across_versions("torch")]  # each torch's TorchScript writer

REPO = Path(__file__).resolve().parent.parent
STAGES = ("toolchain", "model", "trace", "package")


def clone(dst: Path) -> Path:
    for rel in ("pipeline", "conf"):
        shutil.copytree(REPO / rel, dst / rel, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def build(checkout: Path, env: dict) -> Manifest:
    """One variant through package, run from ``checkout`` as a user runs it (its own ``pipeline`` package first)."""
    for stage in STAGES:
        proc = subprocess.run([sys.executable, "-m", "pipeline", "+variant=512_bf16", "backend=cpu", f"stage={stage}"],
                              cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return Manifest.read(checkout / "artifacts" / "gemma4_tiny" / "512_bf16" / "dist" / "manifest.json")


def test_two_checkouts_in_two_environments_build_the_same_archive(tmp_path):
    first = clone(tmp_path / "alice" / "src" / "gemma4-pipeline")
    second = clone(tmp_path / "ci-runner" / "work" / "checkout")
    # Another environment's path: the same installed packages, imported through another directory (torch's own
    # files are on the tracing stack, so their paths were in the old rank files).
    site = Path(sysconfig.get_paths()["purelib"])
    other_env = tmp_path / "opt" / "venvs" / "rebuild" / "site-packages"
    other_env.parent.mkdir(parents=True)
    other_env.symlink_to(site, target_is_directory=True)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ours = build(first, base)
    theirs = build(second, base | {"PYTHONPATH": str(other_env), "TZ": "Pacific/Auckland"})

    assert theirs.version == ours.version
    assert theirs.members == ours.members
    assert theirs.archive.sha256 == ours.archive.sha256
    # Nothing of where or by whom it was built is left in the rank files.
    for member in ours.members:
        rank = first / "artifacts" / "gemma4_tiny" / "512_bf16" / "build" / member.path
        with zipfile.ZipFile(rank) as zf:
            assert not [n for n in zf.namelist() if n.endswith(".debug_pkl")]
            blob = b"".join(zf.read(n) for n in zf.namelist() if not n.startswith("archive/data/"))
        for leak in (str(first), str(site), str(tmp_path), os.uname().nodename):
            assert leak.encode() not in blob, leak
