"""``python -m pipeline check-upgrades [--apply]``: does the Neuron repository offer a newer SDK release?

The installed Neuron packages are identified as one row of ``pipeline/backends/neuron_sdk.py``'s ``RELEASES``; the
target is the newest row the Neuron repository (``--neuron-index``, never pip's own index settings: pip gives its
indexes no priority, so a public upload would win) offers completely. ``--apply`` installs it from its hash-pinned
lock file (made first when missing) and runs the rebuild. Exit codes and every case: docs/rebuilds.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlparse
from urllib.request import url2pathname

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from pipeline.backends import neuron_sdk
from pipeline.backends.neuron_sdk import NEURON_INDEX, PINNED_TORCH, SdkRelease, release_part
from pipeline.cli import neuron_lock, plain
from pipeline.cli.neuron_lock import file_version
from pipeline.core.errors import PipelineError
from pipeline.core.log import EXIT_ERROR, exit_on_error, log, setup

PACKAGES = neuron_sdk.PACKAGES
UP_TO_DATE, ERROR, UPGRADE_AVAILABLE, TABLE_BEHIND = 0, EXIT_ERROR, 3, 4
EXIT_CODES = {"current": UP_TO_DATE, "upgrade": UPGRADE_AVAILABLE, "missing": UPGRADE_AVAILABLE, "mixed": ERROR,
              "newer-than-table": TABLE_BEHIND}
PIP_TIMEOUT_S = 900
PAGE_TIMEOUT_S = 30


class UpgradeCheckError(PipelineError):
    """The Neuron repository did not answer, lacks a package, or pip failed or chose a file from elsewhere."""


class ResolutionConflict(UpgradeCheckError):
    """pip's resolver found no versions meeting every requirement; ``conflict`` holds the lines naming them, and the
    message the fix (in ``base_lock``, when the caller resolved against one)."""

    def __init__(self, what: str, conflict: list[str], base_lock: Path | None = None):
        super().__init__(conflict_message(what, conflict, base_lock))
        self.what, self.conflict = what, conflict


@dataclass(frozen=True)
class Offer:
    """One file on the Neuron repository's page of a package."""

    name: str
    version: str
    url: str  # absolute, with the page's #sha256= fragment
    yanked: bool = False


@dataclass(frozen=True)
class PackageStatus:
    """One package of the plan: its installed and target versions, and ``missing``, ``current``, ``upgrade`` or
    ``change``."""

    name: str
    installed: str | None
    target: str | None
    status: str


@dataclass
class Plan:
    """The installed release, the target release and what to say about them."""

    status: str  # current | upgrade | missing | mixed | newer-than-table
    torch: str
    installed: dict[str, str | None]
    installed_release: str | None
    target_release: str | None = None
    target: dict[str, str] = field(default_factory=dict)  # package -> version as the repository offers it
    newer_than_table: list[str] = field(default_factory=list)  # "neuronx-cc 2.25.1.0"
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def packages(self) -> list[PackageStatus]:
        rows = []
        for name in PACKAGES:
            have, want = self.installed.get(name), self.target.get(name)
            status = ("missing" if have is None else "current" if want is None or same_release(have, want)
                      else "upgrade" if newer(want, have) else "change")
            rows.append(PackageStatus(name, have, want, status))
        return rows


# --- the Neuron repository's pages (PEP 503), read directly: pip cannot tell "unreachable" from "no such version"


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, bool]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "a" and found.get("href"):
            self.links.append((found["href"], "data-yanked" in found))  # PEP 592


def project_page(index: str, name: str) -> str:
    return f"{index.rstrip('/')}/{canonicalize_name(name)}/"


def unreachable(index: str, page: str, reason: object) -> UpgradeCheckError:
    return UpgradeCheckError(
        f"the Neuron repository {index} does not answer ({page}: {reason}). Check the URL (--neuron-index, default "
        f"{NEURON_INDEX}), this host's network access and its proxy settings (HTTPS_PROXY); no other index is asked "
        "for the Neuron packages, and nothing was installed")


