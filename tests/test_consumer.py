"""The consumer's side: the repository's index of versions, ``versions``, and choosing a version that fits this host.

A repository is made from the shared 512_fp32 build's local publish folder, with neuron versions of the same variant
published beside it by the publish stage's own code (publish_version, the writer of versions.json) as two Neuron SDK
releases would have built them (their manifests' toolchains; the archive is the cpu build's, so a pulled directory
keeps that build's name: the log says which version was taken). Hosts are the stand-in SDK installed as one release
or the other; pull and versions run as users run them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from pipeline.artifact.manifest import Manifest, SignatureFile, manifest_beside
from pipeline.artifact.pulled import Pulled, pulled_beside
from pipeline.backends import compatibility, neuron_sdk
from pipeline.backends.compatibility import Fit
from pipeline.cli.pull import LocalSource, pull
from pipeline.core.build_records import Compiler, NeuronxCcBuild, PackageVersion, ToolchainRecord
from pipeline.core.errors import IntegrityError
from pipeline.core.fsutil import sha256_bytes
from pipeline.publishing import index, layout
from pipeline.publishing.localrepo import LocalRepo
from pipeline.stages import publish
from pipeline.stages.toolchain import PACKAGES
from pipeline.validation.records import Metrics, ParityVerdict, PeakRss

from . import fake_sdk

REPO = Path(__file__).resolve().parent.parent
VARIANT = "512_fp32"
OLDER, NEWER = "2.26.1", "2.28.1"  # two releases with a torch 2.8 build of torch-neuronx


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def toolchain_of(release: str | None, torch: str | None = "2.8.0", runtime: str | None = None,
                 backend: str = "neuron") -> ToolchainRecord:
    """The toolchain record a host with Neuron SDK ``release`` (None: no Neuron packages) and ``torch`` installed
    writes (the toolchain stage's format)."""
    versions = {"torch": torch, "transformers": "5.13.0", "safetensors": "0.8.0",
                **(neuron_sdk.release(release).exact_versions(torch) if release else {})}
    return ToolchainRecord(2, backend, {name: PackageVersion(versions.get(name)) for name in PACKAGES},
                           NeuronxCcBuild(versions.get("neuronx-cc"), "test" if release else None),
                           {compatibility.RUNTIME_PACKAGE: runtime} if runtime else {})


def neuron_manifest(base: Manifest, release: str, inputs: str) -> Manifest:
    toolchain = toolchain_of(release)
    compiler = f"ncc{neuron_sdk.release(release).neuronx_cc}"
    versions = {name: entry.version for name, entry in toolchain.packages.items()}
    return replace(base, version=f"{VARIANT}-{compiler}-{inputs}", backend="neuron",
                   compiler=Compiler(compiler, (), versions), toolchain=toolchain)


# metrics.json of a version these tests publish by hand (what it holds is no test's concern)
NO_METRICS = Metrics(ParityVerdict(True, "exact"), {}, {}, PeakRss(None, 0.0))


def later(minutes: int) -> str:
    """A publish time ``minutes`` after now (after the shared build's own publish), in the index's format."""
    return (datetime.now(timezone.utc) + timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%SZ")


def publish_as(repo: Path, archive: Path, manifest: Manifest, when: str, monkeypatch,
               private_key: str | None = None) -> None:
    """``manifest`` published into the local repository ``repo`` by the publish stage's own code, at time ``when``."""
    monkeypatch.setattr(index, "now", lambda: when)

    def prepare(previous):
        return publish.repo_files(VARIANT, archive, manifest, NO_METRICS, private_key), manifest

    publish.publish_version(LocalRepo(repo), manifest.version, VARIANT, prepare, manifest, "local", str(repo), archive,
                            private_key, expiry_days=7)


@pytest.fixture
def repo(validated_512_fp32, tmp_path, monkeypatch) -> tuple[Path, dict[str, str]]:
    """The shared build's publish folder (its cpu version), plus the neuron versions of SDK ``OLDER`` then ``NEWER``:
    ``(folder, {release: version})``."""
    folder = tmp_path / "published"
    shutil.copytree(validated_512_fp32 / "published", folder)
    dist = validated_512_fp32 / "gemma4_tiny" / VARIANT / "dist"
    base = Manifest.read(dist / "manifest.json")
    built = {}
    for n, release in enumerate((OLDER, NEWER)):
        manifest = neuron_manifest(base, release, f"{n + 1}" * 8)
        publish_as(folder, dist / base.archive.name, manifest, later(n + 1), monkeypatch)
        built[release] = manifest.version
    return folder, built


@pytest.fixture
def on_host(tmp_path, monkeypatch):
    """``on_host(release)``: this process and its children on an inf2 host stand-in with ``release`` installed."""
    with contextlib.ExitStack() as stack:
        def install(release: str) -> None:
            site = fake_sdk.install(tmp_path / f"sdk-{release}", release)
            stack.enter_context(fake_sdk.activated(site, monkeypatch))

        yield install


# -- the rule ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("built", "installed", "fit", "said"), [
    (toolchain_of(NEWER), toolchain_of(NEWER), Fit.compatible, f"Neuron SDK {NEWER}"),
    (toolchain_of(OLDER), toolchain_of(NEWER), Fit.warning, "a newer runtime loads the NEFFs of older compilers"),
    (toolchain_of(NEWER), toolchain_of(OLDER), Fit.refused, "can need a newer runtime"),
    (toolchain_of(NEWER), toolchain_of(None), Fit.refused, "no Neuron packages"),
    (toolchain_of(NEWER), toolchain_of(NEWER, torch="2.9.0"), Fit.refused, "TorchScript of torch 2.8.0"),
    (toolchain_of(NEWER, runtime="2.25.1.0-abc"), toolchain_of(NEWER, runtime="2.24.0.0-def"), Fit.refused,
     "aws-neuronx-runtime-lib 2.24.0.0 is older than the 2.25.1.0"),
    (toolchain_of(NEWER, runtime="2.25.1.0-abc"), toolchain_of(NEWER, runtime="2.26.0.0-def"), Fit.compatible, ""),
], ids=["same-release", "newer-host", "older-host", "no-neuron", "other-torch", "older-runtime", "newer-runtime"])
def test_the_neuron_rule(built, installed, fit, said):
    verdict = compatibility.judge("neuron", built, installed)
    assert verdict.fit == fit and said in verdict.reason
    assert bool(verdict.fix) == (fit == Fit.refused)
    if fit == Fit.refused and "runtime-lib" not in said:
        assert "install-neuron --release" in verdict.fix


