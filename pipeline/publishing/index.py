"""The repository's index of its published versions: ``versions.json`` at the root, one row per version (its variant,
model, backend, compiler and toolchain, inputs digest, headline metrics, whether it is signed, its archive's and
manifest's sha256, when it was published), so that a consumer lists and chooses versions with one small download
instead of one manifest per version.

The index says how fresh it is: ``index_version`` counts up by one with each index written, ``published`` is when it
was written and ``expires`` when a consumer stops taking it (``publish.index_expiry_days`` later; ``refresh-index``
writes it again, same rows, before then). Publish writes it in the same commit as the version it adds, from the
manifest of every tagged version, with ``versions.sig`` beside it where signing is on (the same key and format as a
manifest's signature). A row carries no commit: a commit cannot name itself, and the tags say where each version is.

Reading it, two regimes (docs/reliability.md, "The registry"):

- **with a public key** the signed index decides: it must be there, verify, not have expired (``--allow-expired``
  takes it anyway) and not be older than the last index this client trusted from the same source
  (pipeline/publishing/trust.py): a rollback or a freeze is refused, not worked around. A version is what its row
  says, its manifest must hash to the row's ``manifest_sha256`` (no mixing of an old manifest into a new index), and
  a row whose tag is gone is named, never skipped in silence.
- **without one** (``--allow-unsigned``) nothing from the repository is trusted: the tags decide what exists, a row
  whose version has no tag is dropped, and a tag that has no row (an index that is missing, stale or unreadable) is
  read from the version's own manifest at its tag; a choice that a row would decide (does it fit this host?) is made
  from the version's manifest.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pipeline.artifact import signing
from pipeline.artifact.manifest import Manifest
from pipeline.core.build_records import ModelIdentity, ToolchainRecord, Variant
from pipeline.core.errors import IntegrityError, PipelineError
from pipeline.core.fsutil import json_text, sha256_bytes
from pipeline.core.log import log
from pipeline.core.names import component_problem, version_problem
from pipeline.core.records import Record
from pipeline.publishing import layout

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


@dataclass(frozen=True)
class ParityHeadline:
    passed: bool | None
    mode: str | None


@dataclass(frozen=True)
class Headline:
    """A version's headline figures (decode tokens/s, ms per token and time to first token, of the first context
    validated; every sequence's tokens/s together with the batch's lines all in flight) and its parity verdict, as its
    manifest's validation summary gives them: null where it gives none."""

    tokens_per_s: float | None
    ms_per_token: float | None
    ttft_ms: float | None
    parity: ParityHeadline
    aggregate_tokens_per_s: float | None = None
    """With ``batch_size`` sequences in flight, all of them together (left out for a version from before batching)."""

    @classmethod
    def of(cls, manifest: Manifest) -> Headline:
        """Read leniently: the summary of a version any release published (the manifest keeps it as published:
        pipeline/artifact/manifest.py), a figure it lacks left null."""
        summary = manifest.validation or {}
        throughput, parity = summary.get("throughput") or {}, summary.get("parity") or {}
        concurrency = summary.get("concurrency") or {}
        full = concurrency.get(max(concurrency, key=int)) if concurrency else None
        return cls(throughput.get("tokens_per_s"), throughput.get("ms_per_token"), throughput.get("ttft_ms"),
                   ParityHeadline(parity.get("passed"), parity.get("mode")),
                   full.get("aggregate_tokens_per_s") if isinstance(full, dict) else None)


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
    toolchain: ToolchainRecord
    """The toolchain record the version was built with (the manifest's): what pull's compatibility rule reads."""
    metrics: Headline
    signed: bool
    archive_sha256: str
    manifest_sha256: str
    """The sha256 of the version's manifest as published at its tag: a consumer checks the manifest it fetches."""
    published: str | None
    """When it was published (UTC), or null for a row read back from a manifest (an index rebuilt from the tags)."""


