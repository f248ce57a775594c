"""Gemma-4-E2B beside E4B: the tiny model in E2B's shape (tests/helpers.py ``E2B_SHAPE``: one KV head, a period of
five layers, double-wide MLPs on the KV-shared layers, their unused K/V in the checkpoint) built as ``model=gemma4_e2b``
from a local folder, validated against transformers and published at one NeuronCore and at two, through
``python -m pipeline``, on the cpu backend and on the neuron backend's stand-in SDK; its builds kept apart from another
model's (their own repository; another model's checkpoint refused by ``generate``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

from . import fake_sdk
from .helpers import E2B_SHAPE, FAST_VALIDATE, config

ROOT = Path(__file__).resolve().parent.parent


def pipeline(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=900)


def e2b(artifacts: Path, checkpoint: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``model=gemma4_e2b`` built from ``checkpoint`` (the tiny model's prefix, ``model.``), the tiny E2B's
    resources derived from it as E2B's would be."""
    return pipeline("model=gemma4_e2b", f"model.path={checkpoint}", "model.text_prefix=model.",
                    f"artifacts_dir={artifacts}", *FAST_VALIDATE, *args, env=env)


@pytest.fixture(scope="module")
def e2b_checkpoint(tmp_path_factory) -> Path:
    artifacts = tmp_path_factory.mktemp("tiny-e2b")
    proc = pipeline(f"artifacts_dir={artifacts}", "stage=model", *E2B_SHAPE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return artifacts / "gemma4_tiny" / "weights"


@pytest.fixture(scope="module")
def sdk(tmp_path_factory) -> dict:
    return fake_sdk.env(fake_sdk.install(tmp_path_factory.mktemp("sdk")))


def test_the_tiny_model_takes_e2b_shape_with_the_releases_unused_kv(e2b_checkpoint):
    raw = json.loads((e2b_checkpoint / "config.json").read_text())
    assert raw["use_double_wide_mlp"] and raw["num_key_value_heads"] == 1 and raw["layer_types"][4] == "full_attention"
    with safe_open(e2b_checkpoint / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.9.mlp.up_proj.weight").get_shape() == [512, 128]  # KV-shared: double-wide
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_shape() == [256, 128]
    assert {"model.layers.6.self_attn.k_proj.weight", "model.layers.9.self_attn.v_proj.weight"} <= keys


# Per backend, built one after the other in one artifacts folder (one checkpoint, one reference): tp_degree 2 with the
# KV head copied (device prefill: the rank files slice it, the ModelBuilder is given it repeated; host prefill: the
# host's caches are copied to both ranks); and on one NeuronCore (cpu: test_a_third_model_is_its_conf_file; xla:
# tests/test_xla.py).
BUILDS = {"cpu": ["512_fp32"], "neuron": ["512_fp32", "256_bf16_host", "512_bf16_tp1"]}


def published(artifacts: Path, variant: str) -> dict:
    return json.loads((artifacts / "published" / variant / "manifest.json").read_text())


@pytest.mark.parametrize("backend", BUILDS)
def test_e2b_shape_builds_validates_and_publishes(tmp_path, e2b_checkpoint, sdk, backend):
    artifacts = tmp_path / "artifacts"
    for variant in BUILDS[backend]:
        proc = e2b(artifacts, e2b_checkpoint, f"+variant={variant}", f"backend={backend}",
                   env=sdk if backend == "neuron" else None)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        manifest = published(artifacts, variant)
        tp_degree = 1 if variant.endswith("_tp1") else 2
        assert manifest["variant"]["tp_degree"] == tp_degree and manifest["validation"]["parity"]["passed"]
        assert (manifest["model"]["name"], manifest["model"]["hub_id"]) == ("gemma4_e2b", "google/gemma-4-E2B-it")
        if backend == "cpu":  # one rank file per NeuronCore (the neuron backend's one model.pt holds every rank)
            assert [m["path"] for m in manifest["members"]] == [f"tp_{rank}.pt" for rank in range(tp_degree)]
        if variant == "512_fp32":  # fp32: every token and logit as transformers' (exact mode), the KV head copied
            assert manifest["validation"]["parity"]["mode"] == "exact"
    card = (artifacts / "published" / "README.md").read_text()
    assert "# google/gemma-4-E2B-it for AWS Inferentia2" in card and "--checkpoint /data/gemma-4-E2B-it" in card
    if backend == "cpu":
        kept_apart(artifacts, e2b_checkpoint)


def kept_apart(artifacts: Path, e2b_checkpoint: Path) -> None:
    """After E2B's 512_fp32 was published, a build of the tiny model headed for the same folder is refused before
    anything is built (publish would refuse it, before its regression gate compared the two: tests/test_hub.py); and
    E2B's build run with the other model's checkpoint is refused before any load."""
    other = pipeline("+variant=512_fp32", "backend=cpu", f"artifacts_dir={artifacts}", *FAST_VALIDATE)
    said = other.stdout + other.stderr
    assert other.returncode == 1 and "publish=local would refuse this build, so nothing was built" in said, said[-3000:]
    assert "holds builds of google/gemma-4-E2B-it; this is a build of gemma4_tiny" in said
    assert "publish.local_dir" in said and not (artifacts / "gemma4_tiny").exists()
    assert published(artifacts, "512_fp32")["model"]["name"] == "gemma4_e2b"
    tiny = pipeline("stage=model", f"artifacts_dir={artifacts}")  # the other model's checkpoint, for generate
    assert tiny.returncode == 0, tiny.stderr[-2000:]
    build = artifacts / "gemma4_e2b" / "512_fp32" / "build"
    wrong = pipeline("generate", str(build), "--checkpoint", str(artifacts / "gemma4_tiny" / "weights"),
                     "--prompt", "Hi!")
    assert wrong.returncode != 0 and "is not the checkpoint 512_fp32-" in wrong.stderr, wrong.stderr[-2000:]
    right = pipeline("generate", str(build), "--checkpoint", str(e2b_checkpoint), "--prompt", "Hi!",
                     "--max-new-tokens", "4")
    assert right.returncode == 0, right.stderr[-2000:]


THIRD = {"name": "gemma4_third", "source": "hub", "hub_id": "example/gemma-4-third-it", "revision": "0" * 40,
         "path": None, "text_prefix": "model.language_model.", "published_repo": "gemma-4-third-it-inferentia2"}


def test_a_third_model_is_its_conf_file(tmp_path, e2b_checkpoint):
    """docs/design.md, "How to add a model": a Gemma-4 E2B/E4B-style checkpoint is one file in conf/model/ (here in
    a directory Hydra's --config-dir adds, so that nothing of the checkout changes), built on one NeuronCore."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "gemma4_third.yaml").write_text(yaml.safe_dump(THIRD))
    artifacts = tmp_path / "artifacts"
    proc = pipeline("--config-dir", str(tmp_path / "conf"), "model=gemma4_third", f"model.path={e2b_checkpoint}",
                    "model.text_prefix=model.", "+variant=512_bf16_tp1", "backend=cpu", f"artifacts_dir={artifacts}",
                    *FAST_VALIDATE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    manifest = published(artifacts, "512_bf16_tp1")
    assert manifest["model"]["name"] == "gemma4_third" and manifest["variant"]["tp_degree"] == 1
    assert [m["path"] for m in manifest["members"]] == ["tp_0.pt"] and manifest["validation"]["parity"]["passed"]
    assert "base_model: example/gemma-4-third-it" in (artifacts / "published" / "README.md").read_text()


def test_model_gemma4_e2b_is_the_release_at_a_pinned_revision(tmp_path):
    cfg = config(tmp_path, "model=gemma4_e2b", "publish=hub", "publish.repo_id=team/gemma-4-E2B-it-inferentia2",
                 variant="512_bf16_tp1")
    assert (cfg.model.hub_id, cfg.model.text_prefix) == ("google/gemma-4-E2B-it", "model.language_model.")
    assert len(cfg.model.revision) == 40 and cfg.model.problems() == []
    assert config(tmp_path, "model=gemma4_e2b", "publish=hub").publish.repo_id == (
        "your-org/gemma-4-E2B-it-inferentia2")  # its own repository by default (the placeholder owner refused)
