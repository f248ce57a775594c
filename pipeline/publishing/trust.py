"""What this client has trusted of each source: the last signed index it verified, and the newest version of each
variant it took, so that it never goes back without being told to.

One record per source (``<cache>/trust/<sha256 of the source>.json``, pipeline/core/cache.py), written only from what
a public key verified: the signed index's ``index_version`` and the sha256 of its bytes, and per variant the version
taken and its publish time (the signed row's). Reading a signed index, a client refuses one whose ``index_version``
is lower than the one it trusted (a rollback: an older index, validly signed, served again), or equal with other bytes
(two indexes under one number); taking a version, it refuses one published before the newest it took of that variant,
unless the user names that version (``--allow-older VERSION``). Unsigned pulls read and write nothing here: what an
attacker could forge cannot be remembered as trusted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

from filelock import FileLock

from pipeline.core.cache import cache_root
from pipeline.core.errors import IntegrityError
from pipeline.core.records import Record
from pipeline.publishing.index import IndexRow, SignedIndex, layout


@dataclass(frozen=True)
class TrustedVersion:
    version: str
    published: str | None


@dataclass(frozen=True)
class TrustedSource(Record):
    KIND = "trusted state"
    MAKE = "pull and versions with --public-key write it"
    FIX = "Remove it to trust this source afresh (the next pull with --public-key writes it again)."
    ERROR = IntegrityError
    SCHEMA_VERSION = 1

    schema_version: int
    source: str
    index_version: int
    index_sha256: str
    variants: dict[str, TrustedVersion]
    """Per variant, the newest version taken from this source."""


def state_path(source: str) -> Path:
    return cache_root() / "trust" / f"{hashlib.sha256(source.encode()).hexdigest()[:32]}.json"


def load(source: str) -> TrustedSource | None:
    """This client's record of ``source``; None for a source it never trusted. A record it cannot read is refused
    (naming the file), not taken as none: that would forget every bound."""
    path = state_path(source)
    return TrustedSource.read(path) if path.exists() else None


def check_index(source: str, signed: SignedIndex) -> None:
    """Refuse a signed index older than the one this client last trusted from ``source``."""
    state = load(source)
    if state is None:
        return
    index = signed.index
    if index.index_version < state.index_version:
        raise IntegrityError(
            f"{layout.INDEX} of {source} is index_version {index.index_version}, older than the {state.index_version} "
            f"this client already trusted: the repository was rolled back (an older, validly signed index served "
            f"again). Nothing was taken. Ask its publisher; {state_path(source)} holds what was trusted")
    if index.index_version == state.index_version and signed.sha256 != state.index_sha256:
        raise IntegrityError(
            f"{layout.INDEX} of {source} is index_version {index.index_version} with other bytes than the index of "
            f"that number this client trusted: two indexes under one number. Nothing was taken. Ask its publisher; "
            f"{state_path(source)} holds what was trusted")


def check_version(source: str, row: IndexRow, allow_older: str | None) -> None:
    """Refuse ``row``'s version when it was published before the newest of its variant this client took from
    ``source``, unless ``allow_older`` names it."""
    state = load(source)
    newest = state.variants.get(row.variant.name) if state else None
    if newest is None or newest.version == row.version or not newest.published:
        return
    if (row.published or "") >= newest.published:
        return
    if allow_older == row.version:
        return
    raise IntegrityError(
        f"{row.version} (published {row.published or 'at an unknown time'}) is older than {newest.version} "
        f"(published {newest.published}), which this client already took from {source}: a version older than one "
        f"already trusted is taken only when named, --allow-older {row.version}")


def remember(source: str, signed: SignedIndex, taken: IndexRow | None = None) -> None:
    """Record ``signed`` (and ``taken``, the version just pulled, when it is the newest of its variant) as trusted."""
    path = state_path(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.with_suffix(".lock"))):  # two pulls of different variants at once both keep theirs
        state = load(source) or TrustedSource(TrustedSource.SCHEMA_VERSION, source, 0, "", {})
        if signed.index.index_version >= state.index_version:
            state = replace(state, index_version=signed.index.index_version, index_sha256=signed.sha256)
        if taken is not None:
            newest = state.variants.get(taken.variant.name)
            if newest is None or (taken.published or "") >= (newest.published or ""):
                state = replace(state, variants={**state.variants, taken.variant.name: TrustedVersion(
                    taken.version, taken.published)})
        state.write(path)
