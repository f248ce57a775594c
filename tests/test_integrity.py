"""Packaging and integrity: deterministic archives; corrupted, malicious and mismatched artifacts refused before
extraction or before load, the destination untouched, and torch.jit.load never reached; signatures; pull."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.artifact import signing
from pipeline.artifact.archive import FORMATS, Packed, extract_verified, pack, verify_build
from pipeline.artifact.manifest import SCHEMA_VERSION, ArchiveFile, Manifest
from pipeline.core.build_records import Member
from pipeline.core.errors import ConfigError, IntegrityError, PipelineError
from pipeline.core.fsutil import sha256_bytes, sha256_file
from pipeline.core.records import encode
from pipeline.paths import Paths

from .helpers import CPU_COMPILER, CPU_TOOLCHAIN, FAST_VALIDATE, config, run

ROOT = f"gemma4_tiny-512_fp32-{CPU_COMPILER}"


def rank_dir(tmp_path: Path, sizes=(300_000, 300_001)) -> Path:
    src = tmp_path / "build"
    src.mkdir()
    for rank, size in enumerate(sizes):
        (src / f"tp_{rank}.pt").write_bytes(os.urandom(size))
    return src


def manifest_for(packed: Packed, tp_degree: int = 2) -> Manifest:
    """A schema-valid manifest around ``packed`` (what the package stage writes)."""
    return Manifest.from_json({
        "schema_version": SCHEMA_VERSION, "version": f"512_fp32-{CPU_COMPILER}", "fingerprint": "0" * 64,
        "model": {"name": "gemma4_tiny", "hub_id": None, "revision": None, "config_digest": "c", "weights_digest": "w"},
        "variant": {"name": "512_fp32", "kv_max": 512, "bucket": 128, "dtype": "fp32", "prefill": "device",
                    "tp_degree": tp_degree},
        "backend": "cpu", "compiler": {"id": CPU_COMPILER, "args": [], "versions": {}}, "toolchain": CPU_TOOLCHAIN,
        "layout": "per_rank", "members": encode(packed.members), "archive": encode(packed.archive),
    }, "the test's manifest")


def packed(tmp_path: Path, fmt: str = "tar.zst") -> tuple[Path, Manifest]:
    src = rank_dir(tmp_path)
    out = tmp_path / f"a.{fmt}"
    return out, manifest_for(pack(src, ["tp_0.pt", "tp_1.pt"], ROOT, out, fmt))


def untouched(dest: Path) -> None:
    assert not dest.exists()
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.tmp-")]


# -- deterministic, one-pass archives --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_same_inputs_give_the_same_archive_bytes(tmp_path, fmt):
    src = rank_dir(tmp_path)
    a = pack(src, ["tp_0.pt", "tp_1.pt"], ROOT, tmp_path / "a", fmt, threads=1)
    b = pack(src, ["tp_1.pt", "tp_0.pt"], ROOT, tmp_path / "b", fmt, threads=2)  # order and threads do not matter
    assert a.archive.sha256 == b.archive.sha256 == sha256_file(tmp_path / "a")
    assert a.members == tuple(Member(f"tp_{r}.pt", (src / f"tp_{r}.pt").stat().st_size, sha256_file(src / f"tp_{r}.pt"))
                              for r in (0, 1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_through_verified_extraction(tmp_path, fmt):
    archive, manifest = packed(tmp_path, fmt)
    dest = tmp_path / "out"
    build = extract_verified(archive, manifest, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["tp_0.pt", "tp_1.pt"]
    assert (dest / "tp_1.pt").read_bytes() == (tmp_path / "build" / "tp_1.pt").read_bytes()
    build.recheck()


def test_a_gzip_archive_is_what_tar_xzf_unpacks(tmp_path):
    archive, _ = packed(tmp_path, "tar.gz")
    (tmp_path / "x").mkdir()
    subprocess.run(["tar", "xzf", str(archive), "-C", str(tmp_path / "x")], check=True)
    assert sorted(p.name for p in (tmp_path / "x" / ROOT).iterdir()) == ["tp_0.pt", "tp_1.pt"]


# -- corrupted archives ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["flip_middle", "truncate"])
def test_corrupted_archives_are_refused_before_extraction(tmp_path, damage):
    archive, manifest = packed(tmp_path)
    data = bytearray(archive.read_bytes())
    if damage == "flip_middle":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    archive.write_bytes(bytes(data))
    dest = tmp_path / "out"
    with pytest.raises(IntegrityError, match="archive .* has (sha256|[0-9]+ bytes)"):
        extract_verified(archive, manifest, dest)
    untouched(dest)


# -- malicious archives ----------------------------------------------------------------------------------------

def craft(tmp_path: Path, entries: list[tuple[tarfile.TarInfo, bytes | None]],
          members: tuple[Member, ...]) -> tuple[Path, Manifest]:
    """A tar whose archive checksum the manifest does match: only the member allow-list stands in the way."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path = tmp_path / "evil.tar"
    path.write_bytes(buf.getvalue())
    return path, manifest_for(Packed(members, ArchiveFile(path.name, "tar", path.stat().st_size, sha256_file(path),
                                                          ROOT)))


