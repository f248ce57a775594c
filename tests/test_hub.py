"""Publishing to (and pulling from) a Hugging Face Hub: the real huggingface_hub client against a Hub-compatible
server on 127.0.0.1 (tests/hubserver.py). Uploads that succeed take the LFS path (Xet disabled: the server has no Xet
CAS); the Xet token route's failures are tested with Xet enabled, the path production takes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.artifact.manifest import Manifest
from pipeline.core.errors import PublishError
from pipeline.core.fsutil import atomic_write_json, read_json, sha256_file
from pipeline.paths import Paths

from .helpers import CPU_COMPILER, FAST_VALIDATE, a_manifest, config, run
from .hubserver import Hub

# Every version environment runs these (the mark names no distribution: they depend on many).
pytestmark = pytest.mark.across_versions

REPO_ID = "tester/gemma4-tiny-inferentia2"


def version_of(root: Path, variant: str = "512_fp32") -> str:
    """The version the package stage named for ``variant`` under ``root`` (it names the build's inputs)."""
    return read_json(Paths(root, "gemma4_tiny", variant).manifest)["version"]


@pytest.fixture
def hub():
    """A Hub of its own per test: what one test publishes is never what another finds (each passes alone, in any
    subset and in any order: `pytest --reverse`)."""
    server = Hub().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def hub_env(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the rest of the suite forbids the network
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # likewise: the server has no Xet
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no login cache, no shared download cache
    import huggingface_hub.utils._http as http

    monkeypatch.setattr(http.time, "sleep", lambda s: None)  # the client's own backoff, instant in tests
    # hf_xet's own retries (5 over about 5 minutes by default), read from the environment by its session: 2, at once.
    monkeypatch.setenv("HF_XET_CLIENT_RETRY_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("HF_XET_CLIENT_RETRY_BASE_DELAY", "10ms")
    hub.faults.__init__()


@pytest.fixture(scope="module")
def project(tmp_path_factory, validated_512_fp32) -> Path:
    """Two validated variants of the tiny model (not yet on any Hub): a copy of the shared 512_fp32 build, and
    256_bf16_host built beside it (every stage; publish goes to the local folder)."""
    root = tmp_path_factory.mktemp("hub") / "artifacts"
    shutil.copytree(validated_512_fp32, root, ignore=shutil.ignore_patterns("logs", ".locks"))
    run(config(root, *FAST_VALIDATE, variant="256_bf16_host"))
    return root


def hub_cfg(root: Path, variant: str = "512_fp32", *extra: str, allow_demo: bool = True, repo_id: str = REPO_ID):
    """Publishing the tiny model's cpu builds to the test Hub: demo builds, allowed (unless asked otherwise)."""
    return config(root, *FAST_VALIDATE, "publish=hub", f"publish.repo_id={repo_id}", "publish.retry_base_s=0.01",
                  "publish.retry_max_s=0.02", f"publish.allow_demo={str(allow_demo).lower()}", *extra,
                  variant=variant)


def ensure_published(project: Path, variant: str = "512_fp32") -> str:
    """``variant``'s version on the test Hub (publishing it unless an earlier test did: a no-op then), so that each
    test passes alone or in any subset; returns the version."""
    run(hub_cfg(project, variant), "publish")
    return version_of(project, variant)


def snapshot(root: Path) -> dict[str, str]:
    """What a stage built (not its logs, receipt or locks: a lock file is made by the first run that takes it, which
    is whichever test the workers run first)."""
    return {str(p.relative_to(root)): sha256_file(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not {"logs", ".locks"} & set(p.parts) and p.name != "publish.json"}


def files_at(hub: Hub, revision: str) -> dict[str, bytes]:
    return hub.repos[REPO_ID].resolve(revision).files


def test_first_publish_is_one_commit_and_one_tag(hub, project):
    VERSION = version_of(project)
    cfg = hub_cfg(project)
    run(cfg, "publish")
    repo = hub.repos[REPO_ID]
    assert repo.private is True
    assert list(repo.tags) == [VERSION] and repo.tags[VERSION] == repo.main
    files = files_at(hub, VERSION)
    manifest = json.loads(files["512_fp32/manifest.json"])
    archive = f"512_fp32/{manifest['archive']['name']}"
    assert sorted(files) == sorted([".gitattributes", "README.md", "versions.json", archive, "512_fp32/manifest.json",
                                    "512_fp32/metrics.json"])
    assert manifest["validation"]["gates"]["passed"] is True
    assert [row["version"] for row in json.loads(files["versions.json"])["versions"]] == [VERSION]
    assert ("PUT", f"/lfs-upload/{manifest['archive']['sha256']}") in hub.calls  # the large-file path
    card = files["README.md"].decode()
    assert card.startswith("---\nlicense: apache-2.0\n") and VERSION in card
    assert "base_model" not in card  # the tiny model's builds claim no base model (test_a_demo_build...)
    receipt = read_json(Paths.of(cfg).receipt)
    assert receipt == {"target": "hub", "repo": REPO_ID, "version": VERSION, "tag": VERSION, "commit": repo.main,
                       "fingerprint": manifest["fingerprint"], "archive_sha256": manifest["archive"]["sha256"]}


def test_publishing_again_makes_no_commit_and_no_tag(hub, project):
    ensure_published(project)
    repo = hub.repos[REPO_ID]
    commits, tags, calls = len(repo.commits), dict(repo.tags), len(hub.calls)
    run(hub_cfg(project), "publish")
    assert len(repo.commits) == commits and repo.tags == tags
    assert not [c for c in hub.calls[calls:] if c[0] != "GET" and c[0] != "HEAD" and "create" not in c[1]]


def test_republishing_over_a_corrupt_published_archive_repairs_it_on_the_hub(hub, project):
    """Someone with write access replaced the published archive's bytes (the manifest unchanged) and moved the tag:
    publishing again verifies the archive against the Hub's record of its object (the tree listing's LFS sha256), so
    it is no "already published", and restores it in one commit that the tag moves to."""
    version = ensure_published(project)
    repo = hub.repos[REPO_ID]
    files = dict(files_at(hub, version))
    archive = next(p for p in files if p.endswith(".tar.zst"))
    damaged = bytearray(files[archive])
    damaged[len(damaged) // 2] ^= 0xFF
    repo.commit({**files, archive: bytes(damaged)}, "corrupt")
    repo.tags[version] = repo.main
    commits = len(repo.commits)
    result = [r for r in run(hub_cfg(project, "512_fp32", "force=true"), "publish") if r.stage == "publish"][0]
    assert result.details["repaired"] and len(repo.commits) == commits + 1
    assert repo.tags[version] == repo.main
    manifest = json.loads(files_at(hub, version)["512_fp32/manifest.json"])
    assert hashlib.sha256(files_at(hub, version)[archive]).hexdigest() == manifest["archive"]["sha256"]
    again = [r for r in run(hub_cfg(project), "publish") if r.stage == "publish"][0]
    assert not again.details["repaired"] and not again.details["created"] and len(repo.commits) == commits + 1


def test_a_second_variant_lands_beside_the_first_and_the_card_lists_both(hub, project):
    ensure_published(project)
    VERSION = version_of(project)
    hub.faults.conflicts = 2  # two 412s: someone else committed meanwhile
    before = len(hub.repos[REPO_ID].commits)
    run(hub_cfg(project, "256_bf16_host"), "publish")
    repo = hub.repos[REPO_ID]
    assert len(repo.commits) == before + 1  # retried after the conflicts, committed once
    other = version_of(project, "256_bf16_host")
    assert other.startswith(f"256_bf16_host-{CPU_COMPILER}-") and sorted(repo.tags) == sorted([other, VERSION])
    card = files_at(hub, "main")["README.md"].decode()
    assert f"`{other}`" in card and f"`{VERSION}`" in card
    assert "512_fp32/manifest.json" in files_at(hub, "main")


def test_a_failed_upload_then_a_rerun_makes_exactly_one_commit(hub, project, tmp_path):
    ensure_published(project)
    root = tmp_path / "artifacts"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("logs"))
    cfg = hub_cfg(root, "512_fp32", "package.format=tar", "publish.retries=2")
    run(cfg, "package")  # another archive format: another version of the variant
    run(cfg, "validate")
    VERSION = version_of(root)
    assert VERSION != version_of(project)
    before, local = len(hub.repos[REPO_ID].commits), snapshot(root)
    hub.faults.drop_uploads = 100  # every upload breaks mid-body, past the client's and our retries
    with pytest.raises(PublishError, match=r"failed after 2 attempt\(s\) .*retry later: publishing is idempotent"):
        run(cfg, "publish")
    assert len(hub.repos[REPO_ID].commits) == before and snapshot(root) == local
    hub.faults.drop_uploads = 1  # one more broken upload: the client's own retry gets past it
    run(cfg, "publish")
    repo = hub.repos[REPO_ID]
    assert len(repo.commits) == before + 1
    files = files_at(hub, VERSION)
    assert json.loads(files["512_fp32/manifest.json"])["archive"]["format"] == "tar"
    assert not [p for p in files if p.startswith("512_fp32/") and p.endswith(".tar.zst")]  # the old archive left


def test_a_lost_commit_response_is_retried_without_a_duplicate_commit(hub, project, tmp_path):
    ensure_published(project)
    root = tmp_path / "artifacts"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("logs"))
    cfg = hub_cfg(root, "512_fp32", "package.format=tar.gz")
    run(cfg, "package")
    run(cfg, "validate")
    VERSION = version_of(root)
    before = len(hub.repos[REPO_ID].commits)
    hub.faults.commit_lost = 1  # the commit lands, its answer is a 500
    run(cfg, "publish")
    repo = hub.repos[REPO_ID]
    assert len(repo.commits) == before + 1 and repo.tags[VERSION] == repo.main


def test_other_bytes_under_a_published_version_are_refused_and_the_version_never_moves(hub, project, tmp_path,
                                                                                       monkeypatch):
    """A build that does not reproduce (simulated: another archive named as the published version) is refused;
    there is no way to move a published version."""
    ensure_published(project)
    from pipeline.stages import package as package_stage

    VERSION = version_of(project)
    root = tmp_path / "artifacts"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("logs"))
    cfg = hub_cfg(root, "512_fp32", "package.format=tar.gz")
    monkeypatch.setattr(package_stage, "version_name", lambda *inputs: VERSION)
    run(cfg, "package")
    run(cfg, "validate")
    tags, commits = dict(hub.repos[REPO_ID].tags), len(hub.repos[REPO_ID].commits)
    local = snapshot(root)
    with pytest.raises(PublishError, match=f"version {VERSION} is already published .* from another build .*"
                                           "A published version is never replaced; nothing was published"):
        run(cfg, "publish")
    assert len(hub.repos[REPO_ID].commits) == commits and hub.repos[REPO_ID].tags == tags
    assert snapshot(root) == local


def test_an_unvalidated_artifact_is_refused_before_any_request(hub, project, tmp_path):
    root = tmp_path / "artifacts"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("logs"))
    cfg = hub_cfg(root)
    report = read_json(Paths.of(cfg).validation_report)
    report["gates"] = {"parity": False, "throughput": True, "passed": False}
    atomic_write_json(Paths.of(cfg).validation_report, report)
    calls = len(hub.calls)
    with pytest.raises(PublishError, match="did not pass validation \\(parity gate failed\\)"):
        run(cfg, "publish")
    assert len(hub.calls) == calls


def test_a_missing_token_is_named_before_any_request(hub, project, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    calls = len(hub.calls)
    with pytest.raises(PublishError, match="no Hugging Face token: set HF_TOKEN .* or run `hf auth login`"):
        run(hub_cfg(project), "publish")
    assert len(hub.calls) == calls


def test_a_wrong_token_is_a_clear_error(hub, project, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(PublishError, match=rf"failed after 1 attempt\(s\) \(HTTP 401.*the token cannot write to "
                                           rf"{REPO_ID}: use a token with write access") as err:
        run(hub_cfg(project), "publish")
    assert "hf_wrong" not in str(err.value)  # never echoed


def test_a_network_error_that_persists_past_the_retries_is_named(project, monkeypatch, tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    local = snapshot(project)
    with pytest.raises(PublishError, match=r"failed after 3 attempt\(s\) \(ConnectError.*retry later"):
        run(hub_cfg(project, "512_fp32", "publish.retries=3"), "publish")
    assert snapshot(project) == local


def test_pull_a_tag_back_from_the_hub_into_a_verified_directory(hub, project, tmp_path):
    ensure_published(project, "256_bf16_host")
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "h"),
           "PATH": "/usr/bin:/bin"}
    version = version_of(project, "256_bf16_host")
    proc = subprocess.run([sys.executable, "-m", "pipeline", "pull", REPO_ID, version, "--dest", str(tmp_path / "w"),
                           "--allow-unsigned"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert sorted(p.name for p in path.iterdir()) == ["tp_0.pt", "tp_1.pt"]
    manifest = json.loads(files_at(hub, version)["256_bf16_host/manifest.json"])
    assert [sha256_file(path / m["path"]) for m in manifest["members"]] == [m["sha256"] for m in manifest["members"]]
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [".locks", path.name, path.name + ".manifest.json",
                                                                  path.name + ".pulled.json"]
    # The HTTP client's request lines only at debug level; the pull's own lines in the one format either way.
    assert "HTTP Request:" not in proc.stderr and f"INFO pipeline: pull: {version} (commit " in proc.stderr
    debug = subprocess.run([sys.executable, "-m", "pipeline", "pull", REPO_ID, version, "--dest", str(tmp_path / "w"),
                            "--allow-unsigned"], capture_output=True, text=True, timeout=300,
                           env={**env, "PIPELINE_LOG_LEVEL": "debug"})
    assert debug.returncode == 0, debug.stderr
    assert re.search(rf"INFO httpx2?: HTTP Request: GET {hub.url}/api/models/{REPO_ID}", debug.stderr), debug.stderr


def test_two_pulls_at_once_download_a_version_once_and_a_later_pull_downloads_nothing(hub, project, tmp_path):
    """Two processes pull one version into one cache at the same moment (both started while the version's lock is
    held, so both wait for it): the archive is downloaded once, and the second finds the first's; a third pull, and a
    pull --offline, download nothing. Counted at the test Hub."""
    from pipeline.host import locking

    ensure_published(project, "256_bf16_host")
    version = version_of(project, "256_bf16_host")
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "h"),
           "PATH": "/usr/bin:/bin"}
    dest = tmp_path / "cache"
    command = [sys.executable, "-m", "pipeline", "pull", REPO_ID, version, "--dest", str(dest), "--allow-unsigned"]
    calls = len(hub.calls)
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    with contextlib.ExitStack() as files, locking.held(dest, f"pull-{version}"):
        procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=files.enter_context(open(log, "w")),
                                  text=True, env=env) for log in logs]
        deadline = time.monotonic() + 120
        while not all(f"waiting for pull-{version}" in log.read_text() for log in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [log.read_text()
                                                                                          for log in logs]
            time.sleep(0.2)
    printed = [proc.communicate(timeout=300)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [log.read_text() for log in logs]
    assert printed[0] == printed[1] and Path(printed[0].strip()).is_dir()
    archive = json.loads(files_at(hub, version)["256_bf16_host/manifest.json"])["archive"]["name"]

    def downloads(since: int) -> list[str]:
        return [path for method, path in hub.calls[since:] if "/resolve/" in path and method == "GET"]

    assert len([path for path in downloads(calls) if path.endswith(archive)]) == 1, downloads(calls)
    assert sum("nothing downloaded" in log.read_text() for log in logs) == 1
    calls = len(hub.calls)
    third = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert third.returncode == 0 and third.stdout == printed[0], third.stderr
    offline = subprocess.run([*command, "--offline"], capture_output=True, text=True, env=env, timeout=300)
    assert offline.returncode == 0 and offline.stdout == printed[0], offline.stderr
    assert downloads(calls) == [] and "nothing downloaded" in third.stderr


def test_versions_lists_a_hub_repo_from_one_download_of_its_index(hub, project, tmp_path):
    ensure_published(project, "512_fp32")
    ensure_published(project, "256_bf16_host")
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "h"),
           "PATH": "/usr/bin:/bin"}
    calls = len(hub.calls)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "versions", REPO_ID, "--json"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    tags = hub.repos[REPO_ID].tags
    assert {row["version"]: row["commit"] for row in rows} == dict(tags) and len(rows) == 2
    assert all(row["fits_this_host"] == "compatible" for row in rows)  # cpu builds of this environment's torch
    downloads = [path for method, path in hub.calls[calls:] if "/resolve/" in path and method == "GET"]
    assert len(downloads) == 1 and downloads[0].endswith("/versions.json"), downloads  # no manifest per version


