"""The repository's index of its published versions: ``versions.json`` at the root, one row per version (its variant,
model, backend, compiler and toolchain, inputs digest, headline metrics, whether it is signed, its archive's sha256,
when it was published), so that a consumer lists and chooses versions with one small download instead of one
manifest per version.

Publish writes it in the same commit as the version it adds, from the manifest of every tagged version (the model
card is made from the same list), with ``versions.sig`` beside it where signing is on (the same key and format as a
manifest's signature). A row carries no commit: a commit cannot name itself, and the tags say where each version is.

Reading it, the tags decide: a row whose version has no tag is dropped, and a tag that has no row (an index that is
missing, stale, unreadable or fails its signature check) is read from the version's own manifest at its tag, so a
stale index never wins over the tags. Nothing is decided from a row alone: pull reads the chosen version's manifest
(and checks its signature and every checksum) again before using it.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline.artifact import signing
from pipeline.artifact.manifest import Manifest
from pipeline.core.build_records import ModelIdentity, Variant
from pipeline.core.errors import IntegrityError, PipelineError
from pipeline.core.fsutil import json_text
from pipeline.core.log import log
from pipeline.core.records import Record
from pipeline.publishing import layout


@dataclass(frozen=True)
class IndexRow:
    version: str
    variant: Variant
    model: ModelIdentity
    backend: str
    compiler: str
    """The compiler's id, the version's middle part (``ncc2.23.6484.0``, ``cpu-torch2.13.0``)."""
    inputs: str
    """The inputs digest, the version's last part."""
    toolchain: dict[str, Any]
    """The toolchain record the version was built with (the manifest's): what pull's compatibility rule reads."""
    metrics: dict[str, Any]
    """Decode tokens/s, ms per token and time to first token (the first context validated), and parity."""
    signed: bool
    archive_sha256: str
    published: str | None
    """When it was published (UTC), or null for a row read back from a manifest (an index rebuilt from the tags)."""


@dataclass(frozen=True)
class VersionIndex(Record):
    KIND = "version index"
    MAKE = "any publish writes it"
    FIX = "publish any version again with this release (the index is rebuilt from the tags)"
    SCHEMA_VERSION = 1

    schema_version: int
    versions: tuple[IndexRow, ...]


@dataclass(frozen=True)
class Published:
    """A version as a consumer sees it: its row and the commit its tag names."""

    row: IndexRow
    commit: str


def row_of(manifest: Manifest, published: str | None) -> IndexRow:
    validation = manifest.validation or {}
    throughput, parity = validation.get("throughput") or {}, validation.get("parity") or {}
    metrics = {key: throughput.get(key) for key in ("tokens_per_s", "ms_per_token", "ttft_ms")}
    metrics["parity"] = {"passed": parity.get("passed"), "mode": parity.get("mode")}
    prefix = f"{manifest.variant.name}-{manifest.compiler.id}-"
    return IndexRow(version=manifest.version, variant=manifest.variant, model=manifest.model,
                    backend=manifest.backend, compiler=manifest.compiler.id,
                    inputs=manifest.version.removeprefix(prefix), toolchain=manifest.toolchain, metrics=metrics,
                    signed=manifest.signature is not None, archive_sha256=manifest.archive.sha256,
                    published=published)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def encode(rows: list[IndexRow]) -> bytes:
    index = VersionIndex(VersionIndex.SCHEMA_VERSION, tuple(sorted(rows, key=lambda r: r.version)))
    return json_text(index.to_json()).encode()


def decode(raw: bytes, where: str) -> VersionIndex:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{where} is not JSON ({exc})") from None
    return VersionIndex.from_json(data, where)


def published_dates(raw: bytes | None) -> dict[str, str]:
    """Each version's publish time from the index a repository's head holds (none from a missing or broken one)."""
    if not raw:
        return {}
    try:
        return {row.version: row.published for row in decode(raw, layout.INDEX).versions if row.published}
    except PipelineError:
        return {}