def info(name: str, kind=tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    i = tarfile.TarInfo(name)
    i.type, i.size, i.linkname = kind, size, link
    return i


def ok_members(data: bytes = b"x" * 10) -> tuple[Member, ...]:
    return tuple(Member(f"tp_{r}.pt", len(data), sha256_bytes(data)) for r in (0, 1))


GOOD = [(info(f"{ROOT}/tp_0.pt", size=10), b"x" * 10), (info(f"{ROOT}/tp_1.pt", size=10), b"x" * 10)]
MALICIOUS = {
    "traversal": ([(info(f"{ROOT}/../tp_0.pt", size=10), b"x" * 10)] + GOOD[1:], "leaves its directory"),
    "absolute": ([(info("/tmp/tp_0.pt", size=10), b"x" * 10)] + GOOD[1:], "absolute or unsafe name"),
    "symlink": ([(info(f"{ROOT}/tp_0.pt", tarfile.SYMTYPE, link="/etc/passwd"), None)] + GOOD[1:], "is a link"),
    "hardlink": (GOOD[:1] + [(info(f"{ROOT}/tp_1.pt", tarfile.LNKTYPE, link=f"{ROOT}/tp_0.pt"), None)], "is a link"),
    "device": ([(info(f"{ROOT}/tp_0.pt", tarfile.CHRTYPE), None)] + GOOD[1:], "device, fifo or other special file"),
    "extra_member": (GOOD + [(info(f"{ROOT}/notes.txt", size=2), b"hi")], "not one of the expected files"),
    "oversized_member": ([(info(f"{ROOT}/tp_0.pt", size=11), b"x" * 11)] + GOOD[1:], "larger than the 10"),
    "duplicate": (GOOD + [(info(f"{ROOT}/tp_0.pt", size=10), b"y" * 10)], "appears twice"),
    "other_directory": ([(info("elsewhere", tarfile.DIRTYPE), None)] + GOOD, "unexpected directory"),
    "missing_member": (GOOD[:1], r"lacks members \['tp_1.pt'\]"),
}


@pytest.mark.parametrize("kind", sorted(MALICIOUS))
def test_malicious_archives_are_refused_and_nothing_is_written(tmp_path, kind):
    entries, message = MALICIOUS[kind]
    archive, manifest = craft(tmp_path, entries, ok_members())
    dest = tmp_path / "out"
    with pytest.raises(IntegrityError, match=message):
        extract_verified(archive, manifest, dest)
    untouched(dest)


# -- mismatched manifests ----------------------------------------------------------------------------------------

def mutate(manifest: Manifest, kind: str) -> dict:
    m = copy.deepcopy(manifest.to_json())
    if kind == "missing_rank":
        m["members"] = m["members"][:1]
    elif kind == "extra_rank":
        m["members"].append(dict(m["members"][0], path="tp_2.pt"))
    elif kind == "wrong_tp_degree":
        m["variant"]["tp_degree"] = 4
    elif kind == "wrong_schema":
        m["schema_version"] = 99
    elif kind == "missing_field":
        del m["archive"]["sha256"]
    return m


@pytest.mark.parametrize(("kind", "message"), [
    ("missing_rank", r"members \['tp_0.pt'\] do not match tp_degree=2"),
    ("extra_rank", r"do not match tp_degree=2"),
    ("wrong_tp_degree", r"do not match tp_degree=4"),
    ("wrong_schema", "schema_version 99"),
    ("missing_field", "missing field archive.sha256"),
])
def test_mismatched_manifests_are_refused_when_read(tmp_path, kind, message):
    archive, manifest = packed(tmp_path)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(mutate(manifest, kind)))
    with pytest.raises(IntegrityError, match=message):
        Manifest.read(path)


