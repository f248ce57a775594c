"""The manifest: what a packaged build is, and the checksums everything downstream trusts.

``Manifest`` is its schema: written by the package stage (``dist/manifest.json``), extended by publish (the validation
summary, the regression comparison, the signature's name) and read by validate, publish, pull and generate. It is
checked every time it is read, so a truncated, hand-edited or foreign manifest is refused with the field at fault
before anything it describes is touched. On disk it is exactly its fields as JSON, keys sorted; an optional field
that is unset is left out, so manifests published before it was typed read and write back byte for byte.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.artifact.formats import FORMATS, SUFFIX
from pipeline.core.build_records import Compiler, Member, ModelIdentity, ToolchainRecord, Variant
from pipeline.core.errors import InputError, IntegrityError
from pipeline.core.names import component_problem
from pipeline.core.records import Record
from pipeline.core.shape import BuildShape, rank_members

SCHEMA_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KB (the toolchain record is most of it): 1 MiB is far past any
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MEMBER_RE = re.compile(r"^(tp_(0|[1-9][0-9]*)\.pt|model\.pt)$")


@dataclass(frozen=True)
class ArchiveFile:
    """The archive of the rank files: its file name, format, size and sha256, and the one directory it unpacks to."""

    name: str
    format: str
    size: int
    sha256: str
    root: str


@dataclass(frozen=True)
class RegressionCheck:
    """One row of the regression gate: a figure of the previous and of this version, the limit, and the verdict."""

    check: str
    previous: bool | float
    """A verdict, a count or a figure, as the row compares it."""
    current: bool | float
    change: float | None
    """(current - previous) / previous, where both are numbers and previous is not 0."""
    limit: str
    passed: bool


@dataclass(frozen=True)
class RegressionResult:
    """The comparison with the version of the variant published before (pipeline/publishing/regression.py)."""

    against: str
    against_fingerprint: str
    comparable_throughput: bool
    checks: tuple[RegressionCheck, ...]
    passed: bool
    allowed: bool
    """Regressed, and published anyway by ``publish.allow_regression=true``."""
    same_weights: bool = True
    """Whether both builds are of the same checkpoint (``model.weights_digest``): only then does the comparison gate
    the publish (parity figures are each build's against its own reference); else it is recorded only."""


@dataclass(frozen=True)
class SignatureFile:
    file: str
    """Its name beside the manifest (``manifest.sig``, pipeline/artifact/signing.py)."""


@dataclass(frozen=True)
class Manifest(Record):
    KIND = "manifest"
    MAKE = "run the package stage first"
    FIX = ("Nothing it describes was touched. A manifest in dist/ is made again by stage=package force=true; a "
           "published one is read by the release of the pipeline that published it.")
    ERROR = IntegrityError
    SCHEMA_VERSION = SCHEMA_VERSION
    MAX_BYTES = MAX_MANIFEST_BYTES

    schema_version: int
    version: str
    """``<variant>-<compiler>-<inputs>`` (stages/package.py, version_name): the tag it is published under."""
    fingerprint: str
    model: ModelIdentity
    variant: Variant
    backend: str
    compiler: Compiler
    toolchain: ToolchainRecord
    layout: str
    members: tuple[Member, ...]
    archive: ArchiveFile
    created_by: str | None = None
    validation: dict[str, Any] | None = None
    """Set by publish: the validation summary (pipeline/validation/records.py ``ValidationSummary``, read where it is
    compared: this layer sits below the validation records)."""
    regression: RegressionResult | None = None
    """Set by publish: the comparison with the previous version of the variant (publishing/regression.py)."""
    signature: SignatureFile | None = None
    """Set by publish when a signature (over the published bytes) goes beside it."""

    @property
    def shape(self) -> BuildShape:
        return self.variant.shape

    def problems(self) -> list[str]:
        found = [f"field {key} is not a sha256" for key, value in (("fingerprint", self.fingerprint),
                                                                     ("archive.sha256", self.archive.sha256))
                 if not SHA256_RE.match(value)]
        for i, member in enumerate(self.members):
            if not MEMBER_RE.match(member.path):
                found.append(f"members[{i}].path {member.path!r} is not a rank file name")
            if member.size < 0:
                found.append(f"members[{i}].size must be a non-negative integer")
            if not SHA256_RE.match(member.sha256):
                found.append(f"members[{i}].sha256 is not a sha256")
        names = [m.path for m in self.members]
        if len(set(names)) != len(names):
            found.append(f"members has duplicate paths: {names}")
        if self.layout == "per_rank":
            expected = rank_members(self.variant.tp_degree)
            if sorted(names) != sorted(expected):
                found.append(f"members {sorted(names)} do not match tp_degree={self.variant.tp_degree} "
                             f"(expected {expected})")
        # Each name below becomes a path on the consumer's disk (pull: DEST/<root>/, its work folder's <name>) or a
        # tag: a published manifest is input from outside like any other (pipeline/core/names.py).
        problem = component_problem(self.version)
        if problem:
            found.append(f"version {self.version!r} must be a plain name ({problem})")
        problem = component_problem(self.archive.root)
        if problem:
            found.append(f"archive.root {self.archive.root!r} must be a plain directory name ({problem})")
        problem = component_problem(self.archive.name)
        if problem:
            found.append(f"archive.name {self.archive.name!r} must be a plain file name ({problem})")
        if self.archive.format not in FORMATS:
            found.append(f"archive.format {self.archive.format!r} is not one of {list(FORMATS)}")
        elif not self.archive.name.endswith(SUFFIX[self.archive.format]):
            found.append(f"archive.name {self.archive.name!r} does not end in {SUFFIX[self.archive.format]!r}, its "
                         f"format's suffix")
        return found


# -- where a rank directory's manifest is -------------------------------------------------------------------------

def manifest_beside(rank_dir: Path) -> Path:
    return rank_dir.with_name(rank_dir.name + ".manifest.json")


def manifest_of(rank_dir: Path) -> Path:
    """The manifest a rank directory is checked against: the one ``pull`` wrote beside it, or, for a build folder
    (``artifacts/<model>/<variant>/build``), the package stage's ``dist/manifest.json``; else an error saying what to
    pass."""
    rank_dir = Path(rank_dir)
    if manifest_beside(rank_dir).is_file():
        return manifest_beside(rank_dir)
    packaged = rank_dir.parent / "dist" / "manifest.json"
    if rank_dir.name == "build" and packaged.is_file():
        return packaged
    if rank_dir.name == "build":
        raise InputError(f"{rank_dir} is a build folder with no {packaged}: run stage=package for its variant first, "
                         "or pass a directory `python -m pipeline pull` printed")
    raise InputError(f"{rank_dir} has no {manifest_beside(rank_dir).name} beside it: pass the directory `python -m "
                     "pipeline pull` printed, or a build folder (artifacts/<model>/<variant>/build, once packaged)")
