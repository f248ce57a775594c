"""A newcomer's first hour, through the commands they type (issue 30): overrides that build something else under its
own name, the publish target checked before building, one summary at the end, one rule for new tokens, exit codes,
and the files a first run leaves where they belong."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline.artifact.manifest import Manifest
from pipeline.paths import Paths

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict | None = None, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def artifacts_copy(built: Path, dst: Path) -> Path:
    shutil.copytree(built, dst, ignore=shutil.ignore_patterns("logs", ".locks", "published"))
    return dst


def snapshot(folder: Path) -> dict[str, float]:
    """Every file but the run logs Hydra writes for each command, with its modification time."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))
            if p.is_file() and "logs" not in p.relative_to(folder).parts}


# -- 1. an override never rebuilds a named variant as something else -------------------------------------------------

def test_a_cache_beyond_the_models_positions_is_refused_and_nothing_is_written(validated_512_fp32, tmp_path):
    root = artifacts_copy(validated_512_fp32, tmp_path / "artifacts")
    before = snapshot(root)
    refused = cli("+variant=512_bf16", "variant.kv_max=99968", "stage=trace", f"artifacts_dir={root}", "backend=cpu")
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, said[-2000:]
    assert "variant.kv_max=99968 is beyond the model's 4096 positions" in said and "Traceback" not in said
    assert snapshot(root) == before  # nothing under 512_bf16/, nor under any derived name
    assert not (root / "gemma4_tiny" / "512_bf16").exists()


def test_an_override_builds_under_its_own_name_and_leaves_the_named_variant_alone(validated_512_fp32, tmp_path):
    root = artifacts_copy(validated_512_fp32, tmp_path / "artifacts")
    named = root / "gemma4_tiny" / "512_fp32"
    before = snapshot(named)
    for stage in ("trace", "package"):
        done = cli("+variant=512_fp32", "variant.kv_max=1024", f"stage={stage}", f"artifacts_dir={root}",
                   "backend=cpu")
        assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    said = done.stdout + done.stderr
    assert "built as 512_fp32+kv1024, in its own folder, with its own version and card" in said
    assert snapshot(named) == before
    manifest = Manifest.read(Paths(root, "gemma4_tiny", "512_fp32+kv1024").manifest)
    assert manifest.version.startswith("512_fp32+kv1024-") and manifest.variant.kv_max == 1024
    assert manifest.variant.name == "512_fp32+kv1024"


# -- 3. the publish target, checked before building ------------------------------------------------------------------

def test_every_reason_the_hub_would_refuse_is_said_before_the_first_stage(tmp_path):
    root = tmp_path / "artifacts"
    no_token = {"HF_TOKEN": "", "HF_HOME": str(tmp_path / "hf_home")}
    refused = cli("+variant=512_fp32", "publish=hub", f"artifacts_dir={root}", "backend=cpu", env=no_token)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, said[-2000:]
    assert "publish=hub would refuse this build, so nothing was built" in said
    for reason in ("is the documentation's placeholder", "no Hugging Face token: set HF_TOKEN",
                   "the build is a demo build: its model, 'gemma4_tiny', is the embedded tiny test model"):
        assert reason in said, said[-2000:]
    assert not (root / "toolchain.json").exists() and not (root / "gemma4_tiny").exists()
    # Under dvc repro the trace stage is the first to know the target (dvc.yaml passes it publish=${publish}).
    dvc = cli("+variant=512_fp32", "stage=trace", "publish=hub", "publish.repo_id=tester/builds",
              "publish.allow_demo=true", f"artifacts_dir={root}", "backend=cpu", env=no_token)
    assert dvc.returncode == 1 and "no Hugging Face token" in dvc.stdout + dvc.stderr
    assert "placeholder" not in dvc.stdout + dvc.stderr and "demo build" not in dvc.stdout + dvc.stderr


# -- 4, 6. the commands as written, one rule, one table of exit codes ------------------------------------------------