# -- what may go to the Hub --------------------------------------------------------------------------------------

def test_a_demo_build_goes_to_the_hub_only_when_allowed_and_its_card_says_what_it_is(hub, project):
    VERSION = version_of(project)
    demo_repo = "tester/demo-builds"  # a repository of its own: the other tests' repository holds edited builds
    refused = hub_cfg(project, allow_demo=False, repo_id=demo_repo)
    with pytest.raises(PublishError, match=r"embedded tiny test model, not a Hub checkpoint; it would be built by the "
                                           r"cpu backend.*publish.allow_demo=true"):
        run(refused, "publish")  # refused before the stage (pipeline/run.py check_publish_target)
    from pipeline.stages import publish

    manifest = Manifest.read(Paths.of(refused).manifest)
    with pytest.raises(PublishError, match=r"embedded tiny test model, not a Hub checkpoint; it was built by the cpu "
                                           r"backend.*publish.allow_demo=true.*Nothing was published"):
        publish.require_real_or_allowed(manifest, demo_repo, False)  # and by the stage itself, from the manifest
    assert demo_repo not in hub.repos  # refused before any request
    run(hub_cfg(project, repo_id=demo_repo), "publish")
    card = hub.repos[demo_repo].resolve(VERSION).files["README.md"].decode()
    assert "# Demo builds of gemma4_tiny (not a real model)" in card and "must not be served" in card
    assert "base_model" not in card and "google/gemma-4-E4B-it" not in card


