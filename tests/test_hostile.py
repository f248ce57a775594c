"""A hostile repository, as a consumer meets it: every name it supplies is checked before it becomes a path, a file is
only ever created inside a folder the command made, and a published archive is verified before it is taken as
published (docs/reliability.md, "Hostile inputs").

The repositories here are copies of a real publish folder (tests/conftest.py ``validated_512_fp32``) with one
hostile commit on top, made with git as an attacker with write access to the repository would make it, or an
in-memory source standing for a Hub whose listing says what a test wants.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.artifact import archive as archive_module
from pipeline.artifact.manifest import Manifest
from pipeline.cli.pull import LocalSource, manifest_beside, pull
from pipeline.core.errors import DiskFullError, IntegrityError, PipelineError, PublishError
from pipeline.core.fsutil import sha256_file
from pipeline.core.log import redact
from pipeline.core.names import child, component_problem, repo_path
from pipeline.paths import Paths
from pipeline.publishing.localrepo import LocalRepo

from .helpers import FAST_VALIDATE, config, run

REPO = Path(__file__).resolve().parent.parent
VARIANT = "512_fp32"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=attacker", "-c", "user.email=a@example.com", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()


def left_in(dest: Path) -> list[str]:
    """What a pull left in ``dest``, but the lock folder it keeps (``.locks``, one small file per version pulled)."""
    return sorted(p.name for p in dest.iterdir() if p.name != ".locks") if dest.exists() else []


def published_copy(built: Path, dst: Path) -> tuple[Path, str]:
    """A copy of ``built``'s publish folder and the version it holds."""
    shutil.copytree(built / "published", dst)
    version = Manifest.read(Paths(built, "gemma4_tiny", VARIANT).manifest).version
    return dst, version


def hostile_commit(repo: Path, version: str, edit) -> None:
    """Commit ``edit(manifest dict)`` as the variant's manifest, unsigned, and move the version's tag to it."""
    git(repo, "checkout", "-q", "main")
    path = repo / VARIANT / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (repo / VARIANT / "manifest.sig").unlink(missing_ok=True)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "hostile")
    git(repo, "tag", "-f", version, "HEAD")


def hostile_raw_commit(repo: Path, version: str, path: str, data: bytes) -> None:
    """Commit ``data`` as ``path`` (unsigned: the variant's manifest.sig removed) and move the version's tag to it."""
    git(repo, "checkout", "-q", "main")
    (repo / path).write_bytes(data)
    (repo / VARIANT / "manifest.sig").unlink(missing_ok=True)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "hostile")
    git(repo, "tag", "-f", version, "HEAD")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


# -- the names ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "a\\b", "/abs", ".hidden", "-rf", "nul\0x", "cr\rx",
                                  "x" * 256, "del\x7f",
                                  # C1 controls (NEL, CSI), a bidi override, a zero-width joiner, the line and paragraph
                                  # separators, a lone surrogate (it was a UnicodeEncodeError): one rule, by category
                                  "a\x85b", "a\x9bb", "a\u202eb", "a\u200db", "a\u2028b", "a\u2029b", "\ud800.tar.zst"])
def test_a_name_that_is_not_one_plain_component_is_refused(name, tmp_path):
    assert component_problem(name)
    with pytest.raises(IntegrityError, match="is not a plain file name|leads outside"):
        child(tmp_path, name, "a name")


def test_plain_names_pass_and_stay_inside(tmp_path):
    for name in ("gemma4_tiny-512_fp32-cpu-torch2.13.0-0123abcd.tar.zst", "tp_0.pt", "é", "a b"):
        assert child(tmp_path, name, "a name") == tmp_path / name
    assert repo_path("512_fp32/manifest.json", "a path") == "512_fp32/manifest.json"
    with pytest.raises(IntegrityError):
        repo_path("512_fp32/../../x", "a path")
    (tmp_path / "link").symlink_to("/etc")  # a name that is plain, but a link already there leads elsewhere
    with pytest.raises(IntegrityError, match="'link' leads outside"):
        child(tmp_path, "link", "a name")


