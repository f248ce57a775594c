"""Files a command keeps where another user can reach them (issue 49; docs/reliability.md, "Hostile inputs"): the
locks of a shared destination, the trusted state of a signed source, the owner line whatever argv holds, and the
publisher's folder that refresh-index signs in.

Another user is played as root plays one (the suite runs as root): a folder opened to everyone with chmod, a file or
folder given to uid 65534 (nobody) with chown, a link planted where everyone may write. Each refusal must be one line
naming the path and the fix, and nothing outside the destination may be written, emptied or created.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.core.errors import IntegrityError
from pipeline.core.fsutil import sha256_bytes
from pipeline.host import locking
from pipeline.publishing import index, layout, trust
from pipeline.publishing.localrepo import LocalRepo

from .test_consumer import keypair, later, pull_signed, signed_versions
from .test_hostile import REPO, VARIANT, cli, git, left_in, published_copy

ME, OTHER = os.geteuid(), 65534
as_root = pytest.mark.skipif(ME != 0, reason="another user's file is made with chown, which needs root")


def refusal(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused command logs: exit 1, no traceback, the error its last line and its only one."""
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert [n for n, line in enumerate(lines) if " ERROR pipeline: " in line] == [len(lines) - 1], proc.stderr
    return lines[-1]


def precious(tmp_path: Path) -> Path:
    """A file outside every destination: nothing a command does may write, empty or replace it."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious\n")
    return path


# -- the locks of a destination (item 1) ------------------------------------------------------------------------------

@pytest.mark.parametrize("planted", ["work-folders.owner", "work-folders.lock"])
def test_a_link_planted_in_a_shared_dest_is_never_written_through(validated_512_fp32, tmp_path, planted):
    """The reported probe: --dest and its lock folder open to everyone (mode 0777, as on a shared inference host), and
    another user's link in the lock folder to a file outside. The owner file was written and emptied through it
    (exit 0); a .lock link was a traceback. The folder is refused before anything is opened in it."""
    repo, _ = published_copy(validated_512_fp32, tmp_path / "published")
    dest, victim = tmp_path / "shared", precious(tmp_path)
    (dest / ".locks").mkdir(parents=True)
    for folder in (dest, dest / ".locks"):
        folder.chmod(0o777)
    (dest / ".locks" / planted).symlink_to(victim)
    line = refusal(cli("pull", str(repo), VARIANT, "--allow-unsigned", "--dest", str(dest)))
    assert f"{dest} can be changed by another user (owner uid {ME}, mode 0777)" in line
    assert f"chmod go-w {dest}" in line and f"chmod +t {dest}" in line
    assert victim.read_bytes() == b"precious\n" and left_in(dest) == []


def plant(locks: Path, victim: Path, how: str) -> str:
    """A file in the lock folder ``locks`` that is not this user's alone, made ``how``; its name."""
    if how == "link to a file outside":
        (locks / "work-folders.owner").symlink_to(victim)
        return "work-folders.owner"
    if how == "link as the lock":
        (locks / "work-folders.lock").symlink_to(victim)
        return "work-folders.lock"
    if how == "hard link to a file outside":
        os.link(victim, locks / "work-folders.owner")
        return "work-folders.owner"
    (locks / "work-folders.owner").write_text("")
    os.chown(locks / "work-folders.owner", OTHER, OTHER)
    return "work-folders.owner"


@as_root
@pytest.mark.parametrize("how", ["link to a file outside", "link as the lock", "hard link to a file outside",
                                 "another user's file"])
def test_a_lock_file_that_is_not_this_users_alone_is_refused_by_name(validated_512_fp32, tmp_path, how):
    """In a destination of this user's, a lock or owner file is used only when it is a regular file of this user's
    with one name (opened without following a link, checked on the descriptor): whatever else is there is named."""
    repo, _ = published_copy(validated_512_fp32, tmp_path / "published")
    dest, victim = tmp_path / "dest", precious(tmp_path)
    (dest / ".locks").mkdir(parents=True, mode=0o755)
    name = plant(dest / ".locks", victim, how)
    line = refusal(cli("pull", str(repo), VARIANT, "--allow-unsigned", "--dest", str(dest)))
    assert f"{dest / '.locks' / name} cannot be used as a lock file" in line and "remove it" in line
    assert victim.read_bytes() == b"precious\n" and left_in(dest) == []