def test_the_placeholder_repo_id_and_an_ownerless_one_are_refused_for_the_hub(tmp_path):
    from pipeline.core.errors import ConfigError

    placeholder = config(tmp_path, "publish=hub")  # refused before a build that would publish there, not before
    with pytest.raises(PublishError, match=r"publish.repo_id='your-org/gemma-4-E4B-it-inferentia2' is the "
                                           r"documentation's placeholder"):
        run(placeholder, "trace")
    assert not (tmp_path / "toolchain.json").exists()
    with pytest.raises(ConfigError, match="names no owner"):
        config(tmp_path, "publish=hub", "publish.repo_id=gemma4-builds")
    config(tmp_path, "publish=local")  # the local folder needs no owner


def test_a_repository_of_one_model_refuses_a_build_of_another():
    from pipeline.stages.publish import require_same_model

    base = a_manifest(version="512_bf16-ncc2.23.6484.0")
    ours = replace(base, model=replace(base.model, hub_id="google/gemma-4-E4B-it"))
    require_same_model(ours, [ours], "org/repo")
    with pytest.raises(PublishError, match=r"org/repo holds builds of google/gemma-4-E2B-it; "
                                           r".* is a build of google/gemma-4-E4B-it:"):
        require_same_model(ours, [replace(base, model=replace(base.model, hub_id="google/gemma-4-E2B-it"))], "org/repo")