def test_a_member_with_a_wrong_sha256_is_refused_and_removed(tmp_path):
    archive, manifest = packed(tmp_path)
    manifest = replace(manifest, members=(manifest.members[0], replace(manifest.members[1], sha256="f" * 64)))
    dest = tmp_path / "out"
    with pytest.raises(IntegrityError, match=r"archive member '.*tp_1.pt' does not match the manifest"):
        extract_verified(archive, manifest, dest)
    untouched(dest)


def test_a_file_changed_after_verification_is_not_loaded(tmp_path):
    src = rank_dir(tmp_path)
    build = verify_build(src, tuple(Member(p.name, p.stat().st_size, sha256_file(p)) for p in sorted(src.iterdir())))
    (src / "tp_1.pt").write_bytes(b"swapped in after the check")
    with pytest.raises(IntegrityError, match="changed after it was verified"):
        build.recheck()


# -- signing ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[str, str, str]:
    """(private, public, another public) PEM paths."""
    d = tmp_path_factory.mktemp("keys")
    for name in ("a", "b"):
        subprocess.run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(d / name)],
                       check=True, capture_output=True)
        subprocess.run(["openssl", "ec", "-in", str(d / name), "-pubout", "-out", str(d / f"{name}.pub")],
                       check=True, capture_output=True)
    return str(d / "a"), str(d / "a.pub"), str(d / "b.pub")


def signed_dist(tmp_path: Path, private: str) -> tuple[Path, Manifest]:
    archive, manifest = packed(tmp_path)
    dist = tmp_path / "dist"
    dist.mkdir()
    shutil.move(archive, dist / archive.name)
    manifest.write(dist / "manifest.json")
    signing.sign(dist, archive.name, private)
    return dist, manifest


@pytest.mark.parametrize("tamper", ["manifest_member_sha", "archive_and_manifest", "extra_file", "wrong_key", "none"])
def test_a_tampered_signed_artifact_is_refused(tmp_path, keys, tamper):
    private, public, other = keys
    dist, manifest = signed_dist(tmp_path, private)
    key = other if tamper == "wrong_key" else public
    if tamper == "manifest_member_sha":  # point a member at an attacker's file
        replace(manifest, members=(replace(manifest.members[0], sha256="a" * 64), *manifest.members[1:])).write(
            dist / "manifest.json")
    elif tamper == "archive_and_manifest":  # swap the archive and reseal the manifest without the key
        archive = dist / manifest.archive.name
        archive.write_bytes(archive.read_bytes()[::-1])
        replace(manifest, archive=replace(manifest.archive, sha256=sha256_file(archive))).write(dist / "manifest.json")
    elif tamper == "extra_file":
        (dist / "README").write_text("unsigned")
    if tamper == "none":
        assert signing.check(dist, manifest.archive.name, key, False, "artifact") == "verified"
        return
    with pytest.raises(IntegrityError, match="signature check .* failed: (Signature|Key) mismatch"):
        signing.check(dist, manifest.archive.name, key, False, "artifact")


def test_unsigned_artifacts_pass_only_when_allowed(tmp_path):
    archive, manifest = packed(tmp_path)
    with pytest.raises(IntegrityError, match="is not signed: give the public key"):
        signing.check(tmp_path, archive.name, None, False, "artifact")
    assert signing.check(tmp_path, archive.name, None, True, "artifact") == "unsigned (allowed)"


# -- through the stages: refused before load -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def signed_project(tmp_path_factory, keys) -> Path:
    root = tmp_path_factory.mktemp("signed") / "artifacts"
    run(config(root, *FAST_VALIDATE, f"package.signing.private_key={keys[0]}", "package.signing.allow_unsigned=false"))
    return root