@dataclass(frozen=True)
class VersionIndex(Record):
    KIND = "version index"
    MAKE = "any publish writes it"
    FIX = "publish any version again with this release (the index is rebuilt from the tags)"
    ERROR = IntegrityError
    SCHEMA_VERSION = 2
    MAX_BYTES = 16 << 20  # about 2 KB a row

    schema_version: int
    index_version: int
    """One more than the index this one replaced: a client that has trusted index N refuses any lower (a rollback)."""
    published: str
    """When this index was written (UTC)."""
    expires: str
    """When a client stops taking it (UTC): an index nobody refreshes is refused (a freeze)."""
    versions: tuple[IndexRow, ...]

    def problems(self) -> list[str]:
        found = [f"{name} {value!r} is not a time ({TIME_FORMAT})" for name, value in
                 (("published", self.published), ("expires", self.expires)) if parsed_time(value) is None]
        if self.index_version < 1:
            found.append(f"index_version {self.index_version} must be 1 or more")
        for i, row in enumerate(self.versions):  # each becomes a path, a tag or a line on a terminal
            problem = version_problem(row.version) or component_problem(row.variant.name)
            if problem:
                found.append(f"versions[{i}] names a version {row.version!r} of {row.variant.name!r} ({problem})")
            if row.published is not None and parsed_time(row.published) is None:
                found.append(f"versions[{i}].published {row.published!r} is not a time ({TIME_FORMAT})")
        names = [row.version for row in self.versions]
        if len(set(names)) != len(names):
            found.append("versions lists a version twice")
        return found

    def expired(self, now: datetime | None = None) -> bool:
        return parsed_time(self.expires) <= (now or datetime.now(timezone.utc))


@dataclass(frozen=True)
class Published:
    """A version as a consumer sees it: its row and the commit its tag names."""

    row: IndexRow
    commit: str


def row_of(manifest: Manifest, manifest_sha256: str, published: str | None) -> IndexRow:
    prefix = f"{manifest.variant.name}-{manifest.compiler.id}-"
    return IndexRow(version=manifest.version, variant=manifest.variant, model=manifest.model,
                    backend=manifest.backend, compiler=manifest.compiler.id,
                    inputs=manifest.version.removeprefix(prefix), toolchain=manifest.toolchain,
                    metrics=Headline.of(manifest),
                    signed=manifest.signature is not None, archive_sha256=manifest.archive.sha256,
                    manifest_sha256=manifest_sha256, published=published)


def now() -> str:
    return datetime.now(timezone.utc).strftime(TIME_FORMAT)


def parsed_time(text: str) -> datetime | None:
    try:
        return datetime.strptime(text, TIME_FORMAT).replace(tzinfo=timezone.utc)
    except (TypeError, ValueError):
        return None


def written(rows: list[IndexRow], previous: VersionIndex | None, expiry_days: float) -> VersionIndex:
    """The index of ``rows`` that replaces ``previous`` (the head's, None for a first or unreadable one): one
    ``index_version`` more, published now, expiring ``expiry_days`` from now."""
    when = now()
    expires = (parsed_time(when) + timedelta(days=expiry_days)).strftime(TIME_FORMAT)
    return VersionIndex(VersionIndex.SCHEMA_VERSION, (previous.index_version if previous else 0) + 1, when, expires,
                        tuple(sorted(rows, key=lambda r: r.version)))


def refreshed(previous: VersionIndex, expiry_days: float) -> VersionIndex:
    """``previous`` written again with the same rows: a new ``index_version``, publish time and expiry."""
    return written(list(previous.versions), previous, expiry_days)


def encode(index: VersionIndex) -> bytes:
    return json_text(index.to_json()).encode()


def decode(raw: bytes, where: str) -> VersionIndex:
    return VersionIndex.from_bytes(raw, where)


def readable(raw: bytes | None) -> VersionIndex | None:
    """The index in ``raw`` (a head's), or None when there is none this release reads (missing, an older schema)."""
    try:
        return decode(raw, layout.INDEX) if raw else None
    except PipelineError:
        return None