# -- a Hub that does not answer, refuses, or is full ---------------------------------------------------------------

def calls_to(hub: Hub, start: int, method: str, part: str) -> int:
    return len([c for c in hub.calls[start:] if c[0] == method and part in c[1]])


def test_a_hub_that_does_not_answer_reads_is_not_an_empty_repository(hub, project):
    repo_id = "tester/outage"
    run(hub_cfg(project, repo_id=repo_id), "publish")  # the head's manifest is a 404 EntryNotFound: absent, published
    repo = hub.repos[repo_id]
    before = (len(repo.commits), dict(repo.tags), repo.resolve("main").files["README.md"])
    hub.faults.resolve = 503  # every download answers 503, past the client's retries (LocalEntryNotFoundError)
    calls = len(hub.calls)
    # The same build again (its manifest unread is no "different build"), and a new version beside it (the regression
    # baseline and the card's older versions unread are no empty repository).
    for variant in ("512_fp32", "256_bf16_host"):
        with pytest.raises(PublishError, match=r"failed after 2 attempt\(s\) \(HTTP 503: .*the Hub at "
                                               r"http://127\.0\.0\.1:\d+ did not answer; retry later: publishing is "
                                               r"idempotent"):
            run(hub_cfg(project, variant, "publish.retries=2", repo_id=repo_id), "publish")
    assert (len(repo.commits), dict(repo.tags), repo.resolve("main").files["README.md"]) == before
    assert calls_to(hub, calls, "POST", "/commit/") == 0 and calls_to(hub, calls, "POST", "/tag/") == 0