@pytest.mark.parametrize(("built", "installed", "fit"), [
    ("2.8.0", "2.8.0+cpu", Fit.compatible), ("2.8.0", "2.8.1", Fit.warning), ("2.8.0", "2.13.0", Fit.warning),
    ("2.13.0+cpu", "2.8.0", Fit.refused), ("2.8.0", None, Fit.refused)])
def test_every_other_backend_takes_torchs_rule(built, installed, fit):
    for backend in ("cpu", "xla"):
        assert compatibility.judge(backend, toolchain_of(None, built, backend=backend),
                                   toolchain_of(None, installed, backend=backend)).fit == fit


# -- the index --------------------------------------------------------------------------------------------------------

def head_index(folder: Path) -> index.VersionIndex:
    repo = LocalRepo(folder)
    return index.decode(repo.read(repo.head(), layout.INDEX), "versions.json")


def test_each_publish_commits_the_index_of_every_tagged_version(repo):
    folder, built = repo
    local = LocalRepo(folder)
    tags = local.tags()
    rows = {row.version: row for row in head_index(folder).versions}
    assert set(rows) == set(tags) and len(tags) == 3
    for version, commit in tags.items():  # each row is what the version's own manifest says, and its bytes' sha256
        raw = local.read(commit, f"{VARIANT}/manifest.json")
        manifest = Manifest.from_json(json.loads(raw), version)
        assert rows[version] == index.row_of(manifest, sha256_bytes(raw), rows[version].published)
        assert layout.INDEX in local.list_files(commit)  # in the same commit as the version it adds
    # Each publish's index one past the one before it, valid for publish.index_expiry_days.
    numbers = [index.decode(local.read(c, layout.INDEX), "at a tag").index_version for c in tags.values()]
    assert sorted(numbers) == [1, 2, 3]
    assert head_index(folder).index_version == 3 and not head_index(folder).expired()
    published = {version: row.published for version, row in rows.items()}
    assert sorted(published, key=published.get)[1:] == [built[OLDER], built[NEWER]]  # each kept from the head's index
    assert rows[built[NEWER]].toolchain.version("neuronx-cc") == neuron_sdk.release(NEWER).neuronx_cc