def published_dates(raw: bytes | None) -> dict[str, str]:
    """Each version's publish time from the index a repository's head holds, of this schema or an earlier one (none
    from a missing or broken one): the publisher's own repository, read to carry the times over."""
    from pipeline.core import jsonio

    try:
        rows = jsonio.loads(raw).get("versions", []) if raw else []
        return {row["version"]: row["published"] for row in rows
                if isinstance(row.get("version"), str) and parsed_time(row.get("published")) is not None}
    except (jsonio.JSONRefused, AttributeError, TypeError):
        return {}


def signature(index: bytes, private_key: str) -> bytes:
    """``versions.sig`` for the index bytes ``index``: a manifest signature's format, over a folder holding only it."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / layout.INDEX).write_bytes(index)
        return signing.sign(Path(tmp), layout.INDEX_SIGNATURE, private_key).read_bytes()


def verify(index: bytes, sig: bytes, public_key: str) -> None:
    """Raise ``IntegrityError`` unless ``sig`` is ``public_key``'s signature of the bytes ``index``."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / layout.INDEX).write_bytes(index)
        (Path(tmp) / signing.SIGNATURE).write_bytes(sig)
        try:
            signing.verify(Path(tmp), layout.INDEX_SIGNATURE, public_key, named=layout.INDEX_SIGNATURE)
        except IntegrityError as exc:
            raise IntegrityError(f"{layout.INDEX}'s signature does not verify with the public key ({exc})") from None


def fetch_bounded(source, commit: str, path: str, dest: Path, max_bytes: int) -> bytes:
    """The bytes of ``path`` at ``commit``, refused past ``max_bytes`` (an endless download) before they are read."""
    source.fetch(commit, path, dest, max_bytes)
    return dest.read_bytes()


@dataclass(frozen=True)
class SignedIndex:
    """An index a public key verified: what it says, and the sha256 of its bytes (a client's trusted state keeps it)."""

    index: VersionIndex
    sha256: str


def signed_index(source, head: str, work: Path, public_key: str, allow_expired: bool) -> SignedIndex:
    """The head's index, verified by ``public_key`` (its signature over the bytes first, then parsed), and not
    expired; else ``IntegrityError`` naming why and the fix."""
    files = source.files(head)
    where = f"{layout.INDEX} of {source.name}"
    if layout.INDEX not in files or layout.INDEX_SIGNATURE not in files:
        missing = layout.INDEX if layout.INDEX not in files else layout.INDEX_SIGNATURE
        raise IntegrityError(f"{source.name} has no {missing} at its head: with --public-key the signed index decides "
                             "what is published, and this repository has none (published unsigned, or by an earlier "
                             "release: its publisher runs `python -m pipeline refresh-index`); pull without "
                             "--public-key and with --allow-unsigned to take it unverified")
    try:
        raw = fetch_bounded(source, head, layout.INDEX, work / layout.INDEX, VersionIndex.MAX_BYTES)
        sig = fetch_bounded(source, head, layout.INDEX_SIGNATURE, work / layout.INDEX_SIGNATURE,
                            signing.MAX_SIGNATURE_BYTES)
        verify(raw, sig, public_key)
        index = decode(raw, where)
    finally:
        for name in (layout.INDEX, layout.INDEX_SIGNATURE):
            (work / name).unlink(missing_ok=True)
    if index.expired() and not allow_expired:
        raise IntegrityError(f"{where} (index_version {index.index_version}, signed) expired at {index.expires}: its "
                             "publisher has not refreshed it (`python -m pipeline refresh-index`, which the scheduled "
                             "rebuild runs), or someone serves an old copy to hold this host back (a freeze). Ask the "
                             "publisher; --allow-expired takes it anyway")
    return SignedIndex(index, sha256_bytes(raw))