@pytest.fixture
def xet(monkeypatch):
    """Uploads through Xet, as in production (hf_xet installed, HF_HUB_DISABLE_XET unset)."""
    pytest.importorskip("hf_xet")
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_DISABLE_XET")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_xet_token_is_not_retried_and_names_the_token(hub, project, xet, status):
    repo_id = f"tester/xet-{status}"
    hub.faults.xet_token = status  # hf_xet reports it as a plain ConnectionError carrying the status
    calls = len(hub.calls)
    # huggingface_hub 2.x passes on hf_xet's error, which names the route; 1.x raises its own, naming Xet storage.
    with pytest.raises(PublishError, match=rf"failed after 1 attempt\(s\) \(HTTP {status}: .*"
                                           rf"(xet-write-token|upload to xet storage).*"
                                           rf"the token cannot write to {repo_id}: use a token with write access"):
        run(hub_cfg(project, repo_id=repo_id), "publish")
    assert calls_to(hub, calls, "GET", f"/api/models/{repo_id}/xet-write-token/") == 1  # Xet was asked, once
    assert len(hub.repos[repo_id].commits) == 1 and not hub.repos[repo_id].tags


def test_a_xet_token_route_that_does_not_answer_is_retried_then_named(hub, project, xet):
    repo_id = "tester/xet-503"
    hub.faults.xet_token = 503
    calls = len(hub.calls)
    with pytest.raises(PublishError, match=r"failed after 2 attempt\(s\) \(HTTP 503: .*did not answer; retry later"):
        run(hub_cfg(project, "512_fp32", "publish.retries=2", repo_id=repo_id), "publish")
    assert calls_to(hub, calls, "POST", f"/api/models/{repo_id}/preupload/") == 2  # our two attempts
    assert calls_to(hub, calls, "GET", f"/api/models/{repo_id}/xet-write-token/") >= 2  # and hf_xet's own retries
    assert len(hub.repos[repo_id].commits) == 1 and not hub.repos[repo_id].tags