@as_root
@pytest.mark.parametrize(("owner", "mode"), [(OTHER, 0o755), (ME, 0o777), (ME, 0o1777)])
def test_a_lock_folder_another_user_can_change_is_refused(validated_512_fp32, tmp_path, owner, mode):
    repo, _ = published_copy(validated_512_fp32, tmp_path / "published")
    dest = tmp_path / "dest"
    (dest / ".locks").mkdir(parents=True)
    (dest / ".locks").chmod(mode)
    os.chown(dest / ".locks", owner, owner)
    line = refusal(cli("pull", str(repo), VARIANT, "--allow-unsigned", "--dest", str(dest)))
    assert f"{dest / '.locks'} can be changed by another user (owner uid {owner}, mode {mode:04o})" in line
    assert "remove it" in line and left_in(dest) == []


@as_root
@pytest.mark.parametrize(("owner", "taken"), [(ME, True), (OTHER, False)])
def test_a_sticky_shared_dest_is_taken_when_this_users_or_roots(validated_512_fp32, tmp_path, owner, taken):
    """The rule's one exception, as /tmp is: a folder everyone may add to, where only its owner (this user, or root)
    and the owner of a name can rename or remove it. Another user's sticky folder is theirs to rearrange."""
    repo, _ = published_copy(validated_512_fp32, tmp_path / "published")
    dest = tmp_path / "sticky"
    dest.mkdir()
    dest.chmod(0o1777)
    os.chown(dest, owner, owner)
    proc = cli("pull", str(repo), VARIANT, "--allow-unsigned", "--dest", str(dest))
    if taken:
        assert proc.returncode == 0 and Path(proc.stdout.strip()).parent == dest, proc.stderr
    else:
        assert f"{dest} can be changed by another user (owner uid {OTHER}, mode 1777)" in refusal(proc)
        assert left_in(dest) == []


# -- the owner line, whatever argv holds (item 10) -------------------------------------------------------------------

def test_an_owner_line_is_written_whatever_argv_holds(tmp_path, monkeypatch):
    """A byte that is not UTF-8 (argv holds it as a lone surrogate) or a terminal escape is written escaped, as the
    log writes it; it was a UnicodeEncodeError."""
    monkeypatch.setattr(sys, "argv", ["pipeline", "pull", "--dest", os.fsdecode(b"/tmp/caf\xe9"), "\x1b]0;x\x07"])
    owner = tmp_path / locking.LOCK_DIR / "x.owner"
    with locking.held(tmp_path, "x"):
        written = owner.read_text()
    assert written.startswith(f"pid {os.getpid()} on ")
    assert written.endswith(": pipeline pull --dest /tmp/caf\\udce9 \\x1b]0;x\\x07\n")
    assert owner.read_text() == ""  # cleared on release


