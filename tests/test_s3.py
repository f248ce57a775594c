"""The DVC remote on an S3 endpoint (moto's server, as strict about credentials as S3: tests/s3_endpoint.py).

The scheduled rebuild's set-up with an S3 remote (docs/rebuilds.md) runs as written: a first host pulls what exists
(nothing), builds, pushes; a second host pulls every output byte-identical and rebuilds only the toolchain stage. A
push killed midway completes when run again. A bucket that does not exist, or credentials it refuses, stop the
rebuild before any build work, naming the remote and the fix, with nothing written to the remote or to
``artifacts/``. The credentials come from the usual AWS variables and appear in no output, verbose or not.

Needs the ``[cluster-tests]`` extra (moto's server and ``[s3]``), which ``make test-cluster`` installs first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.fsutil import sha256_file

from . import fake_sdk
from .s3_endpoint import BUCKET, Endpoint, SlowProxy, moto_server
from .test_dvc import checkout_copy, quicker_validation, ran
from .test_upgrades import neuron_index

pytestmark = pytest.mark.cluster
if moto_server() is None:
    pytestmark = [pytest.mark.cluster,
                  pytest.mark.skip(reason="moto[server] is not installed: make test-cluster installs it")]

REPO = Path(__file__).resolve().parent.parent
VARIANT = "512_fp32"
RELEASE = "2.28.1"
PREFIX = "dvc"


@pytest.fixture(scope="module")
def s3():
    endpoint = Endpoint().start()
    yield endpoint
    endpoint.stop()


class Host:
    """A host of the scheduled rebuild: its checkout (a clone of the release repository), its Neuron install (the
    stand-in, one release, so check-upgrades says up to date), its AWS credentials."""

    def __init__(self, root: Path, checkout: Path, s3: Endpoint):
        self.root, self.checkout, self.s3 = root, checkout, s3
        self.site = root / "neuron-sdk"
        fake_sdk.install(self.site, RELEASE)
        self.index = neuron_index(root / "index", [RELEASE])

    def env(self, **changes: str) -> dict[str, str]:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "AWS_"))},
               **fake_sdk.env(self.site), **self.s3.env(), "PIP_CONFIG_FILE": os.devnull,
               "REPO_DIR": str(self.checkout), "CHECK_ARGS": f"--neuron-index {self.index}",
               "HOME": str(self.root)}  # no ~/.aws of this machine's user
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
        return {**env, **changes}

    def rebuild(self, **changes: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", str(self.checkout / "deploy" / "rebuild.sh")], env=self.env(**changes),
                              capture_output=True, text=True, timeout=1800)

    def run(self, *argv: str, **changes: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), cwd=self.checkout, env=self.env(**changes), capture_output=True, text=True,
                              timeout=600)

    def dvc(self, *args: str, **changes: str) -> str:
        done = self.run(sys.executable, "-m", "dvc", *args, **changes)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout + done.stderr

    def outputs(self) -> dict[str, str]:
        """Every file DVC tracks in this checkout, by path, with its SHA-256."""
        listed = self.dvc("ls", "--dvc-only", "-R", ".").split()
        return {rel: sha256_file(self.checkout / rel) for rel in listed}


def release_repository(root: Path, s3: Endpoint) -> Path:
    """The release repository as docs/rebuilds.md sets it up: an S3 remote (here with the test endpoint), the
    rebuild script, committed; no credentials in it."""
    checkout = checkout_copy(root / "release", [VARIANT], quicker_validation)
    (checkout / "deploy").mkdir()
    (checkout / "deploy" / "rebuild.sh").write_bytes((REPO / "deploy" / "rebuild.sh").read_bytes())
    for args in (["remote", "add", "-d", "store", f"s3://{BUCKET}/{PREFIX}"],
                 ["remote", "modify", "store", "endpointurl", s3.url]):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=checkout, check=True, capture_output=True)
    for args in (["add", "-A"], ["commit", "-q", "-m", "the S3 remote and the rebuild script"]):
        subprocess.run(["git", *args], cwd=checkout, check=True, capture_output=True)
    return checkout


def clone(source: Path, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(source), str(dest)], check=True, capture_output=True)
    return dest


def commit_lock(checkout: Path) -> None:
    """What the workflow does after a rebuild: commit the changed dvc.lock (docs/rebuilds.md)."""
    for args in (["add", "dvc.lock"], ["commit", "-q", "-m", "rebuild"]):
        subprocess.run(["git", *args], cwd=checkout, check=True, capture_output=True)


def assert_no_credentials(s3: Endpoint, *texts: str) -> None:
    for text in texts:
        assert s3.secret not in text and s3.key_id not in text


@pytest.fixture(scope="module")
def first_host(tmp_path_factory, s3) -> tuple[Host, subprocess.CompletedProcess]:
    """The first scheduled rebuild: nothing on the remote yet; it builds and pushes."""
    root = tmp_path_factory.mktemp("host1")
    host = Host(root, release_repository(root, s3), s3)
    done = host.rebuild()
    commit_lock(host.checkout)
    return host, done


def test_the_scheduled_rebuild_pushes_and_a_second_host_pulls_every_output_byte_identical(first_host, s3, tmp_path):
    host, first = first_host
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "readable and writable from here" in first.stderr
    assert {"toolchain", "model", "reference", f"trace@{VARIANT}", f"publish@{VARIANT}"} <= set(ran(first.stderr +
                                                                                                    first.stdout))
    built = host.outputs()
    assert any(rel.endswith("tp_0.pt") for rel in built) and any(rel.endswith(".zst") for rel in built)
    stored = s3.keys(prefix=PREFIX + "/")
    assert stored and not any(".pipeline-check-remote-" in key for key in stored)  # the probe was removed

    second = Host(tmp_path, clone(host.checkout, tmp_path / "host2"), s3)
    again = second.rebuild()
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    # Every record came from S3 with its outputs, so nothing is traced, validated or published again; the checkpoint
    # is not cached (dvc.yaml: re-downloadable), so the model stage fetches it.
    assert ran(again.stdout + again.stderr) == ["toolchain", "model"], again.stdout[-3000:]
    assert second.outputs() == built
    assert_no_credentials(s3, first.stdout, first.stderr, again.stdout, again.stderr,
                          (host.checkout / ".dvc" / "config").read_text())


def test_a_push_killed_midway_completes_when_run_again(first_host, s3, tmp_path):
    """``dvc push -j 1`` through a proxy that holds each upload, killed once some objects are stored, then run
    again; a fresh clone pulls every output from what the two pushes stored."""
    host, first = first_host
    assert first.returncode == 0, first.stderr[-3000:]
    proxy = SlowProxy(s3.port, put_delay_s=0.5)
    prefix = "interrupted"
    try:
        host.dvc("remote", "add", "--local", "slow", f"s3://{BUCKET}/{prefix}")
        host.dvc("remote", "modify", "--local", "slow", "endpointurl", proxy.url)
        expected = len(host.dvc("status", "-c", "-r", "slow").splitlines())
        push = subprocess.Popen([sys.executable, "-m", "dvc", "push", "-v", "-j", "1", "-r", "slow"],
                                cwd=host.checkout, env=host.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        deadline = time.monotonic() + 300
        while not s3.keys(prefix=prefix + "/") and time.monotonic() < deadline:
            time.sleep(0.1)
        os.killpg(push.pid, signal.SIGKILL)  # the host goes away mid-upload
        killed_output = push.communicate(timeout=60)[0]
        stored_at_kill = s3.keys(prefix=prefix + "/")
        total = len(host.outputs())
        assert 0 < len(stored_at_kill) < total, (stored_at_kill, total, expected)

        proxy.put_delay_s = 0
        finished = host.dvc("push", "-v", "-r", "slow")
        assert len(s3.keys(prefix=prefix + "/")) > len(stored_at_kill)
        fresh = Host(tmp_path, clone(host.checkout, tmp_path / "fresh"), s3)
        fresh.dvc("remote", "add", "--local", "slow", f"s3://{BUCKET}/{prefix}")
        fresh.dvc("remote", "modify", "--local", "slow", "endpointurl", s3.url)
        fresh.dvc("pull", "-r", "slow")
        assert fresh.outputs() == host.outputs()
        assert_no_credentials(s3, killed_output, finished)
    finally:
        proxy.stop()


@pytest.mark.parametrize("problem", ["no bucket", "unknown key id", "wrong secret", "no remote"])
def test_a_remote_that_cannot_be_used_stops_the_rebuild_before_any_build_work(first_host, s3, tmp_path, problem):
    host, _ = first_host
    before_keys, before_buckets = s3.keys(), s3.buckets()
    checkout = clone(host.checkout, tmp_path / "host")
    bad = Host(tmp_path, checkout, s3)
    changes: dict[str, str] = {}
    if problem == "no bucket":
        bad.dvc("remote", "modify", "--local", "store", "url", "s3://gemma4-no-such-bucket/dvc")
        expected = ["DVC remote 'store' (s3://gemma4-no-such-bucket/dvc): The specified bucket does not exist",
                    "dvc remote modify store url s3://BUCKET/PATH"]
    elif problem == "unknown key id":
        changes = {"AWS_ACCESS_KEY_ID": "AKIAUNKNOWNUNKNOWN00"}
        expected = ["refused this host's credentials", "does not exist in our records", "AWS_ACCESS_KEY_ID"]
    elif problem == "wrong secret":
        changes = {"AWS_SECRET_ACCESS_KEY": "not-the-secret-" + "x" * 20}
        expected = ["refused this host's credentials", "signature we calculated does not match"]
    else:
        bad.dvc("remote", "default", "--unset")
        bad.dvc("remote", "remove", "store")
        expected = ["DVC remote (default)", "dvc remote add -d NAME s3://BUCKET/PATH", "SKIP_DVC_REMOTE=1"]
    done = bad.rebuild(**changes)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    for words in expected:
        assert words in done.stderr, done.stderr[-3000:]
    assert "Running stage" not in done.stdout + done.stderr and not (checkout / "artifacts").exists()
    assert s3.keys() == before_keys and s3.buckets() == before_buckets  # nothing written, no bucket made
    assert_no_credentials(s3, done.stdout, done.stderr)
    assert changes.get("AWS_SECRET_ACCESS_KEY", "(none)") not in done.stdout + done.stderr
