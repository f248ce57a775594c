"""The versions of torch and transformers the pipeline supports, read from its own package metadata.

pyproject.toml's ``dependencies`` are the one place the ranges are written: an installed pipeline reads them from
its metadata (``importlib.metadata.requires``), a bare checkout from pyproject.toml beside the package. Both ranges
are tested: the default environment at the newest versions (constraints.txt), ``make test-production`` at the
``[neuron]`` extra's torch and transformers, and ``make test-lowest`` at the lowest version every range allows
(constraints-lowest.txt).

``check()`` refuses an installed torch or transformers outside its range, naming the installed version, the range
and the command that installs a supported one; the toolchain stage calls it before any work.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pipeline.core.errors import ConfigError

DISTRIBUTION = "gemma4-neuron-pipeline"
CHECKED = ("torch", "transformers")
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"  # this file is pipeline/core/versions.py


def declared() -> list[Requirement]:
    """The pipeline's own dependencies (not its extras), as pyproject.toml declares them."""
    try:
        lines = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        try:
            import tomllib  # Python 3.11+
        except ModuleNotFoundError:
            raise ConfigError("the pipeline is not installed and this Python cannot read pyproject.toml: "
                              "pip install -e . (README)") from None
        lines = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.marker is None or "extra" not in str(r.marker)]


def supported(name: str) -> SpecifierSet:
    return next(r.specifier for r in declared() if r.name == name)


def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def problems() -> list[str]:
    found = []
    for name in CHECKED:
        have, want = installed(name), supported(name)
        if have is None:
            found.append(f"{name} is not installed: pip install '{name}{want}'")
        elif not want.contains(Version(have).base_version, prereleases=True):
            found.append(f"{name} {have} is installed, the pipeline supports {name}{want}: pip install "
                         f"'{name}{want}' -c constraints.txt (or the [neuron] extra on an inf2 host)")
    return found


def check() -> None:
    found = problems()
    if found:
        raise ConfigError(found)