# -- pull -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["pull", "serve"])
def test_a_manifests_archive_name_cannot_reach_outside_dest(validated_512_fp32, tmp_path, command):
    """The reported attack: archive.name '../../../../../../<dir>/VICTIM.txt' in an unsigned manifest, the tag moved
    to it; pull emptied and removed that file. Now the manifest is refused and the file is untouched."""
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    victim = tmp_path / "x" / "VICTIM.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    hostile_commit(repo, version, lambda m: m["archive"].update(name="../" * 12 + str(victim).lstrip("/")))
    dest = tmp_path / "dest"
    if command == "pull":
        proc = cli("pull", str(repo), VARIANT, "--dest", str(dest), "--allow-unsigned")
    else:
        proc = cli("serve", str(repo), VARIANT, "--dest", str(dest), "--allow-unsigned", "--port", "0",
                   "--checkpoint", str(validated_512_fp32 / "gemma4_tiny" / "weights"))
    assert proc.returncode == 1, proc.stderr
    assert "archive.name" in proc.stderr and "must be a plain file name" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert victim.read_text() == "precious"
    assert left_in(dest) == []  # nothing left, not even the work folder


@pytest.mark.parametrize("field,value", [("root", "../escaped"), ("root", ".hidden"), ("name", "a/b.tar.zst"),
                                         ("name", "x.zip")])
def test_every_name_a_manifest_gives_is_checked(validated_512_fp32, tmp_path, field, value):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    hostile_commit(repo, version, lambda m: m["archive"].update({field: value}))
    with pytest.raises(IntegrityError, match=f"archive.{field}"):
        pull(LocalSource(repo), version, tmp_path / "dest", None, True)
    assert not (tmp_path / "escaped").exists()


class ListingSource:
    """A repository (a Hub, say) whose listing and files say whatever the test wants; it records every fetch."""

    def __init__(self, real: LocalSource, version: str, extra_files: list[str]):
        self.real, self.version, self.extra, self.name = real, version, extra_files, "a hostile listing"
        self.identity = self.name
        self.fetched: list[str] = []

    def tags(self):
        return self.real.tags()

    def head(self):
        return self.real.head()

    def files(self, commit):
        return self.extra + self.real.files(commit)

    def fetch(self, commit, path, dest, max_bytes=None):
        self.fetched.append(path)
        self.real.fetch(commit, path, dest, max_bytes)


def test_folders_of_a_hostile_listing_are_never_read_or_written(validated_512_fp32, tmp_path, caplog):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    hostile = ["../../outside/manifest.json", "..\\x/manifest.json", ".git/manifest.json", "-n/manifest.json"]
    source = ListingSource(LocalSource(repo), version, hostile)
    target = pull(source, version, tmp_path / "dest", None, True)
    assert target.parent == tmp_path / "dest"
    assert all(path.startswith(f"{VARIANT}/") for path in source.fetched), source.fetched
    assert "the repository's listing names a folder '..\\\\x'" in caplog.text
    assert not (tmp_path / "outside").exists()


def test_checking_out_a_file_never_opens_an_existing_one(validated_512_fp32, tmp_path):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    local = LocalRepo(repo)
    victim = tmp_path / "VICTIM.txt"
    victim.write_text("precious")
    with pytest.raises(FileExistsError):
        local.checkout_file(version, f"{VARIANT}/manifest.json", victim)
    with pytest.raises(FileExistsError):  # and a path git would refuse does not remove it either
        local.checkout_file(version, f"{VARIANT}/no-such-file", victim)
    assert victim.read_text() == "precious"
    missing = tmp_path / "new.json"
    with pytest.raises(PipelineError, match="is not in"):
        local.checkout_file(version, f"{VARIANT}/no-such-file", missing)
    assert not missing.exists()  # what it created, it removed


def test_dest_that_is_a_file_is_refused_by_name(validated_512_fp32, tmp_path):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    dest = tmp_path / "a-file"
    dest.write_text("not a folder")
    proc = cli("pull", str(repo), version, "--dest", str(dest), "--allow-unsigned")
    assert proc.returncode == 1
    assert f"--dest {dest} is a file: give a directory" in proc.stderr and "Traceback" not in proc.stderr
    assert dest.read_text() == "not a folder"


