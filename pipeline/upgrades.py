"""``python -m pipeline check-upgrades [--apply]``: is a newer Neuron compiler stack available than the installed one?

Compares the installed versions of neuronx-cc, torch-neuronx and neuronx-distributed (in the environment of
``--python``, default this interpreter) with the newest the package index offers, asking pip itself:
``pip install --dry-run --report`` names what pip would install, with the same index settings, platform tags,
pre-release and yanked-release rules as a real install (pip.conf and ``PIP_*`` variables apply as usual). Prints a
table (``--json``: a JSON document). Exit codes:

    0  up to date            3  an upgrade is available (or a package is not installed)
    1  error (the index cannot be read, a package is unknown to it)     2  bad arguments

``--apply`` installs exactly the versions found (``pip install NAME==VERSION``, dependencies resolved as usual), then
runs the rebuild command (default ``dvc repro``): the toolchain stage records the new versions, and DVC re-runs
trace, package, validate and publish for every variant, while the model and reference stay cached. It exits with
the rebuild's status (0 when nothing needed upgrading).

    python -m pipeline check-upgrades
    python -m pipeline check-upgrades --apply
    python -m pipeline check-upgrades --index-url https://pypi.org/simple \\
        --extra-index-url https://pip.repos.neuron.amazonaws.com --json

Index options (``--index-url``, ``--extra-index-url``, ``--find-links``) go to pip as given; with none, pip's own
settings plus ``--extra-index-url https://pip.repos.neuron.amazonaws.com``, where the Neuron packages live.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from pipeline.backends.neuron_sdk import NEURON_INDEX
from pipeline.errors import PipelineError

PACKAGES = ("neuronx-cc", "torch-neuronx", "neuronx-distributed")
UP_TO_DATE, ERROR, UPGRADE_AVAILABLE = 0, 1, 3
PIP_TIMEOUT_S = 900


@dataclass
class PackageStatus:
    name: str
    installed: str | None
    newest: str
    status: str  # current | upgrade | missing


class UpgradeCheckError(PipelineError):
    """pip could not answer: the index is unreachable or does not have a package."""


def pip(python: str | None) -> list[str]:
    """pip, run against the environment of ``python`` (pip's own ``--python``), or this one when None.

    Never decided by resolving paths: a virtual environment's interpreter is a symlink to its base interpreter, so
    two environments can share one resolved path.
    """
    base = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    return base if python is None else [*base, "--python", python]


def run_pip(python: str | None, args: list[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([*pip(python), *args], capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise UpgradeCheckError(f"{what} failed (pip exit {proc.returncode}):\n{tail}")
    return proc


def installed_versions(python: str | None, packages: list[str]) -> dict[str, str | None]:
    listed = json.loads(run_pip(python, ["list", "--format", "json"], "listing the installed packages").stdout)
    found = {canonicalize_name(p["name"]): p["version"] for p in listed}
    return {name: found.get(canonicalize_name(name)) for name in packages}


def newest_versions(python: str | None, packages: list[str], index_args: list[str]) -> dict[str, str]:
    """What ``pip install`` would pick for each package now, ignoring what is installed (no dependencies)."""
    with tempfile.TemporaryDirectory(prefix="check-upgrades-") as tmp:
        report = Path(tmp) / "report.json"
        run_pip(python, ["install", "--dry-run", "--quiet", "--no-deps", "--ignore-installed", "--report",
                         str(report), *index_args, *packages], "asking the package index for the newest versions")
        chosen = json.loads(report.read_text()).get("install", [])
    versions = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in chosen}
    missing = [p for p in packages if canonicalize_name(p) not in versions]
    if missing:
        raise UpgradeCheckError(f"pip's report names no version for {missing}")
    return {p: versions[canonicalize_name(p)] for p in packages}


def compare(installed: dict[str, str | None], newest: dict[str, str]) -> list[PackageStatus]:
    statuses = []
    for name, latest in newest.items():
        have = installed.get(name)
        if have is None:
            status = "missing"
        else:
            try:
                status = "upgrade" if Version(latest) > Version(have) else "current"
            except InvalidVersion:
                status = "current" if latest == have else "upgrade"
        statuses.append(PackageStatus(name, have, latest, status))
    return statuses


def table(statuses: list[PackageStatus]) -> str:
    lines = [f"{'package':<22} {'installed':<22} {'newest':<22} status"]
    for s in statuses:
        lines.append(f"{s.name:<22} {s.installed or '(not installed)':<22} {s.newest:<22} {s.status}")
    return "\n".join(lines)


def index_arguments(args: argparse.Namespace) -> list[str]:
    """The index options for pip: exactly those given, or (none given) pip's own plus the Neuron repository."""
    if not (args.index_url or args.extra_index_url or args.find_links):
        return ["--extra-index-url", NEURON_INDEX]
    out = ["--index-url", args.index_url] if args.index_url else []
    for url in args.extra_index_url or []:
        out += ["--extra-index-url", url]
    for link in args.find_links or []:
        out += ["--find-links", link]
    return out


def apply(python: str | None, statuses: list[PackageStatus], index_args: list[str], rebuild: str, cwd: str) -> int:
    pins = [f"{s.name}=={s.newest}" for s in statuses if s.status != "current"]
    print(f"installing {' '.join(pins)}", flush=True)
    run_pip(python, ["install", *index_args, *pins], "installing the upgrades")
    print(f"rebuilding: {rebuild}", flush=True)
    return subprocess.run(shlex.split(rebuild), cwd=cwd).returncode


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline check-upgrades", description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", action="append", dest="packages",
                        help=f"a package to check (repeatable; default: {', '.join(PACKAGES)})")
    parser.add_argument("--python", help="the interpreter of the environment to check (default: this one)")
    parser.add_argument("--index-url", help="pip --index-url")
    parser.add_argument("--extra-index-url", action="append", help="pip --extra-index-url, repeatable")
    parser.add_argument("--find-links", action="append", help="pip --find-links, repeatable")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    parser.add_argument("--apply", action="store_true", help="install the upgrades, then run the rebuild command")
    parser.add_argument("--rebuild-command", default="dvc repro", help="run after --apply (default: dvc repro)")
    parser.add_argument("--cwd", default=".", help="where the rebuild command runs (default: here)")
    args = parser.parse_args(argv)
    packages = args.packages or list(PACKAGES)
    index_args = index_arguments(args)
    try:
        statuses = compare(installed_versions(args.python, packages),
                           newest_versions(args.python, packages, index_args))
    except (UpgradeCheckError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
        print(f"check-upgrades: {exc}", file=sys.stderr)
        return ERROR
    outdated = any(s.status != "current" for s in statuses)
    if args.json:
        print(json.dumps({"status": "upgrade" if outdated else "current",
                          "packages": [asdict(s) for s in statuses]}, indent=2))
    else:
        print(table(statuses))
    if not outdated:
        return UP_TO_DATE
    if not args.apply:
        return UPGRADE_AVAILABLE
    try:
        code = apply(args.python, statuses, index_args, args.rebuild_command, args.cwd)
    except (UpgradeCheckError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"check-upgrades: {exc}", file=sys.stderr)
        return ERROR
    if code != 0:
        print(f"check-upgrades: the rebuild ({args.rebuild_command}) exited with {code}", file=sys.stderr)
        return ERROR
    return UP_TO_DATE