def forbid_loading(monkeypatch) -> None:
    """Any attempt to start rank processes or load TorchScript fails the test."""
    import torch

    from pipeline.backends import ranks

    def refuse(*args, **kwargs):
        pytest.fail("a rank was about to be loaded")

    monkeypatch.setattr(torch.jit, "load", refuse)
    monkeypatch.setattr(ranks, "RankGroup", refuse)


@pytest.mark.parametrize("tamper", ["flip_archive_byte", "edit_manifest", "remove_signature"])
def test_validate_refuses_a_tampered_artifact_before_loading(signed_project, tmp_path, keys, monkeypatch, tamper):
    from pipeline.stages import validate

    root = tmp_path / "artifacts"
    shutil.copytree(signed_project, root, ignore=shutil.ignore_patterns("logs", "published"))
    cfg = config(root, *FAST_VALIDATE, f"package.signing.private_key={keys[0]}", "package.signing.allow_unsigned=false",
                 "force=true")
    dist = Paths.of(cfg).dist
    manifest = Manifest.read(dist / "manifest.json")
    if tamper == "flip_archive_byte":
        archive = dist / manifest.archive.name
        data = bytearray(archive.read_bytes())
        data[len(data) // 2] ^= 1
        archive.write_bytes(bytes(data))
        expected = "has sha256"
    elif tamper == "edit_manifest":
        replace(manifest, compiler=replace(manifest.compiler, args=("--innocent",))).write(dist / "manifest.json")
        expected = "Signature mismatch"
    else:
        (dist / signing.SIGNATURE).unlink()
        expected = "has no manifest.sig"
    forbid_loading(monkeypatch)
    if tamper == "flip_archive_byte":  # the signature still holds: the validation job's own checks stop it
        from pipeline.validation.worker import run_job

        # In this process, where loading is forbidden.
        monkeypatch.setattr(validate, "run_fresh", lambda job, host=None, need=None, env=None: run_job(job))
    with pytest.raises(IntegrityError, match=expected):
        run(cfg, "validate")


def test_a_build_directory_with_stray_files_is_refused(signed_project, tmp_path, keys):
    root = tmp_path / "artifacts"
    shutil.copytree(signed_project, root, ignore=shutil.ignore_patterns("logs", "published"))
    cfg = config(root, *FAST_VALIDATE, f"package.signing.private_key={keys[0]}", "force=true")
    (Paths.of(cfg).build / "notes.txt").write_text("not a rank")
    with pytest.raises(IntegrityError, match=r"build holds \['notes.txt', 'tp_0.pt', 'tp_1.pt'\].*remove the stray"):
        run(cfg, "package")


def test_a_rank_file_changed_after_the_trace_is_refused_by_package_and_nothing_is_replaced(signed_project, tmp_path,
                                                                                           keys):
    """package reads each rank file once, hashing it as it packs: a byte changed since the trace is named (file, both
    sha256s, the stage to rerun) and the archive already in dist/ is left as it was."""
    root = tmp_path / "artifacts"
    shutil.copytree(signed_project, root, ignore=shutil.ignore_patterns("logs", "published"))
    cfg = config(root, *FAST_VALIDATE, f"package.signing.private_key={keys[0]}", "force=true")
    paths = Paths.of(cfg)
    before = {p.name: p.read_bytes() for p in paths.dist.iterdir()}
    rank = paths.build / "tp_1.pt"
    data = bytearray(rank.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"tp_1.pt read with sha256 [0-9a-f]{64}, build.json says [0-9a-f]{64}; "
                                             r"it was changed after the trace \(rerun stage=trace force=true\)"):
        run(cfg, "package")
    assert {p.name: p.read_bytes() for p in paths.dist.iterdir()} == before


def test_unknown_formats_and_unreadable_keys_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"package.format='rar' is not one of \['tar.zst', 'tar.gz', 'tar'\]"):
        config(tmp_path, "package.format=rar")
    with pytest.raises(ConfigError, match=r"package.signing.private_key='/no/such/key.pem' cannot be read .* openssl"):
        config(tmp_path, "package.signing.private_key=/no/such/key.pem")
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(ConfigError, match=r"package.signing.public_key='.*junk.pem' is not a PEM public key"):
        config(tmp_path, f"package.signing.public_key={tmp_path / 'junk.pem'}")