def pull_bytes(*args: str | bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m pipeline pull ARGS``, with arguments given as bytes where a test needs bytes that are not UTF-8."""
    proc = subprocess.run([sys.executable, "-m", "pipeline", "pull", *args], cwd=REPO, capture_output=True,
                          timeout=300, env={**os.environ, **(env or {})})
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, proc.stderr.decode(errors="replace"))


def test_bytes_that_are_not_utf8_in_argv_are_refused_or_taken_cleanly(validated_512_fp32, tmp_path):
    repo, _ = published_copy(validated_512_fp32, tmp_path / "published")
    line = refusal(pull_bytes(str(repo), b"\xff\xfe", "--allow-unsigned", "--dest", str(tmp_path / "d")))
    assert "has no version or variant '\\udcff\\udcfe'" in line
    dest = os.fsencode(tmp_path) + b"/caf\xe9"
    # A UTF-8 locale's stdout is strict (C.UTF-8's escapes surrogates): the path printed is its own bytes either way
    for env in ({}, {"PYTHONIOENCODING": "utf-8:strict"}):
        taken = pull_bytes(str(repo), VARIANT, "--allow-unsigned", "--dest", dest, env=env)
        assert taken.returncode == 0, taken.stderr
        assert taken.stdout.startswith(dest + b"/") and Path(os.fsdecode(taken.stdout.strip())).is_dir()


# -- the trusted state of a signed source (item 2) -------------------------------------------------------------------

@pytest.fixture
def trusted(validated_512_fp32, tmp_path, monkeypatch):
    """A signed source of two versions, this client having taken the newer (its trusted state: index_version 2):
    ``(folder, public key, the trusted state's path, the older version)``."""
    private, public = keypair(tmp_path / "keys")
    folder = tmp_path / "signed"
    older, _ = signed_versions(folder, validated_512_fp32, [later(1), later(2)], private, monkeypatch)
    monkeypatch.setenv("GEMMA4_PIPELINE_CACHE", str(tmp_path / "cache"))  # this test's own, whatever it does to it
    assert pull_signed(folder, VARIANT, public, tmp_path / "first").returncode == 0
    return folder, public, trust.state_path(str(folder.resolve())), older


def roll_back(folder: Path, older: str) -> str:
    """A new commit restoring the index of ``older``, validly signed: the sha256 of that index."""
    local = LocalRepo(folder)
    at_older = local.tags()[older]
    index_bytes = local.read(at_older, layout.INDEX)
    local.commit({layout.INDEX: index_bytes, layout.INDEX_SIGNATURE: local.read(at_older, layout.INDEX_SIGNATURE)},
                 [], "restore", local.head())
    return sha256_bytes(index_bytes)


@as_root
@pytest.mark.parametrize("how", ["folder open to everyone, record removed", "record of another user",
                                 "record writable by everyone", "cache folder open to everyone, trust/ moved away"])
def test_a_trusted_state_another_user_could_change_is_refused(trusted, tmp_path, how):
    """Another user reset the trusted state and the rolled-back index was taken, exit 0. The state is now read only
    where the pull record's rule holds."""
    folder, public, state, older = trusted
    older_index = roll_back(folder, older)
    if how == "folder open to everyone, record removed":
        state.parent.chmod(0o777)
        state.unlink()
        named = state.parent
    elif how == "cache folder open to everyone, trust/ moved away":
        state.parent.parent.chmod(0o777)
        state.parent.rename(state.parent.with_name("moved"))
        named = state.parent.parent
    else:  # rewritten as someone who wants the rollback taken would: the older index, no variant taken
        record = json.loads(state.read_text())
        state.write_text(json.dumps({**record, "index_version": 1, "index_sha256": older_index, "variants": {}}))
        if how == "record of another user":
            os.chown(state, OTHER, OTHER)
        else:
            state.chmod(0o666)
        named = state
    line = refusal(pull_signed(folder, VARIANT, public, tmp_path / "again"))
    assert f"{named} can be changed by another user" in line and "GEMMA4_PIPELINE_CACHE" in line
    assert left_in(tmp_path / "again") == []


@pytest.mark.parametrize(("edit", "said"), [
    (lambda r: r.update(index_version=-1), "index_version -1 is not between 1 and 9007199254740991"),
    (lambda r: r.update(index_version=0), "index_version 0 is not between 1 and"),
    (lambda r: r.update(index_version=2**63), "index_version 9223372036854775808 is not between 1 and"),
    (lambda r: r.update(index_version="2"), "field index_version has the wrong type (str; expected int)"),
    (lambda r: r.update(index_version=True), "field index_version has the wrong type (bool; expected int)"),
    (lambda r: r.update(index_sha256="0" * 63), "index_sha256 '000"),
    (lambda r: next(iter(r["variants"].values())).update(published="soon"), ".published 'soon' is not a time"),
    (lambda r: r.update(source="/elsewhere"), "is the trusted state of '/elsewhere', not of"),
], ids=["negative", "zero", "2**63", "string", "bool", "short-sha", "published", "other-source"])
def test_a_trusted_state_with_a_value_out_of_range_is_refused_in_one_line(trusted, tmp_path, edit, said):
    """index_version -1 was taken (it bounds nothing); 2**63 refused every later pull as a rollback. Each value is
    checked for its range and type, and the record is refused naming the file and the fix."""
    folder, public, state, _ = trusted
    record = json.loads(state.read_text())
    edit(record)
    state.write_text(json.dumps(record))
    line = refusal(pull_signed(folder, VARIANT, public, tmp_path / "again"))
    assert f"{state} is " in line and said in line and trust.TrustedSource.FIX in line
    assert left_in(tmp_path / "again") == []


def test_a_signed_index_past_what_a_trusted_state_keeps_is_refused_before_anything_is_taken(tmp_path, monkeypatch):
    """A trusted state keeps index_version up to 2**53 - 1; a signed index past it was taken, and the pull failed
    after unpacking, when its state could not be written. It is refused when the index is checked."""
    monkeypatch.setenv("GEMMA4_PIPELINE_CACHE", str(tmp_path / "cache"))
    past = index.VersionIndex(index.VersionIndex.SCHEMA_VERSION, trust.MAX_INDEX_VERSION + 1, index.now(),
                              index.now(), ())
    with pytest.raises(IntegrityError, match=r"index_version 9007199254740992, past the 9007199254740991"):
        trust.check_index("a source", index.SignedIndex(past, "0" * 64))
    trust.check_index("a source", index.SignedIndex(replace(past, index_version=trust.MAX_INDEX_VERSION), "0" * 64))


# -- the publisher's folder (refresh-index) --------------------------------------------------------------------------

@as_root
@pytest.mark.parametrize("opened", [".", ".git", ".git/config", ".git/hooks", ".."])
def test_refresh_index_refuses_a_publish_folder_another_user_can_change(validated_512_fp32, tmp_path, opened):
    """refresh-index ran the configuration another user planted (a probe's core.fsmonitor) and would sign rows
    they committed. A folder only its publisher can change is the publisher's own; another is refused before git runs
    in it (by the publish stage's target, which publish and refresh-index share)."""
    artifacts = tmp_path / "artifacts"
    repo, _ = published_copy(validated_512_fp32, artifacts / "published")
    probe, ran = tmp_path / "fsmonitor", tmp_path / "fsmonitor-ran"
    probe.write_text(f"#!/bin/sh\ntouch {ran}\n")
    probe.chmod(0o755)
    git(repo, "config", "core.fsmonitor", str(probe))
    (repo / opened).resolve().chmod(0o777)
    head = LocalRepo(repo).head()
    line = refusal(cli("refresh-index", f"artifacts_dir={artifacts}", "--force"))
    assert f"{(repo / opened).resolve()} can be changed by another user" in line and "chmod " in line
    assert not ran.exists() and LocalRepo(repo).head() == head


def test_the_publish_stage_refuses_a_publish_folder_another_user_can_change(validated_512_fp32, tmp_path):
    """The publish stage runs git in the same folder and signs the index it writes there: the same rule as
    refresh-index's, before git runs (it took the folder as it was)."""
    artifacts = tmp_path / "artifacts"
    shutil.copytree(validated_512_fp32, artifacts, symlinks=True, ignore=shutil.ignore_patterns("logs", ".locks"))
    config = artifacts / "published" / ".git" / "config"
    before = config.read_bytes()
    config.chmod(0o666)
    line = refusal(cli(f"+variant={VARIANT}", "backend=cpu", "stage=publish", f"artifacts_dir={artifacts}",
                       "force=true"))
    assert f"{config} can be changed by another user" in line and "chmod -R go-w" in line
    assert config.read_bytes() == before