def signature(index: bytes, private_key: str) -> bytes:
    """``versions.sig`` for the index bytes ``index``: a manifest signature's format, over a folder holding only it."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / layout.INDEX).write_bytes(index)
        return signing.sign(Path(tmp), layout.INDEX_SIGNATURE, private_key).read_bytes()


def verify(index: bytes, sig: bytes | None, public_key: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / layout.INDEX).write_bytes(index)
        if sig is not None:
            (Path(tmp) / signing.SIGNATURE).write_bytes(sig)
        signing.verify(Path(tmp), layout.INDEX_SIGNATURE, public_key)


def _index_rows(source, head: str, work: Path, public_key: str | None) -> list[IndexRow]:
    """The rows of the index at the head, or none (with a warning saying why) when it cannot be used."""
    files = source.files(head)
    if layout.INDEX not in files:
        log.warning("%s has no %s (published before it existed?): reading every version's manifest", source.name,
                    layout.INDEX)
        return []
    try:
        source.fetch(head, layout.INDEX, work / layout.INDEX)
        raw = (work / layout.INDEX).read_bytes()
        if public_key is not None:
            sig = None
            if layout.INDEX_SIGNATURE in files:
                source.fetch(head, layout.INDEX_SIGNATURE, work / layout.INDEX_SIGNATURE)
                sig = (work / layout.INDEX_SIGNATURE).read_bytes()
            verify(raw, sig, public_key)
        return list(decode(raw, f"{layout.INDEX} of {source.name}").versions)
    except PipelineError as exc:
        log.warning("%s's %s cannot be used (%s): reading every version's manifest instead", source.name,
                    layout.INDEX, exc)
        return []
    finally:
        for name in (layout.INDEX, layout.INDEX_SIGNATURE):
            (work / name).unlink(missing_ok=True)


def _manifest_row(source, tag: str, commit: str, work: Path) -> IndexRow | None:
    folder = layout.folder_of(tag, source.files(commit))
    if folder is None:
        log.warning("%s: tag %s names no variant folder at %s: left out", source.name, tag, commit[:12])
        return None
    path = work / "manifest.json"
    try:
        source.fetch(commit, layout.path_in(folder, layout.MANIFEST), path)
        manifest = Manifest.read(path)
    except PipelineError as exc:  # one broken version does not hide the others (pull checks the one it takes again)
        log.warning("%s: the manifest at tag %s cannot be read (%s): left out", source.name, tag, exc)
        return None
    finally:
        path.unlink(missing_ok=True)
    if manifest.version != tag:
        log.warning("%s: the manifest at tag %s describes %s: left out", source.name, tag, manifest.version)
        return None
    return row_of(manifest, None)


def published_versions(source, work: Path, public_key: str | None = None) -> list[Published]:
    """Every tagged version of ``source`` (a pull source: ``tags``, ``head``, ``files``, ``fetch``), newest publish
    last: from the index where it is current, from each version's manifest where it is not (the tags decide)."""
    tags = source.tags()
    if not tags:
        return []
    rows = {row.version: row for row in _index_rows(source, source.head(), work, public_key)}
    stale = sorted(set(rows) - set(tags))
    if stale:
        log.warning("%s's %s lists %d version(s) with no tag (%s): left out, the tags decide", source.name,
                    layout.INDEX, len(stale), ", ".join(stale))
    missing = sorted(set(tags) - set(rows))
    if missing and rows:
        log.warning("%s's %s lacks %d tagged version(s) (%s): read from their manifests", source.name, layout.INDEX,
                    len(missing), ", ".join(missing))
    for tag in missing:
        row = _manifest_row(source, tag, tags[tag], work)
        if row is not None:
            rows[tag] = row
    found = [Published(row, tags[version]) for version, row in rows.items() if version in tags]
    return sorted(found, key=lambda p: (p.row.published or "", p.row.version))