# -- pull ------------------------------------------------------------------------------------------------------------

def published_version(project: Path) -> str:
    return Manifest.read(Paths(project, "gemma4_tiny", "512_fp32").manifest).version


def pull_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "pull", *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300)


def test_pull_verifies_and_unpacks_a_published_version(signed_project, tmp_path, keys):
    version = published_version(signed_project)
    proc = pull_cli(str(signed_project / "published"), version, "--dest", str(tmp_path), "--public-key", keys[1])
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path == tmp_path / f"gemma4_tiny-{version}"
    assert sorted(p.name for p in path.iterdir()) == ["tp_0.pt", "tp_1.pt"]
    manifest = Manifest.read(Paths(signed_project, "gemma4_tiny", "512_fp32").manifest)
    assert [sha256_file(path / m.path) for m in manifest.members] == [m.sha256 for m in manifest.members]
    again = pull_cli(str(signed_project / "published"), version, "--dest", str(tmp_path), "--public-key", keys[1])
    assert again.returncode == 0 and Path(again.stdout.strip()) == path  # idempotent
    # No downloads left behind; the manifest and its signature sit beside the rank directory, not in it, byte for byte
    # as published, with pull's record of the rank files (pipeline/artifact/pulled.py) and the lock folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", path.name, path.name + ".manifest.json",
                                                          path.name + ".manifest.sig", path.name + ".pulled.json"]
    for published_name, beside in (("manifest.json", ".manifest.json"), ("manifest.sig", ".manifest.sig")):
        published = subprocess.run(["git", "show", f"{version}:512_fp32/{published_name}"],
                                   cwd=signed_project / "published", capture_output=True, check=True).stdout
        assert (tmp_path / (path.name + beside)).read_bytes() == published
    by_variant = pull_cli(str(signed_project / "published"), "512_fp32", "--dest", str(tmp_path), "--public-key",
                          keys[1])
    assert by_variant.returncode == 0 and Path(by_variant.stdout.strip()) == path, by_variant.stderr
    assert f"512_fp32 resolves to {version}, the newest published version of that variant" in by_variant.stderr


def test_a_signature_kept_beside_a_pulled_version_that_fails_is_fetched_again(signed_project, tmp_path, keys):
    repo, version = str(signed_project / "published"), published_version(signed_project)
    path = Path(pull_cli(repo, version, "--dest", str(tmp_path), "--public-key", keys[1]).stdout.strip())
    kept = tmp_path / (path.name + ".manifest.sig")
    published = kept.read_bytes()
    kept.write_bytes(b"not a signature")
    again = pull_cli(repo, version, "--dest", str(tmp_path), "--public-key", keys[1])
    assert again.returncode == 0 and "fails" in again.stderr and "fetching it again" in again.stderr, again.stderr
    assert kept.read_bytes() == published and Path(again.stdout.strip()) == path
    wrong = pull_cli(repo, version, "--dest", str(tmp_path), "--public-key", keys[2])  # the published one fails too
    assert wrong.returncode == 1 and "Key mismatch" in wrong.stderr


def test_pull_refuses_wrong_keys_unknown_versions_and_foreign_directories(signed_project, tmp_path, keys):
    repo, version = str(signed_project / "published"), published_version(signed_project)
    wrong = pull_cli(repo, version, "--dest", str(tmp_path), "--public-key", keys[2])
    assert wrong.returncode == 1 and "Key mismatch" in wrong.stderr
    unsigned = pull_cli(repo, version, "--dest", str(tmp_path))
    assert unsigned.returncode == 1 and "is signed but no public key was given" in unsigned.stderr
    unknown = pull_cli(repo, "512_fp32-ncc9", "--dest", str(tmp_path), "--public-key", keys[1])
    assert unknown.returncode == 1 and "has no version or variant '512_fp32-ncc9'" in unknown.stderr
    assert version in unknown.stderr
    occupied = tmp_path / f"gemma4_tiny-{version}"
    occupied.mkdir()
    (occupied / "tp_0.pt").write_bytes(b"something else")
    taken = pull_cli(repo, version, "--dest", str(tmp_path), "--public-key", keys[1])
    assert taken.returncode == 1 and "holds ['tp_0.pt'], expected exactly" in taken.stderr
    assert (occupied / "tp_0.pt").read_bytes() == b"something else"