def test_a_full_destination_is_named_not_blamed_on_the_archive(validated_512_fp32, tmp_path, monkeypatch):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")

    def no_room(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(archive_module, "_write_member", no_room)
    dest = tmp_path / "dest"
    with pytest.raises(DiskFullError, match=r"pull .*: out of space writing .*dest \(No space left on device\)"):
        pull(LocalSource(repo), version, dest, None, True)
    assert left_in(dest) == []


@pytest.mark.parametrize("moment", ["unpacking", "just after the rename"])
def test_an_interrupted_pull_leaves_nothing_or_a_complete_version(validated_512_fp32, tmp_path, monkeypatch, moment):
    """Ctrl-C at any moment: either no rank directory, or one with its manifest beside it (the rename of the verified
    directory is the step that makes it visible, and its manifest is already there)."""
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    root = Manifest.read(Paths(validated_512_fp32, "gemma4_tiny", VARIANT).manifest).archive.root
    real_replace = archive_module.os.replace

    def interrupted_replace(src, dst):  # os.replace everywhere: only the rank directory's rename is interrupted
        if Path(dst).name != root:
            return real_replace(src, dst)
        if moment == "just after the rename":
            real_replace(src, dst)
        raise KeyboardInterrupt

    monkeypatch.setattr(archive_module.os, "replace", interrupted_replace)
    dest = tmp_path / "dest"
    with pytest.raises(KeyboardInterrupt):
        pull(LocalSource(repo), version, dest, None, True)
    monkeypatch.undo()
    left = left_in(dest)
    if moment == "unpacking":
        assert left == []
    else:
        assert left == [root, root + ".manifest.json"]
        assert Manifest.read(manifest_beside(dest / root)).version == version
    assert pull(LocalSource(repo), version, dest, None, True) == dest / root  # the rerun completes or verifies


# -- bombs and names (issue 39) --------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,said", [
    ("nested", "nests deeper than 32"),  # it was an uncaught RecursionError, with or without --public-key
    # It was parsed whole (500 MB: 1.05 GB and 14.6 s); now its size is read first, and it is not downloaded.
    ("large", "bytes, more than the 1048576 a file of its kind may have: refusing to download it"),
    ("repeated key", "the key 'version' appears twice"),
])
def test_a_manifest_bomb_is_refused_in_one_line(validated_512_fp32, tmp_path, case, said):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    text = (repo / VARIANT / "manifest.json").read_text()
    data = {"nested": "[" * 200_000 + "]" * 200_000, "large": text[:-2] + ', "pad": "' + "x" * (2 << 20) + '"}\n',
            "repeated key": '{"version": "a",' + text.lstrip()[1:]}[case]
    hostile_raw_commit(repo, version, f"{VARIANT}/manifest.json", data.encode())
    proc = cli("pull", str(repo), version, "--dest", str(tmp_path / "dest"), "--allow-unsigned")
    assert proc.returncode == 1 and said in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and left_in(tmp_path / "dest") == []


def test_with_a_key_the_signature_is_checked_before_the_manifest_is_parsed(validated_512_fp32, tmp_path):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    hostile_raw_commit(repo, version, f"{VARIANT}/manifest.json", ("[" * 200_000 + "]" * 200_000).encode())
    subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(tmp_path / "k")],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "ec", "-in", str(tmp_path / "k"), "-pubout", "-out", str(tmp_path / "k.pub")],
                   check=True, capture_output=True)
    source = LocalSource(repo)
    from pipeline.cli.pull import Choice

    with pytest.raises(IntegrityError, match="has no manifest.sig: the artifact is unsigned"):
        from pipeline.cli.pull import fetched, work_folder

        (tmp_path / "dest").mkdir()
        with work_folder(tmp_path / "dest") as work:
            fetched(source, Choice(version, LocalRepo(repo).tags()[version]), tmp_path / "dest", work,
                    str(tmp_path / "k.pub"), False, None, False)


def test_a_nested_index_falls_back_to_the_manifests(validated_512_fp32, tmp_path):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    git(repo, "checkout", "-q", "main")
    (repo / "versions.json").write_text("[" * 200_000 + "]" * 200_000)
    git(repo, "commit", "-q", "-am", "a nested index")
    listed = cli("versions", str(repo))
    assert listed.returncode == 0 and version in listed.stdout, listed.stderr  # it was a RecursionError traceback
    assert "cannot be used" in listed.stderr and "nests deeper than 32" in listed.stderr
    pulled = cli("pull", str(repo), VARIANT, "--dest", str(tmp_path / "dest"), "--allow-unsigned")
    assert pulled.returncode == 0 and "Traceback" not in pulled.stderr, pulled.stderr


