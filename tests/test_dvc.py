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
COPY = ["conf", "pipeline", "dvc.yaml", "params.yaml", ".dvc/config", ".dvc/plots", ".dvcignore", ".gitignore"]
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


def test_metrics_diff_and_plots_read_cleanly(repo):
    """Commit a build's metrics with dvc.lock, validate again: the diff is figures only, the plots render."""
    for args in (["add", "-A"], ["commit", "-q", "-m", "build"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    dvc(repo, "repro", "--force", "--single-item", "validate@512_fp32")
    diff = dvc(repo, "metrics", "diff", "--all")
    assert "throughput.tokens_per_s" in diff and "throughput.latency_ms_p50" in diff
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
