"""A rehearsal of the production path: the scheduled rebuild's own entry point, as the workflow runs it.

`deploy/rebuild.sh` runs in a checkout set up as a team's release repository is: `params.yaml` names the real model
(`gemma4_e4b`, from a local checkpoint laid out exactly as the E4B release, at small widths), the neuron backend (the
stand-in SDK, as an inf2.8xlarge reports itself), `hardware=inf2_8xlarge` and `publish=hub` (the local test Hub, as
strict as the Hub); the package config signs with a key and refuses unsigned artifacts; a DVC remote holds the
cache; check-upgrades reads a stand-in Neuron repository. The test asserts what a consumer trusts: every gate
applied, every archive signed and verified by `pull`, one commit and one tag per version, a second run publishes
nothing, and a compiler upgrade (SDK 2.28.1 to 2.29.0) publishes exactly the new versions, each compared with the
version it replaces.

What differs from production, and why: the checkpoint is small, so the model's resource figures are small; the
stand-in runs on this machine's CPU; SDK 2.29 refuses host prefill unless allowed, so the checkout allows it (as a
team building host-prefill variants there would have to); the throughput floors and the regression tolerances are
the stand-in's (tests/helpers.py), as CPU timings on a shared 2-core machine swing by up to two orders of magnitude;
uploads take the Hub's LFS path (the test Hub cannot store Xet chunks: tests/hubserver.py says why; its Xet token
route is tested in tests/test_hub.py); and the upgrade is
the stand-in SDK reinstalled at the new release, as `check-upgrades --apply` leaves a host (that install itself is
tests/test_upgrades.py's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.artifact import signing

from . import e4b_checkpoint, fake_sdk
from .helpers import STAND_IN_REGRESSION, stand_in_floors
from .hubserver import Hub
from .test_dvc import checkout_copy, ran
from .test_upgrades import neuron_index

pytestmark = pytest.mark.slow  # minutes: `make test-rehearsal` and `make test-slow` (`.ci/run`) run it

REPO = Path(__file__).resolve().parent.parent
REPO_ID = "tester/gemma-4-E4B-it-inferentia2"
VARIANTS = ["512_bf16", "256_bf16_host"]  # one of each layout: ModelBuilder's model.pt, per-rank tp_N.pt
UPGRADE = ("2.28.1", "2.29.0")


def edit_yaml(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))


def release_repository(checkpoint: Path, private_key: str):
    """The conf/ a team commits for a release: the real model from a local copy, signing on, the Hub target."""
    def edit(dst: Path) -> None:
        def model(m):
            m["path"] = str(checkpoint)
            m["resources"]["neuron"] = {"trace_base_gb": 2, "trace_per_graph_gb": 2, "validate_gb": 2,
                                        "host_prefill_gb": 0.2, "disk_gb": 1}

        def package(p):
            p["signing"].update(private_key=private_key, allow_unsigned=False)

        def publish(p):
            p.update(repo_id=REPO_ID, retry_base_s=0.01, retry_max_s=0.02)
            p["regression"].update(STAND_IN_REGRESSION)

        def validate(v):
            v.update(prompt_names=["capital", "spans_64"], warmup_prompts=0)
            v["throughput"].update(runs=1, warmup_runs=0, contexts=["short"], decode_tokens=8)
            stand_in_floors(v)  # gated still (the check below), at a floor this machine's CPU meets

        edit_yaml(dst / "conf" / "model" / "gemma4_e4b.yaml", model)
        edit_yaml(dst / "conf" / "package" / "default.yaml", package)
        edit_yaml(dst / "conf" / "publish" / "hub.yaml", publish)
        edit_yaml(dst / "conf" / "validate" / "default.yaml", validate)
        edit_yaml(dst / "conf" / "backend" / "neuron.yaml", lambda b: b.update(allow_unsupported_host_prefill=True))
    return edit


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("keys")
    subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(d / "release")],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "ec", "-in", str(d / "release"), "-pubout", "-out", str(d / "release.pub")],
                   check=True, capture_output=True)
    return str(d / "release"), str(d / "release.pub")


@pytest.fixture(scope="module")
def hub():
    server = Hub().start()
    yield server
    server.stop()


class Host:
    """The inf2 host the scheduled job runs on: its checkout, its Neuron install, its tools, its environment."""

    def __init__(self, root: Path, checkout: Path, hub: Hub):
        self.root, self.checkout, self.hub = root, checkout, hub
        self.site = root / "neuron-sdk"
        self.bin = Path(sys.executable).parent  # the environment's python and dvc, as an activated .venv gives them

    def install_sdk(self, release: str) -> None:
        fake_sdk.install(self.site, release)

    def rebuild(self, offered: list[str]) -> subprocess.CompletedProcess:
        index = neuron_index(self.root / f"index-{'-'.join(offered)}", offered)
        sdk = fake_sdk.env(self.site)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "HF_", "TRANSFORMERS_OFFLINE"))},
               **sdk,
               "PATH": os.pathsep.join([str(self.bin), str(self.site / "bin"), os.environ["PATH"]]),
               "REPO_DIR": str(self.checkout), "CHECK_ARGS": f"--neuron-index {index}",
               "PIP_CONFIG_FILE": os.devnull, "HF_ENDPOINT": self.hub.url, "HF_TOKEN": self.hub.token,
               "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(self.root / "hf_home")}
        return subprocess.run(["sh", str(self.checkout / "deploy" / "rebuild.sh")], env=env, capture_output=True,
                              text=True, timeout=3000)


def published(hub: Hub) -> dict[str, str]:
    return dict(hub.repos[REPO_ID].tags)


def manifest_at(hub: Hub, tag: str) -> tuple[dict, dict[str, bytes]]:
    files = hub.repos[REPO_ID].resolve(tag).files
    folder = next(v for v in VARIANTS if tag.startswith(v + "-"))
    return json.loads(files[f"{folder}/manifest.json"]), {p: b for p, b in files.items() if p.startswith(folder)}


def pull(host: Host, version: str, public_key: str, dest: Path) -> subprocess.CompletedProcess:
    """``pull`` on the inf2 host itself, with its Neuron install: it takes only a version that fits it."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
           **fake_sdk.env(host.site), "HF_ENDPOINT": host.hub.url, "HF_TOKEN": host.hub.token,
           "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(host.root / "hf_pull")}
    return subprocess.run([sys.executable, "-m", "pipeline", "pull", REPO_ID, version, "--dest", str(dest),
                           "--public-key", public_key], capture_output=True, text=True, env=env, timeout=600)