def read_page(index: str, name: str, absent_ok: bool = False) -> str | None:
    """The repository's page for ``name``; an absent page (HTTP 404 or 403, no file) is an error, or None if
    ``absent_ok``. A 403 counts as absent because the Neuron repository is a static S3 site, and S3 answers 403, not
    404, for a key it does not hold when listing is not allowed; pip too takes a 403 page as "no such project"
    (pip/_internal/index/collector.py logs it and moves on). A repository that serves a name answers 200 for it, so
    no one else can make a served name look absent. Any other failure says nothing about the page: an error."""
    page = project_page(index, name)
    absent = UpgradeCheckError(f"the Neuron repository {index} has no page for {name} ({page}): is it a mirror of the "
                               "Neuron repository?")
    if urlparse(page).scheme == "file":  # as pip reads a file:// index: a directory's index.html
        root, path = Path(url2pathname(urlparse(index).path)), Path(url2pathname(urlparse(page).path))
        if not root.is_dir():
            raise unreachable(index, page, "no such directory")
        if not (path / "index.html").is_file():
            if absent_ok:
                return None
            raise absent
        return (path / "index.html").read_text()
    request = urllib.request.Request(page, headers={"Accept": "text/html"})
    try:
        with urllib.request.urlopen(request, timeout=PAGE_TIMEOUT_S) as response:
            return response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        if exc.code in (403, 404):
            if absent_ok:
                return None
            raise absent from exc
        raise unreachable(index, page, f"HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError) as exc:  # refused, unresolvable, TLS, timeout
        raise unreachable(index, page, getattr(exc, "reason", exc)) from exc


def offers(index: str, name: str, absent_ok: bool = False) -> list[Offer] | None:
    """The files on the repository's page for ``name`` (None: no such page, if ``absent_ok``)."""
    page = project_page(index, name)
    text = read_page(index, name, absent_ok)
    if text is None:
        return None
    parser = _Anchors()
    parser.feed(text)
    found = []
    for href, yanked in parser.links:
        url = urljoin(page, href)
        version = file_version(name, unquote(urlparse(urldefrag(url).url).path.rsplit("/", 1)[-1]))
        if version is not None:
            found.append(Offer(name, version, url, yanked))
    return found


# --- the table's rows against what the repository offers


def newer(a: str, b: str) -> bool:
    try:
        return Version(a) > Version(b)
    except InvalidVersion:
        return False


def same_release(a: str | None, b: str | None) -> bool:
    return release_part(a) == release_part(b)


def torch_of(torch_neuronx: str | None) -> str | None:
    """``2.8.0.2.12.22436`` -> ``2.8.0``: a torch-neuronx version is its torch version, then Neuron's."""
    try:
        return ".".join(str(p) for p in Version(torch_neuronx).release[:3]) if torch_neuronx else None
    except InvalidVersion:
        return None


def release_key(name: str, version: str) -> Version:
    """What orders a package's Neuron releases: torch-neuronx's Neuron part (``2.8.0.2.12.22436`` -> ``2.12.22436``,
    so a torch 2.7 build of a newer release still counts as newer), the public version otherwise."""
    parsed = Version(version)
    if name == "torch-neuronx":
        return Version(".".join(str(p) for p in parsed.release[3:]) or "0")
    return Version(parsed.public)


def offered_version(available: list[Offer], version: str) -> str | None:
    """The repository's spelling (build hash included) of ``version``, unless it is only offered yanked."""
    matching = [o.version for o in available if not o.yanked and same_release(o.version, version)]
    return max(matching, key=Version) if matching else None


def offered_row(row: SdkRelease, torch: str, available: dict[str, list[Offer]]) -> dict[str, str] | None:
    wanted = row.exact_versions(torch)
    if wanted is None:
        return None
    found = {name: offered_version(available[name], version) for name, version in wanted.items()}
    return found if all(found.values()) else None


def newest_first() -> list[SdkRelease]:
    return sorted(neuron_sdk.RELEASES, key=lambda r: Version(r.release), reverse=True)


def other_stack(name: str, version: str) -> bool:
    """libneuronxla 3.x: the native-PyTorch stack's, offered beside torch-neuronx's 2.2.x since SDK 2.30 (the
    manifest lists both), never a version of this pipeline's rows."""
    return name == "libneuronxla" and Version(version).release[0] >= 3


def newer_offers(available: dict[str, list[Offer]]) -> list[tuple[str, str]]:
    """(package, version) newer than every row knows (pre-releases, yanked files and ``other_stack`` aside)."""
    found = []
    for name, files in available.items():
        known = max(release_key(name, v) for row in neuron_sdk.RELEASES for v in row.versions()[name])
        versions = {o.version for o in files if not o.yanked and not Version(o.version).is_prerelease
                    and not other_stack(name, o.version)}
        found += [(name, v) for v in sorted(versions, key=Version) if release_key(name, v) > known]
    return found


def after_final_line(name: str, version: str) -> bool:
    """Whether ``version`` is of a line after the last release line for Inf2 (neuron_sdk.FINAL_LINE): neuronx-cc
    2.27 (SDK 2.32) and up, a torch-neuronx or neuronx-distributed past 2.31's. Their first two Neuron numbers
    decide: a patch release of the final line (neuronx-cc 2.26.x) is not after it. libneuronxla moves with the
    others and is never judged by itself (a 2.31 patch may bring a 2.3.x)."""
    if name == "libneuronxla":
        return False
    final = neuron_sdk.release(max((r.release for r in neuron_sdk.RELEASES if r.release.startswith(
        neuron_sdk.FINAL_LINE + ".")), key=Version))
    line = max(release_key(name, v).release[:2] for v in final.versions()[name])
    return release_key(name, version).release[:2] > line


def beyond_table(available: dict[str, list[Offer]]) -> list[str]:
    """Versions newer than every row knows that a row could still be added for (``after_final_line`` aside)."""
    return [f"{name} {v}" for name, v in newer_offers(available) if not after_final_line(name, v)]


def after_final(available: dict[str, list[Offer]]) -> list[str]:
    """Versions of lines after the last one for Inf2 (``after_final_line``): said, never a row to add."""
    return [f"{name} {v}" for name, v in newer_offers(available) if after_final_line(name, v)]


def plan(installed: dict[str, str | None], available: dict[str, list[Offer]], torch: str) -> Plan:
    row = neuron_sdk.identify(installed)
    result = Plan("current", torch, installed, row.release if row else None)
    target = next(((r, v) for r in newest_first() if (v := offered_row(r, torch, available))), None)
    if target:
        result.target_release, result.target = target[0].release, target[1]
    result.notes += torch_notes(result, available)
    later = after_final(available)
    if later or (row is not None and row.release.startswith(neuron_sdk.FINAL_LINE + ".")):
        offered = f"the Neuron repository offers {', '.join(later)}, of later lines: " if later else ""
        result.notes.append(offered + neuron_sdk.FINAL_NOTICE)
    result.newer_than_table = beyond_table(available)
    if result.newer_than_table:
        result.status = "newer-than-table"
    elif not any(installed.values()):
        result.status = "missing"
    elif row is None:
        result.status = "mixed"
        result.notes.append(neuron_sdk.mix_problem(installed))
    elif target and Version(target[0].release) > Version(row.release):
        result.status = "upgrade"
    elif target and Version(target[0].release) < Version(row.release):
        result.notes.append(f"the installed release {row.release} is newer than the newest the repository offers "
                            f"completely ({target[0].release}): nothing to do")
    return result


def torch_notes(result: Plan, available: dict[str, list[Offer]]) -> list[str]:
    """A newer release offered only for other torch versions is not a target: moving torch is a decision."""
    floor = Version(result.target_release or result.installed_release or "0")
    for row in newest_first():
        if Version(row.release) <= floor:
            break
        others = [t for t in {torch_of(b) for b in row.torch_neuronx} if t and t != result.torch]
        if any(offered_row(row, t, available) for t in others):
            return [f"release {row.release} is offered only for torch {', '.join(sorted(others))}, not for torch "
                    f"{result.torch} (the installed torch-neuronx's): --torch VERSION targets it, torch included"]
    return []


# --- pip


def pip(python: str | None) -> list[str]:
    """pip, run against the environment of ``python`` (pip's own ``--python``), or this one when None.

    Never decided by resolving paths: a virtual environment's interpreter is a symlink to its base interpreter, so
    two environments can share one resolved path.
    """
    base = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    return base if python is None else [*base, "--python", python]


def run_pip(python: str | None, args: list[str], what: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    proc = subprocess.run([*pip(python), *args], capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env)
    if proc.returncode != 0:
        conflict = conflict_lines(f"{proc.stdout or ''}\n{proc.stderr or ''}")  # pip says the conflict on stdout
        if conflict:
            raise ResolutionConflict(what, conflict)
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise UpgradeCheckError(f"{what} failed (pip exit {proc.returncode}):\n{tail}")
    return proc


def conflict_lines(output: str) -> list[str]:
    """What pip's resolver names when no version satisfies every requirement (``ResolutionImpossible``): the lines
    under "The conflict is caused by:", each a requirement and who asked for it (pip's
    resolution/resolvelib/factory.py ``get_installation_error``). Empty for any other failure."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "The conflict is caused by:"), None)
    if start is None:
        return []
    found = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        found.append(line.strip())
    return found


def conflict_message(what: str, conflict: list[str], base_lock: Path | None = None) -> str:
    """The refusal for a resolution whose requirements contradict each other, naming them and the fix. A pin of the
    base lock shows as "The user requested (constraint) NAME==VERSION"."""
    pinned = [line.split()[-1] for line in conflict if line.startswith("The user requested (constraint)")]
    where = f" ({base_lock})" if base_lock else ""
    fix = (f"move {', '.join(pinned)} in the base lock{where} to a version every line above allows: "
           "add that bound to the lock's inputs (pyproject.toml) and run `make lock`, then commit the lock"
           if pinned else "change the requirement that the base lock cannot meet")
    return (f"{what}: no set of versions meets every requirement; pip's resolver names the conflict:\n"
            + "\n".join(f"  {line}" for line in conflict) + f"\nNothing was installed. To fix it: {fix}")


def installed_versions(python: str | None, packages: tuple[str, ...] | list[str] = PACKAGES) -> dict[str, str | None]:
    listed = json.loads(run_pip(python, ["list", "--format", "json"], "listing the installed packages").stdout)
    found = {canonicalize_name(p["name"]): p["version"] for p in listed}
    return {name: found.get(canonicalize_name(name)) for name in packages}


def only_the_neuron_index(index: str, empty_dir: str) -> dict[str, str]:
    """pip's environment for choosing the Neuron files: no index or find-links but ``index``.

    ``--index-url`` on the command line overrides pip.conf's and PIP_INDEX_URL, but pip.conf's extra-index-url and
    find-links would still be added, and an empty PIP_* variable does not clear them (pip skips empty values); a
    variable does override a config file (pip's docs, "Configuration": environment variables come after the files).
    So extra-index-url is set to the Neuron index itself and find-links to an empty directory. Proxy, certificate
    and timeout settings stay as configured.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_NO_INDEX", "PIP_CONSTRAINT", "PIP_REQUIREMENT")}
    return {**env, "PIP_INDEX_URL": index, "PIP_EXTRA_INDEX_URL": index, "PIP_FIND_LINKS": empty_dir}


def chosen_files(python: str | None, index: str, versions: dict[str, str], available: dict[str, list[Offer]]
                 ) -> dict[str, str]:
    """The file pip would install for each exact version (its platform tags decide between a release's wheels),
    checked to be one of the Neuron repository's own files: package -> that file's URL."""
    own = {unquote(urldefrag(o.url).url): o.url for files in available.values() for o in files}
    with tempfile.TemporaryDirectory(prefix="check-upgrades-") as tmp:
        report = Path(tmp) / "report.json"
        run_pip(python, ["install", "--dry-run", "--no-deps", "--ignore-installed", "--index-url", index,
                         "--report", str(report), *[f"{n}=={v}" for n, v in versions.items()]],
                f"asking the Neuron repository {index} for the files of {', '.join(versions.values())}",
                env=only_the_neuron_index(index, tmp))
        chosen = neuron_lock.report_files(report)
    files = {}
    for file in chosen:
        url = unquote(urldefrag(file.url).url)
        if url not in own:
            raise UpgradeCheckError(f"pip chose {file.name} {file.version} from {url}, which is not a file "
                                    f"of the Neuron repository {index}: nothing was installed")
        files[file.name] = own[url]
    missing = [n for n in versions if canonicalize_name(n) not in files]
    if missing:
        raise UpgradeCheckError(f"pip's report names no file for {missing}")
    return {n: files[canonicalize_name(n)] for n in versions}


def resolve(python: str | None, args: list[str], what: str, env: dict[str, str] | None = None
            ) -> list[neuron_lock.Chosen]:
    """What ``pip <args>`` (an install) would install, as its ``--report`` lists it, installing nothing."""
    with tempfile.TemporaryDirectory(prefix="check-upgrades-") as tmp:
        report = Path(tmp) / "report.json"
        run_pip(python, [*args, "--dry-run", "--report", str(report)], what, env=env)
        return neuron_lock.report_files(report)


def checked_files(index: str, chosen: list[neuron_lock.Chosen], available: dict[str, list[Offer]]
                  ) -> list[tuple[neuron_lock.Chosen, str]]:
    """Each file of pip's resolution ``chosen`` and the URL it is pinned to: a package the Neuron repository serves
    (it has a page for the name) only as a file listed on that page, else nothing is installed; any other package
    as pip chose it through your pip settings."""
    files = []
    for item in chosen:
        name, version, url = item.name, item.version, item.url
        served = available.get(name)
        if served is None:
            served = offers(index, name, absent_ok=True)
        if served is None:  # no page: not a Neuron package
            files.append((item, url))
            continue
        own = {unquote(urldefrag(o.url).url): o.url for o in served}
        if unquote(urldefrag(url).url) not in own:
            raise UpgradeCheckError(
                f"pip would install {name} {version} from {url}, which is not a file of the Neuron repository {index} "
                f"although that repository serves {name} ({project_page(index, name)}): most likely a higher version "
                "on another of your indexes (pip takes the highest from any index). Nothing was installed; "
                f"remove that index from your pip settings or find out who published {name} {version} there")
        files.append((item, own[unquote(urldefrag(url).url)]))
    return files


def lock_entries(python: str | None, index: str, release: str, versions: dict[str, str],
                 available: dict[str, list[Offer]], base_lock: Path | None) -> list[neuron_lock.Locked]:
    """What release ``release`` adds to an environment installed from ``base_lock``, each file pinned, every name the
    Neuron repository serves taken from it alone (pip would take a higher public upload of such a name).

    Resolved twice, as dry runs with ``--ignore-installed``: with your pip settings plus the Neuron repository under
    the base lock's versions (the public files the release needs), then with the Neuron repository as the only index
    and those files as constraints. The four Neuron packages are ``name @ url`` in both (pip asks no index for them:
    resolvelib/factory.py ``_iter_found_candidates``); ``checked_files`` holds each locked Neuron name to its page.
    """
    if base_lock is None or not base_lock.is_file():
        log.warning("check-upgrades: no base lock at %s: the new lock is resolved against nothing and locks every "
                    "package the release needs", base_lock)
    files = chosen_files(python, index, versions, available)
    direct = [f"{name} @ {url}" for name, url in files.items()]
    served = {canonicalize_name(n): f for n, f in available.items()}
    with tempfile.TemporaryDirectory(prefix="check-upgrades-") as tmp:
        try:
            first = resolve(python, ["install", "--ignore-installed", "--extra-index-url", index,
                                     *neuron_lock.constraints(base_lock, Path(tmp)), *direct],
                            f"resolving release {release}")
        except ResolutionConflict as exc:  # the fix names the base lock this release was resolved against
            raise ResolutionConflict(exc.what, exc.conflict, base_lock) from None
        public = []
        for item in first:
            name, url = item.name, item.url
            if name not in served:
                served[name] = offers(index, name, absent_ok=True)
            if served[name] is None:
                public.append(f"{name} @ {url}")
            elif not any(unquote(urldefrag(o.url).url) == unquote(urldefrag(url).url) for o in served[name]):
                log.warning("check-upgrades: another index offers %s %s (%s), passed over: only the Neuron "
                            "repository's files of %s are locked. Find out who published it there", name,
                            item.version, url, name)
        (Path(tmp) / "public.txt").write_text("\n".join(public) + "\n")
        final = resolve(python, ["install", "--ignore-installed", "--index-url", index, "--constraint",
                                 str(Path(tmp) / "public.txt"), *direct],
                        f"resolving release {release} against the Neuron repository alone",
                        env=only_the_neuron_index(index, tmp))
    base = neuron_lock.pinned_names(base_lock)
    entries = []
    for item, url in checked_files(index, final, {k: v for k, v in served.items() if v is not None}):
        name, version = item.name, item.version
        if base.get(name) == version:  # installed by the base lock already
            continue
        entries.append(neuron_lock.Locked(name, version, urldefrag(url).url, neuron_lock.sha256_of(item)))
    return entries


def install(python: str | None, index: str, release: str, versions: dict[str, str],
            available: dict[str, list[Offer]], lock_dir: Path, base_lock: Path | None) -> Path:
    """Install release ``release`` (``versions``: each package as the Neuron repository spells it) from its lock
    (pipeline/cli/neuron_lock.py), making the lock first if there is none. Returns the lock's path."""
    lock = make_lock(python, index, release, versions, available, lock_dir, base_lock)
    install_locked(python, lock, release, versions)
    return lock


def make_lock(python: str | None, index: str, release: str, versions: dict[str, str],
              available: dict[str, list[Offer]], lock_dir: Path, base_lock: Path | None) -> Path:
    """Release ``release``'s lock, made first when there is none (dry runs only: nothing is installed). Returns its
    path."""
    lock = neuron_lock.lock_file(lock_dir, release, torch_of(versions["torch-neuronx"]))
    if not lock.is_file():
        entries = lock_entries(python, index, release, versions, available, base_lock)
        neuron_lock.write(lock, entries, release, torch_of(versions["torch-neuronx"]), index)
        log.warning("check-upgrades: wrote %s (%d files, each pinned by URL and sha256): commit it, so that every "
                    "host installs these very files", lock, len(entries))
    return lock


def install_locked(python: str | None, lock: Path, release: str, versions: dict[str, str]) -> None:
    """``pip install`` exactly the lock's files: by their URLs (no index is asked), each refused unless its bytes
    hash to the lock's sha256, no dependency added; then the environment must hold the release, and nothing the
    lock installed may lack a dependency (``pip check``, on the lock's packages)."""
    try:
        entries = neuron_lock.read(lock)
    except neuron_lock.LockError as exc:
        raise UpgradeCheckError(f"{exc}: make it again (delete it and rerun) or restore it from git") from None
    locked = {e.name: e.version for e in entries}
    wrong = {n: locked.get(canonicalize_name(n)) for n, v in versions.items()
             if not same_release(locked.get(canonicalize_name(n)), v)}
    if wrong:
        raise UpgradeCheckError(f"{lock} does not lock release {release}: it has {wrong}, the release needs "
                                f"{versions}; nothing was installed")
    print(f"installing release {release}: " + " ".join(f"{n}=={v}" for n, v in versions.items()), flush=True)
    run_pip(python, ["install", "--no-deps", "--no-index", "--require-hashes", "-r", str(lock)],
            f"installing the files of {lock} (each checked against its sha256)")
    now = installed_versions(python)
    wrong = {n: v for n, v in now.items() if not same_release(v, versions[n])}
    if wrong:
        raise UpgradeCheckError(f"after installing release {release}, the environment has {wrong}")
    broken = [line for line in subprocess.run([*pip(python), "check"], capture_output=True, text=True,
                                              timeout=PIP_TIMEOUT_S).stdout.splitlines()
              if canonicalize_name(line.split(" ", 1)[0]) in locked]
    if broken:
        raise UpgradeCheckError(f"after installing {lock}, its packages lack dependencies: {'; '.join(broken)}. The "
                                "lock (or the base lock beneath it) misses them: delete the lock and rerun to make it "
                                "again")


# --- output and the command


def table(result: Plan) -> str:
    lines = [f"installed release: {result.installed_release or '(none of the table)'}    "
             f"target release: {result.target_release or '(none offered)'}    torch: {result.torch}",
             f"{'package':<22} {'installed':<26} {'target':<26} status"]
    for p in result.packages():
        lines.append(f"{p.name:<22} {p.installed or '(not installed)':<26} {p.target or '-':<26} {p.status}")
    return "\n".join(lines)


def messages(result: Plan) -> list[str]:
    out = list(result.notes)
    if result.newer_than_table:
        out.append(f"the Neuron repository offers {', '.join(result.newer_than_table)}, newer than every release in "
                   "pipeline/backends/neuron_sdk.py's table: add the new release's row there (its versions are in "
                   "Neuron's n2-manifest.json, aws-neuron/aws-neuron-sdk src/helperscripts) before upgrading; "
                   "nothing is installed until then")
    if result.status == "mixed" and result.target_release:
        out.append(f"--apply replaces them with release {result.target_release}")
    return out


def document(result: Plan, index: str) -> dict:
    return {"status": result.status, "index": index, "torch": result.torch,
            "installed": {"release": result.installed_release, "versions": result.installed},
            "target": {"release": result.target_release, "versions": result.target},
            "newer_than_table": result.newer_than_table, "notes": messages(result),
            "packages": [asdict(p) for p in result.packages()]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline check-upgrades",
                                     description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("--python", help="the interpreter of the environment to check (default: this one)")
    parser.add_argument("--neuron-index", default=NEURON_INDEX,
                        help=f"the Neuron repository or a mirror of it, the only source of the Neuron packages "
                             f"(default: {NEURON_INDEX})")
    parser.add_argument("--torch", help="the torch version whose torch-neuronx build to target (default: the "
                                        f"installed torch-neuronx's, else {PINNED_TORCH})")
    parser.add_argument("--json", action="store_true", help="print a JSON document instead of a table")
    parser.add_argument("--apply", action="store_true", help="install the target release, then run the rebuild command")
    parser.add_argument("--rebuild-command", default="dvc repro", help="run after --apply (default: dvc repro)")
    parser.add_argument("--cwd", default=".", help="where the rebuild command runs (default: here)")
    add_lock_arguments(parser)
    args = parser.parse_args(argv)
    setup()
    with exit_on_error():
        code = check(args)
    return code


def add_lock_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lock-dir", default=str(neuron_lock.LOCK_DIR),
                        help=f"where each release's lock file is read, or written when missing (default: "
                             f"{neuron_lock.LOCK_DIR})")
    parser.add_argument("--base-lock", default=str(neuron_lock.BASE_LOCK),
                        help=f"the environment's base lock, whose versions a new lock is resolved against (default: "
                             f"{neuron_lock.BASE_LOCK})")


def check(args: argparse.Namespace) -> int:
    """The command's work: a failure to ask pip or the repository is an UpgradeCheckError (exit code ERROR)."""
    try:
        installed = installed_versions(args.python)
        available = {name: offers(args.neuron_index, name) for name in PACKAGES}
        result = plan(installed, available, args.torch or torch_of(installed["torch-neuronx"]) or PINNED_TORCH)
    except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
        raise UpgradeCheckError(str(exc)) from None
    print(json.dumps(document(result, args.neuron_index), indent=2) if args.json else table(result))
    for message in messages(result):
        log.warning("check-upgrades: %s", message)
    if result.status in ("missing", "mixed") and result.target_release is None:
        raise UpgradeCheckError(f"the Neuron repository {args.neuron_index} offers no complete release of the table "
                                f"for torch {result.torch}")
    if not args.apply or result.status in ("current", "newer-than-table"):
        return result.exit_code
    try:
        install(args.python, args.neuron_index, result.target_release, result.target, available,
                Path(args.lock_dir), Path(args.base_lock))
        print(f"rebuilding: {args.rebuild_command}", flush=True)
        code = subprocess.run(shlex.split(args.rebuild_command), cwd=args.cwd).returncode
    except (subprocess.TimeoutExpired, OSError) as exc:
        raise UpgradeCheckError(str(exc)) from None
    if code != 0:
        raise UpgradeCheckError(f"the rebuild ({args.rebuild_command}) exited with {code}")
    return UP_TO_DATE