def test_a_read_only_token_is_refused_naming_the_token(hub, project, monkeypatch):
    from huggingface_hub import HfApi

    repo_id = "tester/read-only"
    HfApi(endpoint=hub.url, token=hub.token).create_repo(repo_id, private=True)
    monkeypatch.setenv("HF_TOKEN", hub.read_token)
    calls = len(hub.calls)
    with pytest.raises(PublishError, match=rf"failed after 1 attempt\(s\) \(HTTP 403: .*the token cannot write to "
                                           rf"{repo_id}: use a token with write access") as err:
        run(hub_cfg(project, repo_id=repo_id), "publish")
    assert hub.read_token not in str(err.value)
    assert calls_to(hub, calls, "POST", "/preupload/") == 1
    assert len(hub.repos[repo_id].commits) == 1 and not hub.repos[repo_id].tags


def test_a_full_storage_quota_is_named_and_not_retried(hub, project):
    from huggingface_hub import HfApi

    repo_id = "tester/full"
    HfApi(endpoint=hub.url, token=hub.token).create_repo(repo_id, private=True)
    hub.faults.quota = True
    calls = len(hub.calls)
    with pytest.raises(PublishError, match=rf"failed after 1 attempt\(s\) \(HTTP 403: .*storage limit reached.*"
                                           rf"{repo_id} is over the Hub's storage quota .*not retried"):
        run(hub_cfg(project, repo_id=repo_id), "publish")
    assert calls_to(hub, calls, "POST", "/preupload/") == 1
    assert len(hub.repos[repo_id].commits) == 1 and not hub.repos[repo_id].tags