def test_a_python_that_is_not_the_pipelines_environment_is_refused_even_for_help(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    for args in (["--help"], ["serve", "--help"], ["+variant=512_fp32"]):
        proc = subprocess.run([str(bare / "bin" / "python"), "-m", "pipeline", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "it is not the pipeline's environment" in proc.stderr and ". .venv/bin/activate" in proc.stderr
        assert "Traceback" not in proc.stderr and not proc.stdout


def test_version_and_misspelt_group_choices():
    from pipeline import __version__

    version = cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"gemma4-neuron-pipeline {__version__}"
    typo = cli("+variant=512_bf17", "backend=nueron")
    assert typo.returncode == 2
    assert "variant=512_bf17 is not one of" in typo.stderr and "did you mean '512_bf16'" in typo.stderr
    assert "backend=nueron is not one of ['auto', 'cpu', 'neuron', 'xla']" in typo.stderr


def test_generate_takes_a_build_folder_and_refuses_more_tokens_than_the_cache_holds(validated_512_fp32):
    build = validated_512_fp32 / "gemma4_tiny" / "512_fp32" / "build"
    weights = validated_512_fp32 / "gemma4_tiny" / "weights"
    ok = cli("generate", str(build), "--checkpoint", str(weights), "--prompt", "Hi", "--max-new-tokens", "3")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "3 new tokens" in ok.stderr
    assert "its text is meaningless by design" in ok.stderr  # where a newcomer first reads the tiny model's text
    much = cli("generate", str(build), "--checkpoint", str(weights), "--prompt", "Hi", "--max-new-tokens", "1000")
    assert much.returncode == 1 and "--max-new-tokens 1000 with a prompt of" in much.stderr
    assert "ask for at most" in much.stderr  # serve's words for max_tokens (tests/test_serve.py)
    elsewhere = cli("generate", str(validated_512_fp32), "--checkpoint", str(weights), "--prompt", "Hi")
    assert elsewhere.returncode == 1 and "pass the directory `python -m pipeline pull` printed" in elsewhere.stderr


def test_pull_without_dest_unpacks_into_the_cache_folder_not_here(validated_512_fp32, tmp_path):
    cache = tmp_path / "cache"
    here = tmp_path / "checkout"
    here.mkdir()
    proc = cli("pull", str(validated_512_fp32 / "published"), "512_fp32", "--allow-unsigned",
               env={"GEMMA4_PIPELINE_CACHE": str(cache)}, cwd=here)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()).parent == cache / "versions" and list(here.iterdir()) == []


def test_a_refused_neuron_run_changes_no_record(validated_512_fp32, tmp_path):
    """backend=neuron on a host without the Neuron packages: refused before the toolchain stage, so toolchain.json
    (every build's dependency) is not rewritten and no build is marked stale."""
    root = artifacts_copy(validated_512_fp32, tmp_path / "artifacts")
    before = (root / "toolchain.json").read_bytes(), (root / "toolchain.json").stat().st_mtime_ns
    for args in (["+variant=512_bf16"], ["stage=toolchain"]):
        proc = cli(*args, "backend=neuron", f"artifacts_dir={root}")
        assert proc.returncode == 1 and "deploy/install-inf2.sh" in proc.stdout + proc.stderr
        assert ((root / "toolchain.json").read_bytes(), (root / "toolchain.json").stat().st_mtime_ns) == before


def test_the_signing_recipe_keeps_the_private_key_out_of_the_checkout():
    from pipeline.artifact.signing import KEYGEN

    assert "~/.config/gemma4-neuron-pipeline/signing-key.pem" in KEYGEN and "umask 077" in KEYGEN
    ignored = subprocess.run(["git", "check-ignore", "-q", "signing-key.pem"], cwd=REPO).returncode == 0
    public = subprocess.run(["git", "check-ignore", "-q", "signing-key.pub.pem"], cwd=REPO).returncode == 0
    assert ignored and not public
    readme = (REPO / "README.md").read_text()
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 130 |"):
        assert code in readme
    from pipeline.__main__ import EXIT_CODES, SUBCOMMANDS

    assert set(EXIT_CODES) == {int(line.split("|")[1]) for line in readme.splitlines()
                               if re.match(r"^\| \d+ \|", line)}
    assert "check-remote" in SUBCOMMANDS and "`check-remote`" in readme


# -- 5. one summary at the end of a multirun --------------------------------------------------------------------------

def test_a_multirun_runs_every_variant_then_says_which_failed(validated_512_fp32, tmp_path):
    root = artifacts_copy(validated_512_fp32, tmp_path / "artifacts")
    failing = root / "gemma4_tiny" / "weights" / "config.json"
    config = json.loads(failing.read_text())
    config["max_position_embeddings"] = 300  # 512_fp32's cache is longer: refused; 256_bf16_host's fits
    failing.write_text(json.dumps(config))
    proc = cli("--multirun", "+variant=512_fp32,256_bf16_host", "stage=trace", f"artifacts_dir={root}",
               "backend=cpu", timeout=900)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1, said[-3000:]
    assert "multirun: 2 variant(s), 1 succeeded, 1 failed" in said
    assert re.search(r"512_fp32\s+FAILED", said) and re.search(r"256_bf16_host\s+ok", said)
    assert "multirun: 1 of 2 variant(s) failed: 512_fp32" in said
    assert (root / "gemma4_tiny" / "256_bf16_host" / "build").is_dir()  # the second ran after the first failed
