"""The Neuron SDK's lock file: every file a release adds to an inf2 environment, pinned by URL and sha256.

An inf2 host is installed in two hash-pinned steps (``deploy/install-inf2.sh``, the one command the docs and the
scheduled workflow run), each from one source:

1. ``deploy/lock/inf2-base.txt``: the pipeline's own dependencies (torch 2.8.0, transformers 5.13.0, DVC, ...) from
   PyPI, every file by sha256 (``pip install --require-hashes``; ``make lock`` writes it from pyproject.toml).
2. ``deploy/lock/neuron-<release>-torch<torch>.txt``: the release's four Neuron packages and whatever else they need,
   each line ``name @ URL --hash=sha256:...``. pip fetches exactly that URL (``--no-index``: no index is asked for
   anything) and refuses other bytes, so no index, PyPI included, can put a higher version in its place.

A release's lock is made the first time it is installed (``python -m pipeline install-neuron``, or
``check-upgrades --apply`` for a newer release), on a host that reaches the Neuron repository: the four packages'
files are chosen from the Neuron repository alone (``upgrades.chosen_files``), the rest of the install is resolved as
a dry run against the base lock's versions, and every package whose name the Neuron repository serves must come
from a file listed on its page for that name (else nothing is written or installed: a higher upload of such a name
elsewhere, the dependency confusion pip's docs warn about). The lock is then committed, so every later host installs
those very bytes; the sha256 of each file is the one its index lists (PEP 503's ``#sha256=``), or, where an index
lists none, the sha256 of the file as downloaded.
"""

from __future__ import annotations

import json
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urldefrag

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion

from pipeline.core.fsutil import atomic_write_text, sha256_stream

LOCK_DIR = Path("deploy/lock")
BASE_LOCK = LOCK_DIR / "inf2-base.txt"
_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*) @ (?P<url>\S+) --hash=sha256:(?P<sha256>[0-9a-f]{64})$")
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)(?P<marker>\s*;[^\\]*)?")


class LockError(Exception):
    """A lock file that cannot be read, or a package it cannot be made of (raised as UpgradeCheckError by callers)."""


@dataclass(frozen=True)
class Locked:
    """One file of a lock: the package, its version, where it is fetched and what its bytes hash to."""

    name: str
    version: str
    url: str
    sha256: str

    def line(self) -> str:
        return f"{self.name} @ {self.url} --hash=sha256:{self.sha256}"


def lock_file(lock_dir: Path, release: str, torch: str) -> Path:
    return Path(lock_dir) / f"neuron-{release}-torch{torch}.txt"


def base_pins(base_lock: Path) -> list[str]:
    """The base lock's requirements without their hashes (``name==version ; marker``), as pip constraints."""
    pins = []
    for line in Path(base_lock).read_text().splitlines():
        found = _PIN.match(line.strip())
        if found:
            pins.append(f"{found['name']}=={found['version']}{(found['marker'] or '').rstrip()}")
    return pins


def pinned_names(base_lock: Path | None) -> dict[str, str]:
    """package -> version of the base lock (markers aside)."""
    if base_lock is None or not Path(base_lock).is_file():
        return {}
    return {canonicalize_name(p.split("==")[0]): p.split("==")[1].split(";")[0].strip() for p in base_pins(base_lock)}


@dataclass(frozen=True)
class Chosen:
    """A file pip's resolution would install, from its installation report (``pip install --dry-run --report``)."""

    name: str
    """The project's canonical name."""
    version: str
    url: str
    listed_sha256: str | None
    """The sha256 its index listed beside the file (None when it listed none)."""


def report_files(report: Path) -> list[Chosen]:
    """The ``install`` list of pip's installation report (its format: pip's docs, "Installation Report", version 1:
    ``metadata`` is the file's core metadata, ``download_info`` a PEP 610 direct URL record)."""
    chosen = []
    for item in json.loads(Path(report).read_text()).get("install", []):
        metadata, download = item["metadata"], item["download_info"]
        hashes = (download.get("archive_info") or {}).get("hashes") or {}
        chosen.append(Chosen(canonicalize_name(metadata["name"]), metadata["version"], download["url"],
                             hashes.get("sha256")))
    return chosen


def sha256_of(file: Chosen) -> str:
    """The sha256 of a file of pip's installation report: as its index lists it, else hashed as downloaded."""
    if file.listed_sha256:
        return file.listed_sha256
    with urllib.request.urlopen(urldefrag(file.url).url, timeout=300) as response:
        return sha256_stream(response)[1]


def read(path: Path) -> list[Locked]:
    """The entries of a lock file; a line that is neither a comment nor ``name @ URL --hash=sha256:...`` is refused."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        found = _LINE.match(line.strip())
        if not found:
            raise LockError(f"{path}:{number} is not 'name @ URL --hash=sha256:HEX': {line!r}")
        version = file_version(found["name"], unquote(urldefrag(found["url"]).url.rsplit("/", 1)[-1]))
        if version is None:
            raise LockError(f"{path}:{number}: {found['url']} is no file of {found['name']}")
        entries.append(Locked(canonicalize_name(found["name"]), version, found["url"], found["sha256"]))
    return entries


def file_version(name: str, filename: str) -> str | None:
    """The version a wheel or sdist file name carries (None for another project's file or an unparsable name)."""
    try:
        if filename.endswith(".whl"):
            project, version, _, _ = parse_wheel_filename(filename)
        else:
            project, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    return str(version) if project == canonicalize_name(name) else None


def write(path: Path, entries: list[Locked], release: str, torch: str, index: str) -> None:
    header = [f"# Neuron SDK release {release} with torch {torch}'s torch-neuronx, on top of {BASE_LOCK}.",
              f"# Made by python -m pipeline install-neuron from {index}: commit it, so that every host installs these",
              "# very files. Installed with: pip install --no-deps --no-index --require-hashes -r THIS_FILE",
              "# (pipeline/cli/neuron_lock.py)."]
    atomic_write_text(path, "\n".join(header + [e.line() for e in sorted(entries, key=lambda e: e.name)]) + "\n")


def constraints(base_lock: Path | None, directory: Path) -> list[str]:
    """pip arguments constraining a resolution to the base lock's versions (none without a base lock)."""
    if base_lock is None or not Path(base_lock).is_file():
        return []
    path = Path(directory) / "base-constraints.txt"
    path.write_text("\n".join(base_pins(base_lock)) + "\n")
    return ["--constraint", str(path)]