def test_the_test_hub_refuses_bad_tags_missing_deletions_and_read_only_writes(hub, project):
    ensure_published(project)
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.errors import BadRequestError, HfHubHTTPError, RemoteEntryNotFoundError

    api, main = HfApi(endpoint=hub.url, token=hub.token), hub.repos[REPO_ID].main
    for bad in ["has space", "a..b", "a~1", "a^1", "a:b", "a?b", "a*b", "a[b", "a\\b", "-lead", "x.lock", "end.",
                ".dot", "a@{b"]:
        with pytest.raises(BadRequestError, match="Invalid tag name"):
            api.create_tag(REPO_ID, tag=bad, revision=main)
    api.create_tag(REPO_ID, tag="ok-1.0+local", revision=main)
    api.delete_tag(REPO_ID, tag="ok-1.0+local")
    with pytest.raises(RemoteEntryNotFoundError):
        api.create_commit(REPO_ID, [CommitOperationDelete("no-such-file.txt")], commit_message="delete")
    reader = HfApi(endpoint=hub.url, token=hub.read_token)
    assert reader.list_repo_refs(REPO_ID).tags  # reads work
    published = next(iter(hub.repos[REPO_ID].tags))
    for write in (lambda: reader.create_tag(REPO_ID, tag="read-only", revision=main),
                  lambda: reader.delete_tag(REPO_ID, tag=published),
                  lambda: reader.create_repo("tester/not-created"),
                  lambda: reader.create_commit(REPO_ID, [CommitOperationAdd("x.txt", b"x")], commit_message="x")):
        with pytest.raises(HfHubHTTPError) as err:
            write()
        assert err.value.response.status_code == 403
    assert published in hub.repos[REPO_ID].tags and "tester/not-created" not in hub.repos


