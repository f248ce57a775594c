"""What this client has trusted of each source: the last signed index it verified, and the newest version of each
variant it took, so that it never goes back without being told to.

One record per source (``<cache>/trust/<sha256 of the source>.json``, pipeline/core/cache.py), written only from what
a public key verified: the signed index's ``index_version`` and the sha256 of its bytes, and per variant the version
taken and its publish time (the signed row's). Reading a signed index, a client refuses one whose ``index_version``
is lower than the one it trusted (a rollback: an older index, validly signed, served again), or equal with other bytes
(two indexes under one number); taking a version, it refuses one published before the newest it took of that variant,
unless the user names that version (``--allow-older VERSION``). Unsigned pulls read and write nothing here: what an
attacker could forge cannot be remembered as trusted.

The bounds hold only while no one else can change them: a record another user removed reads as a source never
trusted, one they wrote as any bound they chose. So the state is read only where the pull record's rule holds
(pipeline/host/locking.py, ``changeable_by_others``): the cache folder (or, as /tmp is, sticky and this user's or
root's), ``trust/`` and each record owned by this user and writable by no one else. A record is also refused when a
value is out of its range (an ``index_version`` below 1 lifts every bound; one past any index's number refuses every
later pull) or it names another source than the one it is filed under.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.core.cache import CACHE_ENV, cache_root
from pipeline.core.errors import IntegrityError
from pipeline.core.names import component_problem, version_problem
from pipeline.core.records import Record
from pipeline.host import locking
from pipeline.publishing.index import TIME_FORMAT, IndexRow, SignedIndex, layout, parsed_time

MAX_INDEX_VERSION = 2**53 - 1  # one more per index written: beyond any publisher's count, and JSON's exact integers
SHA256 = re.compile(r"[0-9a-f]{64}")


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

    def problems(self) -> list[str]:
        found = []
        if not 1 <= self.index_version <= MAX_INDEX_VERSION:
            found.append(f"index_version {self.index_version} is not between 1 and {MAX_INDEX_VERSION}")
        if not SHA256.fullmatch(self.index_sha256):
            found.append(f"index_sha256 {self.index_sha256!r} is not a sha256 (64 lowercase hex digits)")
        for variant, taken in self.variants.items():
            problem = component_problem(variant) or version_problem(taken.version)
            if problem:
                found.append(f"variants names {taken.version!r} of {variant!r} ({problem})")
            if taken.published is not None and parsed_time(taken.published) is None:
                found.append(f"variants.{variant}.published {taken.published!r} is not a time ({TIME_FORMAT})")
        return found


def state_path(source: str) -> Path:
    return cache_root() / "trust" / f"{hashlib.sha256(source.encode()).hexdigest()[:32]}.json"


def refuse_if_shared(path: Path) -> None:
    """Refuse the trusted state at ``path`` when another user could have changed it, or the folders holding it."""
    fix = f"make it yours alone (chmod go-w), or set {CACHE_ENV} to a folder only you can write"
    for folder, sticky_ok in ((path.parent.parent, True), (path.parent, False)):
        problem = locking.changeable_by_others(folder, sticky_ok) if folder.exists() else None
        if problem:
            raise IntegrityError(f"{folder} {problem}: the trusted state of a source cannot be read from it; {fix}")
    # The record is never a link (this client writes it as a file of its own): a link could lead to anyone's file.
    problem = "is a symbolic link" if path.is_symlink() else (
        locking.changeable_by_others(path) if path.exists() else None)
    if problem:
        raise IntegrityError(f"{path} {problem}: it cannot be trusted to bound what is taken; remove it (the next "
                             f"pull with --public-key writes it again), or set {CACHE_ENV} to a folder only you can "
                             "write")


def read(path: Path, source: str) -> TrustedSource:
    """The record at ``path``, filed under ``source``; refused in one line, as each refusal of a pull is."""
    try:
        state = TrustedSource.read(path)
    except IntegrityError as exc:
        if "\n" not in str(exc):
            raise
        # The record reader names the file, then one problem a line, then the fix.
        first, *problems, fix = str(exc).splitlines()
        raise IntegrityError(f"{first} {'; '.join(p.strip().removeprefix('- ') for p in problems)}. {fix}") from None
    if state.source != source:
        raise IntegrityError(f"{path} is the trusted state of {state.source!r}, not of {source}: "
                             f"{TrustedSource.FIX}")
    return state


def load(source: str) -> TrustedSource | None:
    """This client's record of ``source``; None for a source it never trusted. A record it cannot read, or that
    another user could have changed or removed, is refused (naming the file), not taken as none: that would forget
    every bound."""
    path = state_path(source)
    refuse_if_shared(path)
    return read(path, source) if path.exists() else None


def check_index(source: str, signed: SignedIndex) -> None:
    """Refuse a signed index older than the one this client last trusted from ``source``, or past what a trusted
    state keeps (it could not be remembered once taken)."""
    index = signed.index
    if index.index_version > MAX_INDEX_VERSION:
        raise IntegrityError(
            f"{layout.INDEX} of {source} is index_version {index.index_version}, past the {MAX_INDEX_VERSION} this "
            "client can keep as trusted: a publisher counts up by one per index written. Nothing was taken. Ask its "
            "publisher")
    state = load(source)
    if state is None:
        return
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
    # Made with the modes the rule asks for, whatever the umask (002 with a shared group would make them group-
    # writable, and then refused): the cache folder, then trust/ in it
    path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    with locking.held(path.parent, path.stem):  # two pulls of different variants at once both keep theirs
        state = load(source) or TrustedSource(TrustedSource.SCHEMA_VERSION, source, 0, "", {})
        if signed.index.index_version >= state.index_version:
            state = replace(state, index_version=signed.index.index_version, index_sha256=signed.sha256)
        if taken is not None:
            newest = state.variants.get(taken.variant.name)
            if newest is None or (taken.published or "") >= (newest.published or ""):
                state = replace(state, variants={**state.variants, taken.variant.name: TrustedVersion(
                    taken.version, taken.published)})
        state.write(path)
        path.chmod(0o600)  # whatever the umask: the rule above reads only a record no one else can write