def pax_bomb(root: str, declared: int) -> bytes:
    """A tar stream whose first header is a PAX extended header announcing ``declared`` bytes of records (zeros)."""
    import tarfile

    header = tarfile.TarInfo(f"{root}/././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, declared
    return header.tobuf(tarfile.GNU_FORMAT) + b"\0" * declared + b"\0" * 1024


def test_an_archive_header_bomb_is_refused_at_its_header(validated_512_fp32, tmp_path):
    """A PAX header announcing 64 MiB (2 GiB, 65 KB compressed, took 6.3 GB and 1 m 44 s: bench/pull_bombs.py) is
    refused at its header block, before tarfile reads the record."""
    import zstandard

    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    manifest = json.loads((repo / VARIANT / "manifest.json").read_text())
    bomb = zstandard.ZstdCompressor().compress(pax_bomb(manifest["archive"]["root"], 64 << 20))
    git(repo, "checkout", "-q", "main")
    (repo / VARIANT / manifest["archive"]["name"]).write_bytes(bomb)
    digest = hashlib.sha256(bomb).hexdigest()

    def edit(m: dict) -> None:
        m["archive"].update(size=len(bomb), sha256=digest)
        for member in m["members"]:  # what a 9 GB build's members allow in all: the total bound does not stop it
            member["size"] = 4 << 30

    hostile_commit(repo, version, edit)
    with pytest.raises(IntegrityError, match="an extended header of 67108864 bytes"):
        pull(LocalSource(repo), version, tmp_path / "dest", None, True)
    assert left_in(tmp_path / "dest") == []


def test_a_decompressed_stream_past_the_manifests_members_is_refused():
    from pipeline.artifact.archive import _Bounded, tar_bytes_bound
    from pipeline.core.build_records import Member

    bound = tar_bytes_bound([Member("tp_0.pt", 1000, "0" * 64), Member("tp_1.pt", 1, "1" * 64)])
    stream = _Bounded(io.BytesIO(b"\0" * (bound + 1)), bound)
    assert len(stream.read(bound)) == bound
    with pytest.raises(IntegrityError, match=f"decompresses to more than the {bound} bytes"):
        stream.read(1)


def test_the_tar_bound_holds_every_archive_pack_writes(tmp_path):
    from pipeline.artifact.archive import pack, tar_bytes_bound

    for n, size in enumerate((0, 1, 511, 512, 513, 100_000)):
        (tmp_path / f"tp_{n}.pt").write_bytes(b"x" * size)
    names = [f"tp_{n}.pt" for n in range(6)]
    out = pack(tmp_path, names, "r" * 200, tmp_path / "a.tar", "tar")  # a long root: PAX headers on every entry
    assert out.archive.size <= tar_bytes_bound(out.members)


def test_a_lone_surrogate_or_escape_in_a_name_is_refused_cleanly(validated_512_fp32, tmp_path):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    hostile_commit(repo, version, lambda m: m["archive"].update(name="\ud800.tar.zst"))
    proc = cli("pull", str(repo), version, "--dest", str(tmp_path / "dest"), "--allow-unsigned")
    assert proc.returncode == 1 and "must be a plain file name" in proc.stderr, proc.stderr  # UnicodeEncodeError
    assert "Traceback" not in proc.stderr


def test_an_unsigned_rows_escape_sequence_never_reaches_the_terminal(validated_512_fp32, tmp_path):
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    git(repo, "checkout", "-q", "main")
    index = json.loads((repo / "versions.json").read_text())
    index["versions"][0]["compiler"] = "\x1b[31m\x1b]0;PWNED\x07"  # a tagged version's row: printed in the table
    (repo / "versions.json").write_text(json.dumps(index))
    git(repo, "commit", "-q", "-am", "a row with escapes")
    git(repo, "tag", "x-\u202e", "HEAD")  # a tag git takes, with a bidi override in it
    for args in (["versions", str(repo)], ["pull", str(repo), VARIANT, "--allow-unsigned", "--dest",
                                             str(tmp_path / "dest")]):
        proc = cli(*args)
        out = proc.stdout + proc.stderr
        assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out, out
        assert "Traceback" not in out


def test_a_symlinked_rank_file_is_refused_though_its_bytes_match(validated_512_fp32, tmp_path, caplog):
    """A rank file replaced by a link to the same bytes elsewhere (they could change after the check) is refused when
    the directory is checked again, and pull fetches the version afresh."""
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    path = pull(LocalSource(repo), version, tmp_path / "dest", None, True)
    elsewhere = tmp_path / "elsewhere.pt"
    shutil.copyfile(path / "tp_0.pt", elsewhere)
    (path / "tp_0.pt").unlink()
    (path / "tp_0.pt").symlink_to(elsewhere)
    from pipeline.artifact.pulled import reverified

    with pytest.raises(IntegrityError, match="tp_0.pt is a symbolic link"):
        reverified(path, Manifest.read(manifest_beside(path)))
    assert pull(LocalSource(repo), version, tmp_path / "dest", None, True) == path
    assert not (path / "tp_0.pt").is_symlink() and "is a symbolic link" in caplog.text


def test_every_log_line_escapes_what_a_terminal_would_act_on():
    import logging

    from pipeline.core.log import Formatter

    record = logging.LogRecord("pipeline", logging.WARNING, "x", 1, "skipped %s\nnext line\tok", (
        "\x1b[31m\x1b]0;PWNED\x07v\u202e\u2028\x85",), None)
    assert Formatter().format(record).endswith(
        "skipped \\x1b[31m\\x1b]0;PWNED\\x07v\\u202e\\u2028\\x85\nnext line\tok")


def test_a_pull_killed_mid_way_leaves_what_the_next_pull_removes(validated_512_fp32, tmp_path):
    """kill -9 while unpacking: the work folder (the archive, the half-unpacked rank directory) stays; the next pull
    removes it, as its lock is free, and leaves a running pull's alone."""
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    dest = tmp_path / "dest"
    killed = subprocess.run([sys.executable, "-c", f"""
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from pipeline.artifact import archive
from pipeline.cli.pull import LocalSource, pull
real = archive._write_member
def write_then_die(tar, info, path, expected):
    real(tar, info, path, expected)
    os.kill(os.getpid(), signal.SIGKILL)
archive._write_member = write_then_die
pull(LocalSource(Path({str(repo)!r})), {version!r}, Path({str(dest)!r}), None, True)
"""], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    left = [p for p in dest.iterdir() if p.name.startswith(".pull.tmp-")]
    assert len(left) == 1 and any(left[0].rglob("tp_*.pt")), sorted(p.name for p in dest.rglob("*"))
    from pipeline.cli.pull import work_folder

    with work_folder(dest) as running:  # another pull, running: its folder is left alone
        pulled = pull(LocalSource(repo), version, dest, None, True)
        assert running.is_dir()
    assert not left[0].exists() and left_in(dest) == sorted([pulled.name, pulled.name + ".manifest.json",
                                                            pulled.name + ".pulled.json"])


def test_a_pull_starting_beside_another_never_removes_its_new_work_folder(tmp_path, monkeypatch):
    """Between a pull's mkdtemp and its flock, its new work folder is not locked yet: another pull sweeping then must
    wait, not take it for a killed pull's and remove it (CI saw it: of two pulls started at once, one lost its
    folder's manifest.json)."""
    import tempfile
    import threading

    from pipeline.cli import pull as pull_module

    dest = tmp_path / "dest"
    dest.mkdir()
    real_mkdtemp = tempfile.mkdtemp
    others: list[threading.Thread] = []

    def another_pull() -> None:
        with pull_module.work_folder(dest):
            pass

    def mkdtemp_then_another_pull_starts(**kwargs):
        made = real_mkdtemp(**kwargs)
        if not others:  # the first pull's folder exists, unlocked: the other pull sweeps now (or waits for it)
            others.append(threading.Thread(target=another_pull))
            others[0].start()
            others[0].join(timeout=1.5)
        return made

    monkeypatch.setattr(pull_module.tempfile, "mkdtemp", mkdtemp_then_another_pull_starts)
    with pull_module.work_folder(dest) as work:
        assert work.is_dir()
    others[0].join(timeout=30)
    assert not others[0].is_alive() and not any(dest.glob(".pull.tmp-*"))


# -- publish over a published version -------------------------------------------------------------------------------

def corrupt_published_archive(repo: Path, version: str, archive_name: str) -> None:
    """Replace the published archive's bytes in a new commit, and move the tag there (the manifest unchanged)."""
    git(repo, "checkout", "-q", "main")
    path = repo / VARIANT / archive_name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    git(repo, "commit", "-q", "-am", "corrupt")
    git(repo, "tag", "-f", version, "HEAD")


def test_republishing_over_a_corrupt_archive_repairs_it(validated_512_fp32, tmp_path):
    root = tmp_path / "artifacts"
    shutil.copytree(validated_512_fp32, root, ignore=shutil.ignore_patterns("logs", ".locks"))
    cfg = config(root, *FAST_VALIDATE, "force=true")
    manifest = Manifest.read(Paths.of(cfg).manifest)
    corrupt_published_archive(root / "published", manifest.version, manifest.archive.name)
    corrupt_tag = LocalRepo(root / "published").tag_commit(manifest.version)
    result = [r for r in run(cfg, "publish") if r.stage == "publish"][0]
    assert result.details["repaired"] and result.status == "ran"
    repaired = LocalRepo(root / "published").tag_commit(manifest.version)
    assert repaired != corrupt_tag
    assert LocalRepo(root / "published").file_digest(repaired, f"{VARIANT}/{manifest.archive.name}") == (
        manifest.archive.size, manifest.archive.sha256)
    again = [r for r in run(cfg, "publish") if r.stage == "publish"][0]  # now verified: nothing to do
    assert again.status == "skipped" and not again.details["repaired"]
    pulled = pull(LocalSource(root / "published"), manifest.version, tmp_path / "dest", None, True)
    assert sorted(sha256_file(p) for p in pulled.iterdir()) == sorted(m.sha256 for m in manifest.members)


@pytest.mark.parametrize("case", ["other bytes", "head moved on"])
def test_a_corrupt_archive_that_cannot_be_restored_is_refused_by_name(validated_512_fp32, tmp_path, case):
    root = tmp_path / "artifacts"
    shutil.copytree(validated_512_fp32, root, ignore=shutil.ignore_patterns("logs", ".locks"))
    cfg = config(root, *FAST_VALIDATE, "force=true")
    manifest = Manifest.read(Paths.of(cfg).manifest)
    repo = root / "published"
    if case == "other bytes":  # published: the same rank files in other archive bytes (another zstd?), then damaged
        hostile_commit(repo, manifest.version, lambda m: m["archive"].update(sha256="f" * 64))
        expected = r"has \d+ bytes and sha256 .* cannot restore them\. Refused"
    else:  # the archive damaged at the tag, and the head now holds another version of the variant
        corrupt_published_archive(repo, manifest.version, manifest.archive.name)
        git(repo, "checkout", "-q", "main")
        edited = json.loads((repo / VARIANT / "manifest.json").read_text()) | {"version": f"{VARIANT}-later"}
        (repo / VARIANT / "manifest.json").write_text(json.dumps(edited))
        git(repo, "commit", "-q", "-am", "a later version")
        expected = rf"the head now holds {VARIANT}-later of {VARIANT}: restoring it there would roll the head back"
    before = git(repo, "rev-list", "--all"), git(repo, "tag")
    with pytest.raises(PublishError, match=rf"{manifest.version} is published with a corrupt archive .*{expected}"):
        run(cfg, "publish")
    assert (git(repo, "rev-list", "--all"), git(repo, "tag")) == before


# -- what a server says ---------------------------------------------------------------------------------------------

def test_secrets_in_a_servers_words_are_redacted_from_messages_and_logs(caplog):
    from pipeline.publishing import hub

    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"

    class Refusal(Exception):
        response = type("R", (), {"status_code": 401})()

    said, _ = hub.explain(Refusal(f"401 for Authorization: Bearer {token}; body {{\"token\": \"{token}\"}}"), "o/r")
    assert token not in said and "[REDACTED]" in said
    import logging

    logging.getLogger("pipeline").warning("server said %s", f"token={token}")
    from pipeline.core.log import Formatter

    assert all(token not in Formatter().format(r) for r in caplog.records)
    for harmless in ("max_tokens=16", "no Hugging Face token: set HF_TOKEN", "hf_hub_download failed"):
        assert redact(harmless) == harmless