def test_pull_through_python_rejects_a_tag_to_the_wrong_manifest(signed_project, tmp_path, keys):
    from pipeline.cli.pull import LocalSource, pull

    source = LocalSource(signed_project / "published")
    version = published_version(signed_project)
    source.repo.tag("512_fp32-cpu-torch9.9.9-00000000", source.tags()[version])  # names another version
    # With the key, the signed index decides: it lists no such version.
    with pytest.raises(PipelineError, match="signed index .* has no version or variant '512_fp32-cpu-torch9.9.9-0"):
        pull(source, "512_fp32-cpu-torch9.9.9-00000000", tmp_path, keys[1], False)
    # Without it, the tag is taken at its word, and the manifest it leads to refuses it.
    with pytest.raises(PipelineError, match=f"describes '{version}', not '512_fp32-cpu-torch9.9.9-00000000'"):
        pull(source, "512_fp32-cpu-torch9.9.9-00000000", tmp_path, None, True)


@pytest.mark.slow  # a whole build of its own (make test-slow), for make test's budget
def test_generate_runs_a_pulled_version_and_refuses_a_tampered_one(signed_project, tmp_path, keys):
    version = published_version(signed_project)
    pulled = Path(pull_cli(str(signed_project / "published"), version, "--dest", str(tmp_path), "--public-key",
                           keys[1]).stdout.strip())
    weights = signed_project / "gemma4_tiny" / "weights"
    generate = [sys.executable, "-m", "pipeline", "generate", str(pulled), "--checkpoint", str(weights),
                "--prompt", "What is the capital of France?", "--max-new-tokens", "8"]
    ok = subprocess.run(generate, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "26 prompt tokens, 8 new tokens" in ok.stderr
    long = [*generate[:7], "--prompt", "Paris is a city. " * 150]  # about 600 tokens, on a kv_max 512 build
    refused = subprocess.run(long, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "this build's cache holds 512 (variant.kv_max)" in refused.stderr
    assert "Traceback" not in refused.stderr
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for f in weights.iterdir():
        if not f.name.startswith("tokenizer"):
            (bare / f.name).symlink_to(f)
    no_tokenizer = subprocess.run([*generate[:6], str(bare), *generate[7:]], capture_output=True, text=True,
                                  timeout=300)
    assert no_tokenizer.returncode == 1 and "has no tokenizer (tokenizer.json" in no_tokenizer.stderr
    assert "Traceback" not in no_tokenizer.stderr
    (pulled / "tp_1.pt").write_bytes(b"tampered")
    bad = subprocess.run(generate, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "rank file" in bad.stderr and "the manifest says" in bad.stderr


def test_the_cards_usage_block_applies_to_the_version_it_shows(signed_project):
    """The card's commands name the source the version is pulled from, a public key only for a signed version, and
    the files its archive really holds (a device-prefill cpu build holds tp_N.pt, not model.pt)."""
    from pipeline.publishing.card import render

    version = published_version(signed_project)
    shown = subprocess.run(["git", "show", f"{version}:512_fp32/manifest.json"], cwd=signed_project / "published",
                           capture_output=True, text=True, check=True).stdout
    signed = Manifest.from_json(json.loads(shown), "the published manifest")
    assert signed.signature.file == "manifest.sig"
    real = replace(signed, model=replace(signed.model, hub_id="google/gemma-4-E4B-it"))
    card = render([real], "org/gemma-4-E4B-it-inferentia2", "/srv/published")
    assert f"python -m pipeline pull /srv/published {version} --dest /workspace --public-key" in card
    assert f"/workspace/{signed.archive.root}/` holding `tp_0.pt`, `tp_1.pt`" in " ".join(card.split())
    row = next(line for line in card.splitlines() if line.startswith(f"| `{version}`"))
    assert "| `tp_0.pt`, `tp_1.pt` |" in row and row.endswith("| yes |")
    unsigned = render([replace(real, signature=None)], "org/gemma-4-E4B-it-inferentia2")
    assert (f"python -m pipeline pull org/gemma-4-E4B-it-inferentia2 {version} --dest /workspace --allow-unsigned"
            in unsigned)
    assert "--public-key" not in unsigned
