"""The two images of deploy/Containerfile, built and run on this machine (``make test-container``, marked
``container``; needs root, podman, buildah and debootstrap: ``make container-packages``).

No registry is reachable here, so the base image is made from Debian's own packages: ``debootstrap`` a bookworm with
python3, python3-venv and git, then ``podman import`` it. Both images are built from it by deploy/container-images.sh
(``--target build``, ``--target serve``, with the torch wheel on this disk mounted for the build), the script
``make container-images`` runs.

What runs, and how: an OCI runtime cannot start a container on these machines (``podman run`` stops in the runtime:
crun says ``setrlimit `RLIMIT_NOFILE`: Operation not permitted``, runc ``error setting rlimit type 7: operation not
permitted``: the sandbox refuses to set another process's limits), so images are built with ``--isolation chroot``
and their commands run with ``buildah run --isolation chroot``: the image's file system, user and working directory,
on this machine's network (its loopback). The build image runs one variant of ``make demo`` end to end; the server
image serves it to the official ``openai`` client, and the image's own health check command is run against it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.container

REPO = Path(__file__).resolve().parent.parent
BASE = "localhost/gemma4-debian:bookworm"
FAST = ["validate.prompt_names=[capital,spans_64]", "validate.throughput.contexts=[short]",
        "validate.throughput.runs=1", "validate.throughput.warmup_runs=0", "validate.warmup_prompts=0"]


def tools_missing() -> list[str]:
    return [t for t in ("podman", "buildah", "debootstrap") if shutil.which(t) is None]


if os.environ.get("REQUIRE_CONTAINERS") and (tools_missing() or os.geteuid() != 0):
    raise RuntimeError(f"make test-container needs root and {tools_missing()}: make container-packages")
if tools_missing() or os.geteuid() != 0:
    pytest.skip(f"containers need root and podman, buildah, debootstrap ({tools_missing()} missing)",
                allow_module_level=True)


def run(*args: str, timeout: float = 1800, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args[:4])} ... exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def base_image() -> str:
    """Debian bookworm with python3, python3-venv and git, from Debian's packages (deploy/container-base.sh, which
    .ci/run may have run already, in the background: then it is kept)."""
    run(str(REPO / "deploy" / "container-base.sh"), BASE)
    return BASE


@pytest.fixture(scope="session")
def images(base_image) -> dict[str, str]:
    """Both images, built by deploy/container-images.sh (which .ci/run may have run already, in the background: then
    podman's layer cache makes this a lookup)."""
    built = run(str(REPO / "deploy" / "container-images.sh"), base_image, "test").stdout.split()
    return dict(zip(built[::2], built[1::2]))


def inspect(name: str) -> dict:
    return json.loads(run("podman", "image", "inspect", name).stdout)[0]


class Working:
    """A working container of an image (``buildah from``): its commands run in the image's file system, as its user,
    in its working directory, with ``volumes`` mounted."""

    def __init__(self, image: str, volumes: dict[Path, str]):
        self.image, self.volumes = image, volumes
        self.name = run("buildah", "from", "--pull-never", image).stdout.strip().splitlines()[-1]
        config = inspect(image)["Config"]
        self.user, self.workdir = config.get("User", "root"), config.get("WorkingDir", "/")
        self.entrypoint = config.get("Entrypoint") or []

    def argv(self, command: list[str]) -> list[str]:
        mounts = [arg for host, inside in self.volumes.items() for arg in ("-v", f"{host}:{inside}")]
        return ["buildah", "run", "--isolation", "chroot", "--user", self.user, "--workingdir", self.workdir, *mounts,
                self.name, "--", *command]

    def run(self, command: list[str], timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess:
        return run(*self.argv(command), timeout=timeout, check=check)

    def remove(self) -> None:
        run("buildah", "rm", self.name, check=False)


@pytest.fixture(scope="module")
def work(images, tmp_path_factory) -> Path:
    """One variant of make demo, built, validated and published by the build image into a mounted /work."""
    work = tmp_path_factory.mktemp("work")
    work.chmod(0o777)  # the image's user (uid 1000) writes there
    build = Working(images["build"], {work: "/work"})
    try:
        done = build.run([*build.entrypoint, "+variant=512_fp32", "backend=cpu", *FAST])
    finally:
        build.remove()
    assert "passed every gate" in done.stdout + done.stderr
    return work


def test_the_images_hold_no_checkout_path_no_token_no_cache_and_run_as_a_user(images):
    for name in images.values():
        config = inspect(name)["Config"]
        assert config["User"] == "pipeline"
        assert not [e for e in config.get("Env", []) if "TOKEN" in e.split("=")[0] or "SECRET" in e.split("=")[0]]
        mounted = run("buildah", "from", "--pull-never", name).stdout.strip().splitlines()[-1]
        try:
            root = Path(run("buildah", "mount", mounted).stdout.strip())
            found = run("grep", "-rlF", str(REPO), str(root / "opt" / "pipeline"), check=False)
            assert found.returncode == 1, f"{name} holds this checkout's path in {found.stdout.splitlines()[:5]}"
            for cache in (root / "root" / ".cache", root / "home" / "pipeline" / ".cache"):
                assert not cache.exists(), f"{name} keeps {cache.relative_to(root)}"
        finally:
            run("buildah", "umount", mounted, check=False)
            run("buildah", "rm", mounted, check=False)
    check = inspect(images["serve"])["Healthcheck"]["Test"]  # podman shows it beside Config, not in it
    assert "http://127.0.0.1:8000/health" in " ".join(check)


def test_the_build_image_builds_validates_and_publishes_a_variant(work):
    variant = work / "artifacts" / "gemma4_tiny" / "512_fp32"
    assert sorted(p.name for p in (variant / "build").iterdir()) == ["tp_0.pt", "tp_1.pt"]
    assert json.loads((variant / "metrics.json").read_text())["parity"]["passed"] is True
    assert (variant / "publish.json").is_file() and (work / "artifacts" / "published" / ".git").is_dir()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_image_serves_the_build_to_the_openai_client(images, work):
    from openai import OpenAI

    port = free_port()
    serve = Working(images["serve"], {work: "/work"})
    command = [*serve.entrypoint, "--port", str(port), "/work/artifacts/published", "512_fp32", "--checkpoint",
               "/work/artifacts/gemma4_tiny/weights", "--dest", "/work/versions", "--allow-unsigned"]
    server = subprocess.Popen(serve.argv(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=8,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
        # The image's own health check, run in the image (its port replaced by this server's).
        check = [a.replace(":8000/", f":{port}/") for a in inspect(images["serve"])["Healthcheck"]["Test"]]
        assert check[0] == "CMD"
        assert serve.run(check[1:], timeout=60, check=False).returncode == 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        serve.remove()