def test_version_names_are_checked_as_git_checks_refs():
    from pipeline.core.names import tag_problem
    from pipeline.stages.package import version_name

    ours = [version_name(p.stem, compiler, "0" * 64, fmt, True)
            for p in (Path(__file__).parent.parent / "conf" / "variant").glob("*.yaml")
            for compiler in ("ncc2.23.6484.0", "cpu-torch2.13.0", "cpu-torch2.9.0rc1", "ncc2.21.18209.0+043b1bf7")
            for fmt in ("tar.zst", "tar.gz", "tar")]
    names = ours + ["a b", "a..b", "a~1", "a^1", "a:b", "a?b", "a*b", "a[b", "a\\b", "x.lock", "end.", ".dot",
                    "a/.dot", "a//b", "a/b", "b/", "a@{b", "tab\tx", "del\x7f"]
    for name in names:
        git = subprocess.run(["git", "check-ref-format", f"refs/tags/{name}"], capture_output=True).returncode == 0
        assert (tag_problem(name) is None) == git, name
    assert not [n for n in ours if tag_problem(n)]
    assert tag_problem("-lead")  # git accepts it as a ref; its commands would read it as an option


def test_a_version_that_cannot_be_a_tag_is_refused_before_any_request(hub, project, tmp_path):
    root = tmp_path / "artifacts"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("logs"))
    cfg = hub_cfg(root)
    manifest = read_json(Paths.of(cfg).manifest)
    atomic_write_json(Paths.of(cfg).manifest, manifest | {"version": "512_fp32-cpu torch2"})  # a compiler id's space
    calls = len(hub.calls)
    with pytest.raises(PublishError, match=r"version '512_fp32-cpu torch2' cannot be a tag \(it contains ' '\)"):
        run(cfg, "publish")
    assert len(hub.calls) == calls


def test_the_projects_cards_pass_the_hubs_metadata_check_and_a_broken_one_is_refused(hub, project, monkeypatch):
    ensure_published(project)
    from huggingface_hub import CommitOperationAdd, HfApi

    from pipeline.publishing.card import render
    from pipeline.stages import publish

    ours = Manifest.from_json(json.loads(files_at(hub, version_of(project))["512_fp32/manifest.json"]), "published")
    real = replace(ours, model=replace(ours.model, hub_id="google/gemma-4-E4B-it"), backend="neuron")
    api, repo_id = HfApi(endpoint=hub.url, token=hub.token), "tester/cards"
    api.create_repo(repo_id)
    for manifests in ([real], [ours]):  # the real model's card and the demo card: each a commit the Hub accepts
        api.create_commit(repo_id, [CommitOperationAdd("README.md", render(manifests, repo_id).encode())],
                          commit_message="card")
    broken = render([real], repo_id).replace("license: apache-2.0", "license: apache2").replace(
        "base_model: google/gemma-4-E4B-it", "base_model: gemma-4-E4B-it")
    monkeypatch.setattr(publish, "render", lambda manifests, repo_id, source: broken)
    calls = len(hub.calls)
    with pytest.raises(PublishError, match=r'failed after 1 attempt\(s\) \(HTTP 400: Invalid metadata in README.md\. '
                                           r'- "license" must be one of \[.*the Hub refused the model card'):
        run(hub_cfg(project, repo_id=repo_id), "publish")
    assert calls_to(hub, calls, "POST", "/validate-yaml") == 1 and calls_to(hub, calls, "POST", "/commit/") == 0
    monkeypatch.setattr(api, "_validate_yaml", lambda *a, **k: None)  # the commit route checks the card as well
    with pytest.raises(ValueError, match=r'Invalid metadata in README.md. .*"base_model" with value "gemma-4-E4B-it" '
                                         r"is not valid"):
        api.create_commit(repo_id, [CommitOperationAdd("README.md", broken.encode())], commit_message="card")
    assert len(hub.repos[repo_id].commits) == 3 and not hub.repos[repo_id].tags


def test_pull_from_a_hub_that_does_not_answer_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(tmp_path / "h"),
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "pull", REPO_ID, "512_fp32", "--dest", str(tmp_path / "w"),
                           "--allow-unsigned"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"from http://127.0.0.1:{port} failed (ConnectError" in proc.stderr and "retry later" in proc.stderr
