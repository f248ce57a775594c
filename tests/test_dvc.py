"""`dvc repro` builds the variants of params.yaml; a second run re-runs only the toolchain stage; editing one
variant's conf file re-runs only that variant."""

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

REPO = Path(__file__).resolve().parent.parent
COPY = ["conf", "pipeline", "dvc.yaml", "params.yaml", ".dvc/config", ".dvcignore", ".gitignore"]
VARIANTS = ["512_fp32", "256_bf16_host"]


def checkout_copy(dst: Path, variants: list[str]) -> Path:
    """A fresh checkout of this repository (its tracked files), building only ``variants``."""
    for rel in COPY:
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, dst / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst / rel)
    params = yaml.safe_load((dst / "params.yaml").read_text())
    params["variants"] = variants
    (dst / "params.yaml").write_text(yaml.safe_dump(params))
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "checkout"]):
        subprocess.run(["git", *args], cwd=dst, check=True, capture_output=True)
    return dst


def dvc(repo: Path, *args: str) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True, env=env,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return checkout_copy(tmp_path_factory.mktemp("dvc") / "repo", VARIANTS)


def test_dvc_repro_builds_every_listed_variant(repo):
    out = dvc(repo, "repro")
    assert {"toolchain", "model", "reference"} <= set(ran(out))
    for variant in VARIANTS:
        vdir = repo / "artifacts" / "gemma4_tiny" / variant
        assert sorted(p.name for p in (vdir / "build").iterdir()) == ["tp_0.pt", "tp_1.pt"]
        assert json.loads((vdir / "metrics.json").read_text())["parity"]["passed"] is True
        assert (vdir / "publish.json").is_file()
    shown = dvc(repo, "metrics", "show")
    assert all(f"artifacts/gemma4_tiny/{v}/metrics.json" in shown for v in VARIANTS)


def test_a_second_repro_runs_only_the_toolchain(repo):
    out = dvc(repo, "repro")
    assert ran(out) == ["toolchain"]


def test_editing_one_variant_reruns_only_that_variant(repo):
    conf = repo / "conf" / "variant" / "256_bf16_host.yaml"
    conf.write_text(conf.read_text() + "# touched\n")
    out = dvc(repo, "repro")
    stages = set(ran(out))
    assert {"toolchain", "trace@256_bf16_host"} <= stages
    assert stages <= {"toolchain"} | {f"{s}@256_bf16_host" for s in ("trace", "package", "validate", "publish")}
    # The retraced rank files are byte-identical, so DVC stops at the first unchanged output.
    assert "Stage 'validate@256_bf16_host' didn't change" in out
