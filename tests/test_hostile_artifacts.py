"""Hostile build directories, signature bundles and archives (issue 49), met through the commands users run.

- With ``--public-key``, every command that serves or generates from a directory checks the signature beside its
  manifest as ``pull --offline`` checks it: a directory whose signature was removed and whose manifest (and a rank
  file) was edited is refused before anything loads.
- A malformed signature bundle (``manifest.sig``, ``versions.sig``) is a one-line ``IntegrityError`` naming it, never a
  traceback: a seeded set of mutations of a real bundle (keys dropped, wrong types, nulls, truncated base64, other
  signature bytes, lists for objects) goes through pull, versions' signed index and serve's loader.
- An archive holding a chain of extended headers (GNU long names, PAX records), corrupt zstd data, or a zstd frame
  asking for a larger window than taken is an ``IntegrityError`` naming the archive (it was a RecursionError or a
  ZstdError).

The repositories are made by the publish stage's own code (tests/test_consumer.py ``signed_versions``) from the shared
tiny build (tests/conftest.py ``validated_512_fp32``), signed with a key made for the module; the hostile files are
written as an attacker with write access to the repository or to the cache folder would write them.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import random
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from pipeline.artifact import signing
from pipeline.artifact.manifest import manifest_beside
from pipeline.artifact.pulled import Pulled, pulled_beside, signature_beside
from pipeline.cli import serve
from pipeline.cli.pull import LocalSource, pull
from pipeline.core.errors import IntegrityError
from pipeline.core.fsutil import sha256_file
from pipeline.publishing import index, layout
from pipeline.publishing.localrepo import LocalRepo

from .test_consumer import keypair, later, signed_versions
from .test_hostile import VARIANT, hostile_commit, left_in, published_copy

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def one_line_refusal(proc: subprocess.CompletedProcess) -> str:
    """The one ERROR line of a command that refused (exit 1, no traceback)."""
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line or line.startswith("ERROR")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@dataclass(frozen=True)
class Signed:
    """A signed repository with one version, that version pulled with the key, and the keys."""

    repo: Path
    version: str
    private: str
    public: str
    other_private: str
    dest: Path
    rank_dir: Path
    checkpoint: Path


@pytest.fixture(scope="module")
def signed(validated_512_fp32, tmp_path_factory) -> Signed:
    folder = tmp_path_factory.mktemp("signed-artifacts")
    private, public = keypair(folder / "keys")
    other_private, _ = keypair(folder / "other-keys")
    with pytest.MonkeyPatch.context() as mp:
        (version,) = signed_versions(folder / "published", validated_512_fp32, [later(1)], private, mp)
    dest = folder / "dest"
    rank_dir = pull(LocalSource(folder / "published"), version, dest, public, False)
    assert signature_beside(rank_dir).is_file()
    return Signed(folder / "published", version, private, public, other_private, dest, rank_dir,
                  validated_512_fp32 / "gemma4_tiny" / "weights")


def forbid_loading(monkeypatch) -> None:
    """Any attempt to start rank processes or load TorchScript fails the test."""
    import torch

    from pipeline.backends import ranks

    def refuse(*args, **kwargs):
        pytest.fail("a rank was about to be loaded")

    monkeypatch.setattr(torch.jit, "load", refuse)
    monkeypatch.setattr(ranks, "RankGroup", refuse)


# -- 3: with a key, a directory is served or generated from only when its signature verifies ----------------------

def tamper(rank_dir: Path, remove_signature: bool) -> None:
    """Make the pulled version ``rank_dir`` hold other bytes as tp_0.pt, its manifest edited to match them (so that the
    rank files verify against it) and pull's record to match the manifest; with ``remove_signature``, delete its
    manifest.sig too: the reported case."""
    payload = b"not the published rank file"
    (rank_dir / "tp_0.pt").write_bytes(payload)
    manifest = json.loads(manifest_beside(rank_dir).read_text())
    for member in manifest["members"]:
        if member["path"] == "tp_0.pt":
            member.update(size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    manifest_beside(rank_dir).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    record = Pulled.read(pulled_beside(rank_dir))
    replace(record, manifest_sha256=sha256_file(manifest_beside(rank_dir))).write(pulled_beside(rank_dir))
    if remove_signature:
        signature_beside(rank_dir).unlink()


def pulled_copy(signed: Signed, tmp_path: Path) -> Path:
    """A copy of the pulled version (and the folder it is in): its rank directory."""
    shutil.copytree(signed.dest, tmp_path / "dest", ignore=shutil.ignore_patterns(".locks"))
    return tmp_path / "dest" / signed.rank_dir.name


def tampered_copy(signed: Signed, tmp_path: Path, remove_signature: bool) -> Path:
    rank_dir = pulled_copy(signed, tmp_path)
    tamper(rank_dir, remove_signature)
    return rank_dir


def serve_loader(rank_dir: Path, signed: Signed, public_key: str):
    """What serve does with a directory before anything loads (its port aside): ``obtain``."""
    args = serve.arguments().parse_args([str(rank_dir), "--checkpoint", str(signed.checkpoint),
                                         "--public-key", public_key])
    return serve.obtain(args)


@pytest.mark.parametrize("remove_signature", [True, False], ids=["signature removed", "signature kept"])
@pytest.mark.parametrize("command", ["pull --offline", "serve", "generate"])
def test_with_a_key_a_tampered_pulled_directory_is_refused_by_every_command(signed, tmp_path, monkeypatch, command,
                                                                           remove_signature):
    """serve DIR --public-key served it (the key was ignored) and generate had no key to check; pull --offline refused
    it. Now each refuses it, naming the signature, before a rank loads."""
    from pipeline.cli.generate import generate

    rank_dir = tampered_copy(signed, tmp_path, remove_signature)
    forbid_loading(monkeypatch)
    said = "has no signature beside it|has no manifest.sig" if remove_signature else "Signature mismatch"
    with pytest.raises(IntegrityError, match=said) as refused:
        if command == "pull --offline":
            pull(None, signed.version, rank_dir.parent, signed.public, False)
        elif command == "serve":
            serve_loader(rank_dir, signed, signed.public)
        else:
            generate(rank_dir, signed.checkpoint, "Hi", 2, None, public_key=signed.public)
    assert "\n" not in str(refused.value)


def test_serve_and_generate_refuse_the_reported_directory_in_one_line(signed, tmp_path):
    rank_dir = tampered_copy(signed, tmp_path, remove_signature=True)
    try:
        served = cli("serve", str(rank_dir), "--public-key", signed.public, "--checkpoint", str(signed.checkpoint),
                     "--port", "0", timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("serve --public-key served a directory whose signature was removed")
    assert f"{rank_dir.name}.manifest.json has no signature beside it" in one_line_refusal(served)
    generated = cli("generate", str(rank_dir), "--public-key", signed.public, "--checkpoint", str(signed.checkpoint),
                    "--prompt", "Hi")
    assert f"{rank_dir.name}.manifest.json has no signature beside it" in one_line_refusal(generated)


def test_serve_refuses_a_manifest_changed_after_its_signature_was_checked(signed, tmp_path, monkeypatch, caplog):
    """The engine reads the manifest file again: one swapped between the check and that read is refused."""
    rank_dir = pulled_copy(signed, tmp_path)
    checked = serve.obtain

    def swapped_after_the_check(args):
        found = checked(args)
        tamper(rank_dir, remove_signature=False)
        return found

    monkeypatch.setattr(serve, "obtain", swapped_after_the_check)
    monkeypatch.setattr(serve, "run_server", lambda *args: pytest.fail("serve went on to serve it"))
    monkeypatch.setattr(serve, "setup", lambda: None)  # the test session's logging stays as it is
    with pytest.raises(SystemExit) as exited:
        serve.main([str(rank_dir), "--public-key", signed.public, "--checkpoint", str(signed.checkpoint), "--port",
                    "0"])
    assert exited.value.code == 1
    assert f"{rank_dir.name}.manifest.json changed after it was checked" in caplog.text


def test_with_the_right_key_a_signed_directory_passes_and_with_another_it_is_refused(signed, tmp_path):
    rank_dir, manifest = serve_loader(signed.rank_dir, signed, signed.public)
    assert rank_dir == signed.rank_dir and manifest.version == signed.version
    _, stranger = keypair(tmp_path / "stranger")
    with pytest.raises(IntegrityError, match="Key mismatch"):
        serve_loader(signed.rank_dir, signed, stranger)


def test_serve_with_the_key_serves_an_intact_signed_directory(signed, tmp_path):
    """The key checked, the directory is served: what the refusals above must not cost."""
    from .test_serve import Server

    rank_dir = pulled_copy(signed, tmp_path)
    server = Server((None, signed.checkpoint, signed.version), tmp_path,
                    source=[str(rank_dir), "--public-key", signed.public])
    try:
        server.wait_ready()
        assert server.get("/v1/models").json()["data"][0]["id"] == signed.version
    finally:
        assert server.stop() == 0, server.log.read_text()


def test_with_a_key_an_unsigned_build_folder_is_refused(validated_512_fp32, signed, monkeypatch):
    """A build folder (artifacts/<model>/<variant>/build) is checked against dist/manifest.sig: the shared build is
    unsigned."""
    from pipeline.cli.generate import generate

    build = validated_512_fp32 / "gemma4_tiny" / VARIANT / "build"
    forbid_loading(monkeypatch)
    with pytest.raises(IntegrityError, match=r"dist/manifest.json has no signature beside it \(manifest.sig\)"):
        serve_loader(build, signed, signed.public)
    with pytest.raises(IntegrityError, match=r"dist/manifest.json has no signature beside it \(manifest.sig\)"):
        generate(build, signed.checkpoint, "Hi", 2, None, public_key=signed.public)


# -- 8: every malformed signature bundle is a one-line refusal ------------------------------------------------------

DROP = object()  # an edit that removes the key


def nodes(value, path=()):
    """Every (path, value) under ``value`` (object keys and list indices), the root left out."""
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in children:
        yield path + (key,), child
        yield from nodes(child, path + (key,))


def edited(bundle: dict, edits: list[tuple[tuple, object]]) -> dict:
    """``bundle`` with each (path, value) set (or the key dropped); an edit whose path no longer exists is skipped."""
    out = copy.deepcopy(bundle)
    for path, value in edits:
        parent = out
        try:
            for key in path[:-1]:
                parent = parent[key]
            if value is DROP:
                del parent[path[-1]]
            else:
                parent[path[-1]] = copy.deepcopy(value)
        except (KeyError, IndexError, TypeError):
            continue
    return out


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bundle_mutations(raw: bytes, foreign: dict, seed: int = 49) -> list[tuple[str, bytes]]:
    """Malformed and forged variants of the signature bundle ``raw``, each (label, bytes), deterministic: every key
    dropped; every value replaced by null, a number, a string, a boolean, an empty list or object, itself in a list or
    an object; every string emptied, truncated (half, and one character: broken base64), spoiled; the signature's bytes
    flipped, random, or another key's (``foreign``, a bundle another key signed); the whole document another JSON
    value, truncated, empty, not UTF-8; and ``seed``'s random pairs of those edits."""
    bundle = json.loads(raw)
    edits: list[tuple[str, list]] = []
    for path, value in nodes(bundle):
        name = ".".join(map(str, path))
        if isinstance(path[-1], str):
            edits.append((f"{name} dropped", [(path, DROP)]))
        for wrong in (None, 0, "x", True, [], {}, [value], {"value": value}):
            edits.append((f"{name} = {json.dumps(wrong)[:40]}", [(path, wrong)]))
        if isinstance(value, str):
            for how, spoiled in (("emptied", ""), ("halved", value[:len(value) // 2]), ("one character short",
                                 value[:-1]), ("with a '!'", value + "!"), ("reversed", value[::-1])):
                edits.append((f"{name} {how}", [(path, spoiled)]))
    sig = ("dsseEnvelope", "signatures", 0, "sig")
    der = bytearray(base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"]))
    der[len(der) // 2] ^= 0x01
    payload = bytearray(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    payload[len(payload) // 2] ^= 0x01
    rng = random.Random(seed)
    edits += [
        ("a bit of the signature flipped", [(sig, b64(bytes(der)))]),
        ("random signature bytes", [(sig, b64(rng.randbytes(71)))]),
        ("another key's signature", [(sig, foreign["dsseEnvelope"]["signatures"][0]["sig"])]),
        ("another key's signature and key hint", [(sig, foreign["dsseEnvelope"]["signatures"][0]["sig"]),
                                                  (("verificationMaterial",), foreign["verificationMaterial"])]),
        ("a bit of the payload flipped", [(("dsseEnvelope", "payload"), b64(bytes(payload)))]),
        ("a second signature before the real one", [(("dsseEnvelope", "signatures"),
                                                     [{"sig": b64(bytes(der)), "keyid": ""},
                                                      *bundle["dsseEnvelope"]["signatures"]])]),
    ]
    out = [(label, json.dumps(edited(bundle, changes)).encode()) for label, changes in edits]
    for _ in range(40):
        (first, a), (second, b) = rng.sample(edits, 2)
        out.append((f"{first}, and {second}", json.dumps(edited(bundle, a + b)).encode()))
    text = raw.decode()
    out += [("{}", b"{}"), ("[]", b"[]"), ("null", b"null"), ("a string", b'"bundle"'), ("a number", b"7"),
            ("an empty file", b""), ("not UTF-8", b"\xff\xfe" + raw), ("truncated", raw[:len(raw) // 2]),
            ("the bundle in a list", json.dumps([bundle]).encode()), ("another key's bundle", json.dumps(foreign)
                                                                     .encode()),
            ("a trailing comma", (text.rstrip().rstrip("}") + ',}').encode())]
    unique = {}
    for label, data in out:
        if data != raw:
            unique.setdefault(data, label)
    return [(label, data) for data, label in unique.items()]


def authentic(data: bytes, raw: bytes) -> bool:
    """Whether ``data`` still carries the signed content and the signature of the real bundle ``raw`` unchanged: only
    such a bundle may be accepted (what else changed carries no authority: a key id, the transparency log entries;
    base64 decoders skip characters outside its alphabet, so the bytes are compared, not their spelling)."""
    def signed_part(doc):
        envelope = doc["dsseEnvelope"]
        return (doc["mediaType"], base64.b64decode(envelope["payload"]), envelope["payloadType"],
                base64.b64decode(envelope["signatures"][0]["sig"]))

    try:
        return signed_part(json.loads(data)) == signed_part(json.loads(raw))
    except (ValueError, KeyError, TypeError, IndexError):
        return False


def foreign_bundle(signed: Signed, tmp_path: Path) -> dict:
    """A bundle of the same manifest signed with another key."""
    folder = tmp_path / "foreign"
    folder.mkdir()
    shutil.copyfile(manifest_beside(signed.rank_dir), folder / signing.MANIFEST)
    return json.loads(signing.sign(folder, "unused.tar.zst", signed.other_private).read_bytes())


def judged_mutations(signed: Signed, tmp_path: Path, raw: bytes, attempt, named: str) -> int:
    """Run ``attempt(data)`` for every mutation of ``raw``: each must be accepted only when authentic, else refused
    with one line naming ``named``. Returns how many were refused; fails listing every one that was not so."""
    mutations = bundle_mutations(raw, foreign_bundle(signed, tmp_path))
    assert len(mutations) > 150
    wrong, refused = [], 0
    for label, data in mutations:
        try:
            attempt(data)
        except IntegrityError as exc:
            refused += 1
            if "\n" in str(exc) or named not in str(exc):
                wrong.append(f"{label}: refused as {str(exc)!r}")
        except Exception as exc:  # noqa: BLE001 - what the test is looking for
            wrong.append(f"{label}: {type(exc).__name__}: {exc}"[:300])
        else:
            if not authentic(data, raw):
                wrong.append(f"{label}: accepted")
    assert not wrong, f"{len(wrong)} of {len(mutations)} mutations:\n" + "\n".join(wrong)
    return refused


def test_every_malformed_manifest_signature_is_refused_in_one_line_by_pull(signed, tmp_path):
    """pull --offline --public-key over the signature kept beside a pulled version (a fetched one is checked by the
    same code: the CLI test below)."""
    dest = tmp_path / "dest"
    shutil.copytree(signed.dest, dest, ignore=shutil.ignore_patterns(".locks"))
    kept = signature_beside(dest / signed.rank_dir.name)
    raw = kept.read_bytes()

    def attempt(data: bytes) -> None:
        kept.write_bytes(data)
        pull(None, signed.version, dest, signed.public, False)

    assert judged_mutations(signed, tmp_path, raw, attempt, "manifest.sig") > 150


def test_every_malformed_manifest_signature_is_refused_in_one_line_by_serves_loader(signed, tmp_path):
    dest = tmp_path / "dest"
    shutil.copytree(signed.dest, dest, ignore=shutil.ignore_patterns(".locks"))
    rank_dir = dest / signed.rank_dir.name
    raw = signature_beside(rank_dir).read_bytes()

    def attempt(data: bytes) -> None:
        signature_beside(rank_dir).write_bytes(data)
        serve_loader(rank_dir, signed, signed.public)

    assert judged_mutations(signed, tmp_path, raw, attempt, "manifest.sig") > 150


class ServedIndexSignature(LocalSource):
    """The signed repository as a Hub would serve it with its versions.sig replaced by ``data``."""

    def __init__(self, path: Path, data: bytes):
        super().__init__(path)
        self.data = data

    def fetch(self, commit: str, path: str, dest: Path, max_bytes: int | None = None) -> None:
        if path == layout.INDEX_SIGNATURE:
            dest.write_bytes(self.data)
        else:
            super().fetch(commit, path, dest, max_bytes)


def test_every_malformed_index_signature_is_refused_in_one_line_by_versions(signed, tmp_path):
    """The signed index as versions (and pull, and serve) read it with --public-key (index.listing)."""
    raw = LocalRepo(signed.repo).read("HEAD", layout.INDEX_SIGNATURE)
    work = tmp_path / "work"

    def attempt(data: bytes) -> None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        index.listing(ServedIndexSignature(signed.repo, data), work, signed.public)

    assert judged_mutations(signed, tmp_path, raw, attempt, "versions.json's signature") > 150


def committed_copy(signed: Signed, tmp_path: Path, path: str, data: bytes) -> Path:
    """A copy of the signed repository with ``data`` committed as ``path`` (the tags stay where they are)."""
    repo = tmp_path / "published"
    shutil.copytree(signed.repo, repo)
    local = LocalRepo(repo)
    local.commit({path: data}, [], "hostile", local.head())
    return repo


def test_the_reported_bundles_are_refused_in_one_line_by_each_command(signed, tmp_path):
    """manifest.sig {} was a KeyError in pull; versions.sig {"verificationMaterial": null} a TypeError in versions and
    serve."""
    repo = committed_copy(signed, tmp_path / "a", layout.path_in(VARIANT, signing.SIGNATURE), b"{}")
    LocalRepo(repo).git("tag", "-f", signed.version, "HEAD")
    pulled = cli("pull", str(repo), signed.version, "--public-key", signed.public, "--dest", str(tmp_path / "a-dest"))
    assert "manifest.sig" in one_line_refusal(pulled) and left_in(tmp_path / "a-dest") == []
    repo = committed_copy(signed, tmp_path / "b", layout.INDEX_SIGNATURE, b'{"verificationMaterial": null}')
    listed = cli("versions", str(repo), "--public-key", signed.public)
    assert "versions.json's signature" in one_line_refusal(listed)
    served = cli("serve", str(repo), VARIANT, "--public-key", signed.public, "--checkpoint", str(signed.checkpoint),
                 "--dest", str(tmp_path / "b-dest"), "--port", "0", timeout=120)
    assert "versions.json's signature" in one_line_refusal(served)


def test_a_bundle_without_its_key_hint_leaves_standard_output_to_the_path(signed, tmp_path):
    """model_signing prints a warning on standard output for a bundle whose (unsigned) key hint is gone: a
    repository could put a line before the path in ``DIR=$(pull ...)``. Its output goes to standard error."""
    at = layout.path_in(VARIANT, signing.SIGNATURE)
    bundle = json.loads(LocalRepo(signed.repo).read(LocalRepo(signed.repo).tags()[signed.version], at))
    bundle["verificationMaterial"]["publicKey"]["hint"] = ""
    repo = committed_copy(signed, tmp_path, at, json.dumps(bundle).encode())
    LocalRepo(repo).git("tag", "-f", signed.version, "HEAD")
    pulled = cli("pull", str(repo), signed.version, "--public-key", signed.public, "--dest", str(tmp_path / "dest"))
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.splitlines() == [str(tmp_path / "dest" / signed.rank_dir.name)]


# -- 9: archive chains and zstd ---------------------------------------------------------------------------------------

def extended_chain(kind: bytes, count: int, root: str) -> bytes:
    """A tar stream opening with ``count`` extended headers of type ``kind`` in a row (GNU long name or link: L, K;
    PAX: x, g), each naming ``root/tp_0.pt``, then that member (empty) and the end blocks."""
    name = f"{root}/tp_0.pt"
    if kind in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
        data = name.encode() + b"\0"
    else:
        record = f" path={name}\n"
        data = f"{len(record) + len(str(len(record) + 3))}{record}".encode()
        assert int(data.split(b" ")[0]) == len(data)
    header = tarfile.TarInfo("././@LongLink")
    header.type, header.size = kind, len(data)
    block = header.tobuf(tarfile.GNU_FORMAT) + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)
    member = tarfile.TarInfo(name)
    return block * count + member.tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024


def window_frame(data: bytes, window_log: int) -> bytes:
    """``data`` as one zstd frame whose header asks for a window of 2**``window_log`` bytes (no content size, so that
    the header carries a window descriptor)."""
    import zstandard

    frame = bytearray(zstandard.ZstdCompressor(write_content_size=False).compress(data))
    assert frame[4] & 0x20 == 0  # not single-segment: byte 5 is the window descriptor, exponent in its top 5 bits
    frame[5] = (window_log - 10) << 3
    assert zstandard.get_frame_parameters(bytes(frame)).window_size == 1 << window_log
    return bytes(frame)


def hostile_archive(case: str, real: bytes, root: str) -> bytes:
    import zstandard

    tar = zstandard.ZstdDecompressor().decompressobj().decompress(real)
    if case.startswith("chain of 600 "):
        return zstandard.ZstdCompressor().compress(extended_chain(case[-1].encode(), 600, root))
    if case == "corrupt zstd data":
        spoiled = bytearray(real)
        for at in range(len(spoiled) // 3, len(spoiled) // 3 + 64):
            spoiled[at] ^= 0x5A
        return bytes(spoiled)
    if case == "zstd magic, then garbage":
        return real[:4] + random.Random(49).randbytes(4096)
    return window_frame(tar, {"a 2 GiB zstd window": 31, "a 64 MiB zstd window": 26}[case])


@pytest.mark.parametrize("case", ["chain of 600 L", "chain of 600 K", "chain of 600 x", "chain of 600 g",
                                  "corrupt zstd data", "zstd magic, then garbage", "a 2 GiB zstd window",
                                  "a 64 MiB zstd window"])
def test_a_hostile_archive_is_refused_in_one_line_naming_it(validated_512_fp32, tmp_path, case):
    """Unsigned, the manifest edited to the hostile archive's size and sha256 (within the byte bound: it is small).
    The chains were a RecursionError in tarfile, the zstd cases a ZstdError. A 64 MiB window is one libzstd would
    take (its default limit is 128 MiB): refused here by the pipeline's own bound."""
    repo, version = published_copy(validated_512_fp32, tmp_path / "published")
    manifest = json.loads((repo / VARIANT / "manifest.json").read_text())
    name, root = manifest["archive"]["name"], manifest["archive"]["root"]
    bomb = hostile_archive(case, (repo / VARIANT / name).read_bytes(), root)
    (repo / VARIANT / name).write_bytes(bomb)
    hostile_commit(repo, version, lambda m: m["archive"].update(size=len(bomb), sha256=hashlib.sha256(bomb)
                                                                .hexdigest()))
    said = "extended headers in a row" if case.startswith("chain") else "zstd"
    with pytest.raises(IntegrityError, match=said) as refused:
        pull(LocalSource(repo), version, tmp_path / "dest", None, True)
    assert name in str(refused.value) and "\n" not in str(refused.value)
    assert left_in(tmp_path / "dest") == []


def test_the_archives_pack_writes_stay_within_the_new_bounds(tmp_path):
    """What the bounds must never refuse: an archive pack writes with a root past tar's 100-character names (a PAX
    header before every member) unpacks."""
    from pipeline.artifact.archive import extract_verified, pack

    from .test_integrity import manifest_for

    for n in range(2):
        (tmp_path / f"tp_{n}.pt").write_bytes(bytes([n]) * (70_000 + n))
    packed = pack(tmp_path, ["tp_0.pt", "tp_1.pt"], "r" * 120, tmp_path / "a.tar.zst", "tar.zst")
    build = extract_verified(tmp_path / "a.tar.zst", manifest_for(packed), tmp_path / "out")
    assert sorted(p.name for p in build.directory.iterdir()) == ["tp_0.pt", "tp_1.pt"]