def check_gates_and_signatures(host: Host, tags: list[str], public_key: str, tmp: Path) -> None:
    for tag in tags:
        manifest, files = manifest_at(host.hub, tag)
        assert manifest["version"] == tag and manifest["backend"] == "neuron"
        assert manifest["model"]["hub_id"] == "google/gemma-4-E4B-it" and manifest["signature"]
        validation = manifest["validation"]
        assert validation["gates"] == {"parity": True, "throughput": True, "passed": True}
        assert validation["hardware"] == "inf2_8xlarge" and validation["throughput_floor"]  # gated, not "not gated"
        assert validation["parity"]["passed"]
        folder = tag.split("-")[0]
        assert f"{folder}/{signing.SIGNATURE}" in files
        got = pull(host, tag, public_key, tmp / "pulled")
        assert got.returncode == 0, got.stderr[-3000:]
        expected = {"model.pt"} if manifest["layout"] == "nxd_model" else {"tp_0.pt", "tp_1.pt"}
        assert {p.name for p in Path(got.stdout.strip()).iterdir()} == expected


def test_the_scheduled_rebuild_of_the_real_model_on_neuron_to_the_hub(tmp_path, tiny_dir, keys, hub):
    private, public = keys
    checkpoint = e4b_checkpoint.write(tiny_dir, tmp_path / "gemma-4-E4B-it")
    checkout = checkout_copy(tmp_path / "release", VARIANTS, release_repository(checkpoint, private),
                             model="gemma4_e4b", backend="neuron", publish="hub", hardware="inf2_8xlarge")
    (checkout / "deploy").mkdir()
    (checkout / "deploy" / "rebuild.sh").write_bytes((REPO / "deploy" / "rebuild.sh").read_bytes())
    remote = tmp_path / "dvc-remote"
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "-d", "store", str(remote)], cwd=checkout,
                   check=True, capture_output=True)
    host = Host(tmp_path, checkout, hub)
    host.install_sdk(UPGRADE[0])

    first = host.rebuild([UPGRADE[0]])
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    tags = published(hub)
    assert sorted(t.rsplit("-", 1)[0] for t in tags) == sorted(f"{v}-ncc2.23.6484.0" for v in VARIANTS)
    commits = list(hub.repos[REPO_ID].commits.values())
    publishing = sorted(c.message for c in commits if c.message.startswith("Publish"))
    assert publishing == sorted(f"Publish {t}" for t in tags)  # one commit per version
    assert len(set(tags.values())) == len(tags)  # and one tag on each
    check_gates_and_signatures(host, list(tags), public, tmp_path / "first")
    card = hub.repos[REPO_ID].resolve("main").files["README.md"].decode()
    assert "base_model: google/gemma-4-E4B-it" in card and all(f"`{t}`" in card for t in tags)
    assert any(remote.rglob("*")), "dvc push stored nothing in the remote"

    again = host.rebuild([UPGRADE[0]])
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert published(hub) == tags and len(hub.repos[REPO_ID].commits) == len(commits)
    assert ran(again.stdout + again.stderr) == ["toolchain"]

    host.install_sdk(UPGRADE[1])  # the new release, as check-upgrades --apply leaves it (tests/test_upgrades.py)
    upgraded = host.rebuild(list(UPGRADE))
    assert upgraded.returncode == 0, upgraded.stdout[-4000:] + upgraded.stderr[-4000:]
    # The new compiler re-runs trace to publish of every variant, and nothing else (the checkpoint and the float
    # reference stay as they are).
    assert set(ran(upgraded.stdout + upgraded.stderr)) == {"toolchain"} | {
        f"{stage}@{v}" for v in VARIANTS for stage in ("trace", "package", "validate", "publish")}
    now = published(hub)
    new = sorted(set(now) - set(tags))
    assert {t: now[t] for t in tags} == tags  # old versions never move
    assert sorted(t.rsplit("-", 1)[0] for t in new) == sorted(f"{v}-ncc2.24.5133.0" for v in VARIANTS)
    check_gates_and_signatures(host, new, public, tmp_path / "upgraded")
    for tag in new:
        manifest, _ = manifest_at(hub, tag)
        replaced = next(t for t in tags if t.split("-")[0] == tag.split("-")[0])
        assert manifest["regression"]["against"] == replaced and manifest["regression"]["passed"]
    card = hub.repos[REPO_ID].resolve("main").files["README.md"].decode()
    assert all(f"`{t}`" in card for t in now)