def _unsigned_rows(source, head: str, work: Path) -> list[IndexRow]:
    """The rows of the head's index, or none (with a warning saying why) when it cannot be used: hints only, the
    tags decide."""
    files = source.files(head)
    if layout.INDEX not in files:
        log.warning("%s has no %s (published before it existed?): reading every version's manifest", source.name,
                    layout.INDEX)
        return []
    try:
        raw = fetch_bounded(source, head, layout.INDEX, work / layout.INDEX, VersionIndex.MAX_BYTES)
        return list(decode(raw, f"{layout.INDEX} of {source.name}").versions)
    except PipelineError as exc:
        log.warning("%s's %s cannot be used (%s): reading every version's manifest instead", source.name,
                    layout.INDEX, exc)
        return []
    finally:
        (work / layout.INDEX).unlink(missing_ok=True)


def manifest_at(source, tag: str, commit: str, work: Path) -> tuple[Manifest, str] | None:
    """The manifest of version ``tag`` at ``commit`` and the sha256 of its bytes; None (with a warning) when there is
    none that describes it."""
    folder = layout.folder_of(tag, source.files(commit))
    if folder is None:
        log.warning("%s: tag %r names no variant folder at %s: left out", source.name, tag, commit[:12])
        return None
    path = work / "manifest.json"
    try:
        raw = fetch_bounded(source, commit, layout.path_in(folder, layout.MANIFEST), path, Manifest.MAX_BYTES)
        manifest = Manifest.from_bytes(raw, f"{folder}/manifest.json at tag {tag}")
    except PipelineError as exc:  # one broken version does not hide the others (pull checks the one it takes again)
        log.warning("%s: the manifest at tag %r cannot be read (%s): left out", source.name, tag, exc)
        return None
    finally:
        path.unlink(missing_ok=True)
    if manifest.version != tag:
        log.warning("%s: the manifest at tag %r describes %r: left out", source.name, tag, manifest.version)
        return None
    return manifest, sha256_bytes(raw)


def _manifest_row(source, tag: str, commit: str, work: Path) -> IndexRow | None:
    found = manifest_at(source, tag, commit, work)
    return row_of(found[0], found[1], None) if found else None


@dataclass(frozen=True)
class Listing:
    """What a source publishes, as a consumer sees it: each version (its commit None where its tag is missing: only
    a signed index lists such a version), and the signed index it came from (None without a key)."""

    versions: list[Published]
    signed: SignedIndex | None


def listing(source, work: Path, public_key: str | None = None, allow_expired: bool = False) -> Listing:
    """Every version ``source`` (a pull source: ``tags``, ``head``, ``files``, ``fetch``) publishes, newest publish
    last: the signed index's rows with a key; else the tags, described by the index where it is current and by each
    version's manifest where it is not."""
    tags = source.tags()
    if public_key is not None:
        signed = signed_index(source, source.head(), work, public_key, allow_expired)
        found = [Published(row, tags.get(row.version)) for row in signed.index.versions]
        return Listing(sorted(found, key=newness), signed)
    if not tags:
        return Listing([], None)
    rows = {row.version: row for row in _unsigned_rows(source, source.head(), work)}
    stale = sorted(set(rows) - set(tags))
    if stale:
        log.warning("%s's %s lists %d version(s) with no tag (%s): left out, the tags decide", source.name,
                    layout.INDEX, len(stale), ", ".join(map(repr, stale)))
    missing = sorted(set(tags) - set(rows))
    if missing and rows:
        log.warning("%s's %s lacks %d tagged version(s) (%s): read from their manifests", source.name, layout.INDEX,
                    len(missing), ", ".join(map(repr, missing)))
    for tag in missing:
        row = _manifest_row(source, tag, tags[tag], work)
        if row is not None:
            rows[tag] = row
    found = [Published(row, tags[version]) for version, row in rows.items() if version in tags]
    return Listing(sorted(found, key=newness), None)


def newness(p: Published) -> tuple[str, str]:
    """The order of versions, oldest first: by publish time (a version with none first), then by name."""
    return p.row.published or "", p.row.version