def test_versions_lists_every_version_and_which_fit_this_host(repo, on_host):
    folder, built = repo
    on_host(OLDER)
    out = cli("versions", str(folder), "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["version"]: row for row in json.loads(out.stdout)}
    assert rows[built[OLDER]]["fits_this_host"] == "compatible"
    assert rows[built[NEWER]]["fits_this_host"] == "refused"
    assert f"install-neuron --release {NEWER}" in rows[built[NEWER]]["fix"]
    assert "reading every version's manifest" not in out.stderr  # the index was current: one download
    fits = cli("versions", str(folder), "--variant", VARIANT, "--fits-this-host")
    assert built[OLDER] in fits.stdout and built[NEWER] not in fits.stdout
    assert "tok/s" in fits.stdout.splitlines()[0]


def test_a_host_with_the_older_sdk_pulls_the_older_version_and_is_refused_the_newer(repo, tmp_path, on_host):
    folder, built = repo
    on_host(OLDER)
    got = cli("pull", str(folder), VARIANT, "--allow-unsigned", "--dest", str(tmp_path / "a"))
    assert got.returncode == 0, got.stderr
    assert f"resolves to {built[OLDER]}, the newest published version of that variant that fits" in got.stderr
    assert f"skipped the newer {built[NEWER]}" in got.stderr and "can need a newer runtime" in got.stderr
    refused = cli("pull", str(folder), built[NEWER], "--allow-unsigned", "--dest", str(tmp_path / "b"))
    assert refused.returncode == 1
    assert f"{built[NEWER]} does not fit this host" in refused.stderr
    assert f"this host has {OLDER}" in refused.stderr and f"install-neuron --release {NEWER}" in refused.stderr
    assert [p.name for p in (tmp_path / "b").iterdir() if p.name != ".locks"] == []  # only pull's lock folder
    anywhere = cli("pull", str(folder), built[NEWER], "--allow-unsigned", "--any-host", "--dest", str(tmp_path / "c"))
    assert anywhere.returncode == 0, anywhere.stderr


def test_a_host_with_the_newer_sdk_pulls_the_newer_version(repo, tmp_path, on_host):
    folder, built = repo
    on_host(NEWER)
    got = cli("pull", str(folder), VARIANT, "--allow-unsigned", "--dest", str(tmp_path / "a"))
    assert got.returncode == 0, got.stderr
    assert f"resolves to {built[NEWER]}" in got.stderr and "skipped" not in got.stderr


def test_a_host_without_neuron_takes_the_cpu_version(repo, tmp_path):
    folder, _ = repo
    got = cli("pull", str(folder), VARIANT, "--allow-unsigned", "--dest", str(tmp_path / "a"))
    assert got.returncode == 0, got.stderr
    assert "-cpu-torch" in got.stdout and got.stderr.count("skipped the newer") == 2
    assert "this host has no Neuron packages" in got.stderr


# -- the tags decide -------------------------------------------------------------------------------------------------

def test_a_stale_index_never_wins_over_the_tags(repo, tmp_path):
    folder, built = repo
    local = LocalRepo(folder)
    rows = list(head_index(folder).versions)
    ghost = replace(rows[0], version=f"{VARIANT}-ncc9.9.9.9-99999999")  # a row with no tag
    stale = index.encode(index.written([r for r in rows if r.version != built[NEWER]] + [ghost], head_index(folder),
                                       7))  # and a tagged version missing
    local.commit({layout.INDEX: stale}, [], "a stale index", local.head())
    listed = index.listing(LocalSource(folder), tmp_path).versions
    assert sorted(p.row.version for p in listed) == sorted(local.tags())
    assert {p.commit for p in listed} == set(local.tags().values())
    out = cli("versions", str(folder))
    assert "lists 1 version(s) with no tag" in out.stderr and "lacks 1 tagged version(s)" in out.stderr


def test_a_deleted_index_is_read_from_the_tags_then_written_again_whole(repo, tmp_path, monkeypatch,
                                                                      validated_512_fp32):
    folder, built = repo
    local = LocalRepo(folder)
    local.commit({}, [layout.INDEX], "the index deleted", local.head())
    listed = index.listing(LocalSource(folder), tmp_path).versions
    assert sorted(p.row.version for p in listed) == sorted(local.tags())
    dist = validated_512_fp32 / "gemma4_tiny" / VARIANT / "dist"
    base = Manifest.read(dist / "manifest.json")
    another = neuron_manifest(base, NEWER, "33333333")
    publish_as(folder, dist / base.archive.name, another, later(3), monkeypatch)
    assert {row.version for row in head_index(folder).versions} == set(local.tags()) | {another.version}


def keypair(folder: Path) -> tuple[str, str]:
    """An elliptic-curve key pair made as signing.KEYGEN makes one: (private, public) PEM paths."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(folder / "k")],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "ec", "-in", str(folder / "k"), "-pubout", "-out", str(folder / "k.pub")], check=True,
                   capture_output=True)
    return str(folder / "k"), str(folder / "k.pub")


def test_a_signed_index_that_fails_its_check_is_refused_with_the_key_and_a_hint_without(repo, tmp_path, monkeypatch,
                                                                                        validated_512_fp32):
    folder, built = repo
    private, public = keypair(tmp_path / "keys")
    dist = validated_512_fp32 / "gemma4_tiny" / VARIANT / "dist"
    base = Manifest.read(dist / "manifest.json")
    signed = replace(neuron_manifest(base, NEWER, "44444444"), signature=SignatureFile("manifest.sig"))
    publish_as(folder, dist / base.archive.name, signed, later(4), monkeypatch, private)
    local = LocalRepo(folder)
    assert layout.INDEX_SIGNATURE in local.list_files(local.head())
    good = cli("versions", str(folder), "--public-key", public)
    assert good.returncode == 0 and "cannot be used" not in good.stderr, good.stderr
    forged = json.loads(local.read(local.head(), layout.INDEX))
    forged["versions"][0]["metrics"]["tokens_per_s"] = 9999.0
    local.commit({layout.INDEX: (json.dumps(forged) + "\n").encode()}, [], "forged", local.head())
    # With the key the signed index decides: one that fails is refused, never worked around (a fallback to the tags
    # would undo every bound the index sets: rollback, freeze).
    out = cli("versions", str(folder), "--public-key", public, "--json")
    assert out.returncode == 1 and "signature does not verify with the public key" in out.stderr, out.stderr
    # Without it the index is a hint, and the tags decide.
    hint = cli("versions", str(folder), "--json")
    assert hint.returncode == 0 and 9999.0 in [row["metrics"]["tokens_per_s"] for row in json.loads(hint.stdout)]


# -- the cache --------------------------------------------------------------------------------------------------------

class Counted(LocalSource):
    """The local publish folder, counting the files fetched from it."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.fetched: list[str] = []

    def fetch(self, commit: str, path: str, dest: Path, max_bytes: int | None = None) -> None:
        self.fetched.append(path)
        super().fetch(commit, path, dest, max_bytes)


def cpu_version(folder: Path) -> str:
    return next(version for version in LocalRepo(folder).tags() if "-cpu-" in version)


def keep_mtime_and_write(path: Path, data: bytes) -> None:
    """``data`` into ``path`` with its mtime put back (what a careless copy or a tool that preserves times does)."""
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_pulled_version_is_used_again_with_nothing_fetched_and_refetched_when_its_files_changed(repo, tmp_path,
                                                                                                 caplog):
    folder, _ = repo
    version, source, dest = cpu_version(folder), Counted(folder), tmp_path / "cache"
    path = pull(source, version, dest, None, True)
    archive = Manifest.read(manifest_beside(path)).archive.name
    assert source.fetched == [f"{VARIANT}/manifest.json", f"{VARIANT}/{archive}"]
    record = Pulled.read(pulled_beside(path))
    assert (record.version, record.commit) == (version, LocalRepo(folder).tags()[version])
    assert sorted(p.name for p in dest.iterdir()) == [".locks", path.name, f"{path.name}.manifest.json",
                                                      f"{path.name}.pulled.json"]

    def again() -> str:
        source.fetched.clear()
        caplog.clear()
        with caplog.at_level("INFO", logger="pipeline"):
            assert pull(source, version, dest, None, True) == path
        return caplog.text

    said = again()
    assert source.fetched == [] and "nothing downloaded" in said and "rank files checked by its record" in said
    tp0 = path / "tp_0.pt"
    keep_mtime_and_write(tp0, tp0.read_bytes())  # the same bytes, rewritten: only the ctime (and inode?) moved
    said = again()
    assert source.fetched == [] and "rank files checked hashed" in said  # hashed again, and its record rewritten
    assert "checked by its record" in again()
    good = tp0.read_bytes()
    keep_mtime_and_write(tp0, good[:100] + bytes([good[100] ^ 1]) + good[101:])  # a flipped bit, same size and mtime
    said = again()
    assert "no longer matches its manifest" in said and source.fetched == [f"{VARIANT}/manifest.json",
                                                                           f"{VARIANT}/{archive}"]
    assert tp0.read_bytes() == good


def test_verify_full_hashes_a_pulled_version_its_record_vouches_for(repo, tmp_path, caplog):
    folder, _ = repo
    version, source, dest = cpu_version(folder), Counted(folder), tmp_path / "cache"
    path = pull(source, version, dest, None, True)
    source.fetched.clear()
    with caplog.at_level("INFO", logger="pipeline"):
        assert pull(source, version, dest, None, True, verify_full=True) == path
    assert source.fetched == [] and "rank files checked hashed" in caplog.text


def test_a_version_pulled_from_another_archive_is_refused_and_left_as_it_is(repo, tmp_path):
    folder, _ = repo
    version, source, dest = cpu_version(folder), Counted(folder), tmp_path / "cache"
    path = pull(source, version, dest, None, True)
    # As if an earlier pull had taken other bytes under this version's name, from another commit.
    other = replace(Pulled.read(pulled_beside(path)), archive_sha256="0" * 64, commit="f" * 40)
    other.write(pulled_beside(path))
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(IntegrityError, match=r"A version names one set of bytes.*pull into another --dest"):
        pull(source, version, dest, None, True)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert Pulled.read(pulled_beside(path)) == other


def test_offline_pull_takes_only_what_the_cache_holds(repo, tmp_path):
    folder, _ = repo
    version, dest = cpu_version(folder), str(tmp_path / "cache")
    empty = cli("pull", "no-such/repository", VARIANT, "--offline", "--allow-unsigned", "--dest", dest)
    assert empty.returncode == 1 and f"holds no pulled version '{VARIANT}'" in empty.stderr
    assert "pull it without --offline first" in empty.stderr
    pulled = cli("pull", str(folder), version, "--allow-unsigned", "--dest", dest)
    assert pulled.returncode == 0, pulled.stderr
    got = cli("pull", "no-such/repository", VARIANT, "--offline", "--allow-unsigned", "--dest", dest)
    assert got.returncode == 0 and got.stdout == pulled.stdout, got.stderr
    assert f"offline, {VARIANT} resolves to {version}, the version of that variant pulled last" in got.stderr
    assert "nothing downloaded" in got.stderr
    unsigned = cli("pull", "no-such/repository", version, "--offline", "--dest", dest)
    assert unsigned.returncode == 1 and "is not signed" in unsigned.stderr  # the signing policy holds offline too


def test_serve_restarted_offline_serves_the_cached_version(validated_512_fp32, tmp_path):
    """A server restarted with no source to ask (a Hub that is down, say) serves the version in its cache, checked
    by its record. Here, not in test_serve.py: serve's own behaviour across versions is tested there, and this is the
    cache's (one server start, in make test only)."""
    from .test_serve import Server

    folder, weights = validated_512_fp32 / "published", validated_512_fp32 / "gemma4_tiny" / "weights"
    version = cpu_version(folder)
    assert cli("pull", str(folder), version, "--allow-unsigned", "--dest", str(tmp_path)).returncode == 0
    restarted = Server((folder, weights, version), tmp_path, source=["no-such/repository", VARIANT, "--dest",
                                                                     str(tmp_path), "--allow-unsigned", "--offline"])
    try:
        restarted.wait_ready()
        said = restarted.log.read_text()
        assert "nothing downloaded" in said and "verified (rank files checked by its record)" in said, said
        assert restarted.get("/v1/models").json()["data"][0]["id"] == version
    finally:
        assert restarted.stop() == 0


def test_the_same_version_from_another_source_is_checked_against_it_not_taken_on_trust(repo, tmp_path):
    folder, _ = repo
    version, dest = cpu_version(folder), tmp_path / "cache"
    mirror = tmp_path / "mirror"
    shutil.copytree(folder, mirror)  # the same commits: only the record's source tells them apart
    path = pull(Counted(folder), version, dest, None, True)
    source = Counted(mirror)
    assert pull(source, version, dest, None, True) == path
    assert source.fetched == [f"{VARIANT}/manifest.json"]  # its manifest read and compared; the archive not again
    assert Pulled.read(pulled_beside(path)).source == str(mirror.resolve())


def test_files_another_user_could_change_are_hashed_every_time(repo, tmp_path, caplog):
    folder, _ = repo
    version, source, dest = cpu_version(folder), Counted(folder), tmp_path / "cache"
    path = pull(source, version, dest, None, True)
    (path / "tp_0.pt").chmod(0o646)  # world-writable
    with caplog.at_level("INFO", logger="pipeline"):
        pull(source, version, dest, None, True)
    assert "tp_0.pt could be changed by another user" in caplog.text and "rank files checked hashed" in caplog.text


def test_an_edited_manifest_beside_a_pulled_version_is_replaced_by_the_published_one(repo, tmp_path, caplog):
    folder, _ = repo
    version, source, dest = cpu_version(folder), Counted(folder), tmp_path / "cache"
    path = pull(source, version, dest, None, True)
    published = manifest_beside(path).read_bytes()
    edited = json.loads(published)
    edited["created_by"] = "someone else"
    manifest_beside(path).write_text(json.dumps(edited))
    source.fetched.clear()
    with caplog.at_level("INFO", logger="pipeline"):
        assert pull(source, version, dest, None, True) == path
    assert "is not the one pulled with it; fetching it again" in caplog.text
    assert manifest_beside(path).read_bytes() == published and source.fetched == [f"{VARIANT}/manifest.json"]


def test_a_record_left_behind_is_removed_before_the_version_is_unpacked_again(repo, tmp_path, monkeypatch):
    """The rank directory removed by hand, its record left (of another archive, from another commit): pulled again and
    interrupted before the new record is written, the next pull hashes the directory instead of refusing it."""
    from pipeline.cli import pull as pull_module

    folder, _ = repo
    version, dest = cpu_version(folder), tmp_path / "cache"
    path = pull(LocalSource(folder), version, dest, None, True)
    shutil.rmtree(path)
    replace(Pulled.read(pulled_beside(path)), archive_sha256="0" * 64, commit="f" * 40).write(pulled_beside(path))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pull_module.pulled, "record", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pull(LocalSource(folder), version, dest, None, True)
    monkeypatch.undo()
    assert path.is_dir() and not pulled_beside(path).exists()
    assert pull(LocalSource(folder), version, dest, None, True) == path
    assert Pulled.read(pulled_beside(path)).archive_sha256 == Manifest.read(manifest_beside(path)).archive.sha256


def test_two_versions_that_unpack_to_one_directory_do_not_share_a_folder(repo, tmp_path):
    folder, built = repo  # the fixture's neuron versions reuse the cpu build's archive, and so its directory name
    dest = tmp_path / "cache"
    path = pull(LocalSource(folder), cpu_version(folder), dest, None, True)
    with pytest.raises(IntegrityError, match=rf"holds {cpu_version(folder)}.*{built[OLDER]} unpacks to the same "
                                             r"directory.*pull it into another --dest"):
        pull(LocalSource(folder), built[OLDER], dest, None, True)
    assert Pulled.read(pulled_beside(path)).version == cpu_version(folder)


# -- the signed index: rollback, freeze, expiry, mix-and-match (docs/reliability.md, "The registry") ------------------

def signed_versions(folder: Path, validated: Path, times: list[str], private: str, monkeypatch) -> list[str]:
    """Signed cpu versions of the variant published into a new repository ``folder``, one per publish time."""
    LocalRepo(folder).ensure()
    dist = validated / "gemma4_tiny" / VARIANT / "dist"
    base = Manifest.read(dist / "manifest.json")
    versions = []
    for n, when in enumerate(times, start=1):
        manifest = replace(base, version=f"{VARIANT}-{base.compiler.id}-{str(n) * 8}",
                           signature=SignatureFile("manifest.sig"))
        publish_as(folder, dist / base.archive.name, manifest, when, monkeypatch, private)
        versions.append(manifest.version)
    return versions


@pytest.fixture
def signed_repo(validated_512_fp32, tmp_path, monkeypatch) -> tuple[Path, list[str], str, str]:
    """Two signed versions of the variant, the second published later: ``(folder, [older, newer], private, public)``."""
    private, public = keypair(tmp_path / "keys")
    folder = tmp_path / "signed"
    versions = signed_versions(folder, validated_512_fp32, [later(1), later(2)], private, monkeypatch)
    return folder, versions, private, public


def pull_signed(folder: Path, name: str, public: str, dest: Path, *extra: str) -> subprocess.CompletedProcess:
    return cli("pull", str(folder), name, "--public-key", public, "--dest", str(dest), *extra)


def test_an_older_signed_index_served_again_is_refused(signed_repo, tmp_path):
    folder, (older, newer), _, public = signed_repo
    local = LocalRepo(folder)
    first = pull_signed(folder, VARIANT, public, tmp_path / "a")
    assert first.returncode == 0 and f"resolves to {newer}" in first.stderr, first.stderr
    # A new commit restoring the older index and its valid signature (it took the older build, exit 0).
    at_older = local.tags()[older]
    local.commit({layout.INDEX: local.read(at_older, layout.INDEX),
                  layout.INDEX_SIGNATURE: local.read(at_older, layout.INDEX_SIGNATURE)}, [], "restore", local.head())
    restored = pull_signed(folder, VARIANT, public, tmp_path / "b")
    assert restored.returncode == 1, restored.stderr
    assert "index_version 1, older than the 2 this client already trusted" in restored.stderr
    assert "rolled back" in restored.stderr and "Traceback" not in restored.stderr
    # The branch reset to the older commit, the tags kept: the same.
    local.git("reset", "-q", "--hard", at_older)
    reset = pull_signed(folder, VARIANT, public, tmp_path / "c")
    assert reset.returncode == 1 and "older than the 2 this client already trusted" in reset.stderr, reset.stderr
    assert not any(p.name != ".locks" for d in ("b", "c") for p in (tmp_path / d).iterdir())


def test_a_withheld_newest_version_is_named_not_skipped(signed_repo, tmp_path):
    folder, (older, newer), _, public = signed_repo
    LocalRepo(folder).git("tag", "-d", newer)  # a freeze: the newest withheld (it took the older with a warning)
    frozen = pull_signed(folder, VARIANT, public, tmp_path / "a")
    assert frozen.returncode == 1, frozen.stderr
    assert f"lists {newer}" in frozen.stderr and "has no tag for it" in frozen.stderr and "freeze" in frozen.stderr
    named = pull_signed(folder, older, public, tmp_path / "b")  # the older one, named, is taken
    assert named.returncode == 0, named.stderr
    listed = cli("versions", str(folder), "--public-key", public)
    assert listed.returncode == 0
    assert f"{newer}: the signed index lists it, but the repository has no tag" in listed.stdout


def test_an_expired_index_is_refused_until_refreshed_or_named(validated_512_fp32, tmp_path, monkeypatch):
    private, public = keypair(tmp_path / "keys")
    folder = tmp_path / "artifacts" / "published"
    ten_days_ago = (datetime.now(timezone.utc) - timedelta(days=10)).strftime(index.TIME_FORMAT)
    (version,) = signed_versions(folder, validated_512_fp32, [ten_days_ago], private, monkeypatch)
    monkeypatch.undo()
    expired = pull_signed(folder, VARIANT, public, tmp_path / "a")
    assert expired.returncode == 1 and "expired at" in expired.stderr and "--allow-expired" in expired.stderr
    assert pull_signed(folder, VARIANT, public, tmp_path / "b", "--allow-expired").returncode == 0
    refresh = cli("refresh-index", f"artifacts_dir={tmp_path / 'artifacts'}", f"package.signing.private_key={private}")
    assert refresh.returncode == 0 and "written again" in refresh.stderr, refresh.stderr
    assert head_index(folder).index_version == 2 and not head_index(folder).expired()
    fresh = pull_signed(folder, VARIANT, public, tmp_path / "c")
    assert fresh.returncode == 0 and f"resolves to {version}" in fresh.stderr, fresh.stderr
    again = cli("refresh-index", f"artifacts_dir={tmp_path / 'artifacts'}", f"package.signing.private_key={private}")
    assert again.returncode == 0 and "fresh enough, nothing to do" in again.stderr  # no commit while half is left


def test_refresh_index_with_nothing_published_creates_nothing_and_an_unreadable_index_is_an_error(tmp_path):
    """A host that never published (the scheduled rebuild on a second host with publish=local) has nothing that can
    expire: refresh-index says so and exits 0 without creating the repository; an index this release cannot read is
    the publisher's to replace, an error."""
    artifacts = tmp_path / "artifacts"
    nothing = cli("refresh-index", f"artifacts_dir={artifacts}")
    assert nothing.returncode == 0 and "(nothing published yet): nothing to refresh" in nothing.stderr, nothing.stderr
    assert not (artifacts / "published").exists()
    repo = LocalRepo(artifacts / "published")
    repo.ensure()
    repo.commit({layout.INDEX: b'{"schema": "an older one"}'}, [], "an index of another release", repo.head())
    unreadable = cli("refresh-index", f"artifacts_dir={artifacts}")
    assert unreadable.returncode == 1 and f"holds no {layout.INDEX} this release reads" in unreadable.stderr


def test_a_version_older_than_one_already_taken_must_be_named(signed_repo, tmp_path):
    folder, (older, newer), _, public = signed_repo
    assert pull_signed(folder, newer, public, tmp_path / "a").returncode == 0
    refused = pull_signed(folder, older, public, tmp_path / "b")
    assert refused.returncode == 1 and f"--allow-older {older}" in refused.stderr, refused.stderr
    wrong_name = pull_signed(folder, older, public, tmp_path / "c", "--allow-older", newer)
    assert wrong_name.returncode == 1
    named = pull_signed(folder, older, public, tmp_path / "d", "--allow-older", older)
    assert named.returncode == 0, named.stderr


def test_a_manifest_other_than_the_one_the_signed_index_names_is_refused(signed_repo, tmp_path):
    folder, (older, newer), private, public = signed_repo
    local = LocalRepo(folder)
    mixed = json.loads(local.read(local.head(), layout.INDEX))
    for row in mixed["versions"]:  # the publisher's key signs an index naming other manifest bytes for a version
        if row["version"] == newer:
            row["manifest_sha256"] = "0" * 64
    data = (json.dumps(mixed, indent=2, sort_keys=True) + "\n").encode()
    local.commit({layout.INDEX: data, layout.INDEX_SIGNATURE: index.signature(data, private)}, [], "mixed",
                 local.head())
    got = pull_signed(folder, newer, public, tmp_path / "a")
    assert got.returncode == 1 and "is not the manifest the signed index names" in got.stderr, got.stderr


def test_an_unsigned_row_never_decides_what_the_manifest_would_not(repo, tmp_path):
    """A forged 'torch 99.0' in the cpu version's row made pull skip it without reading its manifest (and, on a host
    without Neuron, find no version at all); the manifest decides."""
    folder, _ = repo
    local = LocalRepo(folder)
    forged = json.loads(local.read(local.head(), layout.INDEX))
    for row in forged["versions"]:
        if row["backend"] == "cpu":
            row["toolchain"]["packages"]["torch"]["version"] = "99.0"
    local.commit({layout.INDEX: (json.dumps(forged) + "\n").encode()}, [], "forged", local.head())
    got = cli("pull", str(folder), VARIANT, "--allow-unsigned", "--dest", str(tmp_path / "a"))
    assert got.returncode == 0 and "-cpu-torch" in got.stdout, got.stderr
