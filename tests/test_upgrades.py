"""check-upgrades against file:// simple indexes (PEP 503) of stand-in wheels, in a throwaway environment.

The stand-ins carry the real versions of pipeline/backends/neuron_sdk.py's rows; a "public" index beside the Neuron
one plays PyPI, reaching pip as it does in production (pip.conf, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import pytest

from pipeline.backends import neuron_sdk
from pipeline.cli import neuron_lock, upgrades

# Build hashes (local versions), as Neuron's wheels carry them: f702b353 is 2.28.1's neuronx-cc; the rest stand-ins.
HASHES = {"2.23.6484.0": "f702b353", "2.21.33363.0": "5f4c2a10", "2.8.0.2.12.22436": "b8c0a3d1",
          "2.8.0.2.10.16998": "9e1d7c44", "2.24.8799.0": "0c3e9b72"}
PLACEHOLDER = "1.0.post1"  # what PyPI serves as neuronx-cc, torch-neuronx, neuronx-distributed


def hashed(version: str) -> str:
    return f"{version}+{HASHES[version]}" if version in HASHES else version


def row(release: str, torch: str = "2.8.0") -> dict[str, str]:
    """The exact versions (build hashes included) of a release of the table, with torch's torch-neuronx build."""
    return {name: hashed(v) for name, v in neuron_sdk.release(release).exact_versions(torch).items()}


def wheel(directory: Path, name: str, version: str, requires: list[str] | None = None) -> Path:
    """A minimal pure-Python wheel of ``name`` ``version`` (metadata with ``requires`` as Requires-Dist, one module,
    RECORD)."""
    dist = name.replace("-", "_")
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires or [])
    files = {
        f"{dist}_stand_in/__init__.py": f"__version__ = {version!r}\n",
        f"{dist}-{version}.dist-info/METADATA": metadata,
        f"{dist}-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}-{version}.dist-info/RECORD,,")
    files[f"{dist}-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    out = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return out


def simple_index(root: Path, releases: dict[str, list[str]], requires: dict[str, list[str]] | None = None) -> str:
    """A PEP 503 simple index under ``root`` (every wheel of a name in ``requires`` requiring those); returns its
    file:// URL."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    names = []
    for name, versions in releases.items():
        project = root / "simple" / name
        project.mkdir(parents=True, exist_ok=True)
        links = [f'<a href="{wheel(wheels, name, v, (requires or {}).get(name)).as_uri()}">{name}-{v}</a>'
                 for v in versions]
        (project / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
        names.append(f'<a href="{name}/">{name}</a>')
    (root / "simple" / "index.html").write_text("<html><body>" + "".join(names) + "</body></html>\n")
    return (root / "simple").as_uri()


def neuron_index(root: Path, releases: list[str], extra: dict[str, list[str]] | None = None,
                 requires: dict[str, list[str]] | None = None) -> str:
    """A stand-in Neuron repository offering whole rows of the table (every torch build) plus ``extra`` versions (of
    other packages too)."""
    offered: dict[str, list[str]] = {name: [] for name in neuron_sdk.PACKAGES}
    for name, versions in (extra or {}).items():
        offered.setdefault(name, []).extend(versions)
    for release in releases:
        for name, versions in neuron_sdk.release(release).versions().items():
            offered[name] += [hashed(v) for v in versions if hashed(v) not in offered[name]]
    return simple_index(root, offered, requires)


def public_index(root: Path, version: str) -> str:
    """PyPI's stand-in: ``version`` of every Neuron package (placeholders, or a hostile higher upload)."""
    return simple_index(root, {name: [version] for name in neuron_sdk.PACKAGES})


@pytest.fixture
def isolated_pip(monkeypatch):
    """pip sees only the indexes a test names (no user/site pip.conf, no find-links from the environment)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)


def environment(tmp_path: Path, versions: dict[str, str]) -> str:
    """A new environment with ``versions`` installed from an index of their own; returns its python."""
    setup = simple_index(tmp_path / "setup", {name: [v] for name, v in versions.items()})
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    python = str(tmp_path / "env" / "bin" / "python")
    subprocess.run([*upgrades.pip(python), "install", "--quiet", "--index-url", setup,
                    *[f"{k}=={v}" for k, v in versions.items()]], check=True, capture_output=True)
    return python


@pytest.fixture
def env(tmp_path, isolated_pip) -> str:
    """An environment with release 2.26.1 installed (torch 2.8.0's torch-neuronx build)."""
    return environment(tmp_path, row("2.26.1"))


def check(python: str, *args: str, lock_dir: Path | None = None) -> subprocess.CompletedProcess:
    """check-upgrades on ``python``'s environment; its release locks go to ``lock_dir`` (by default a new folder,
    never the checkout's deploy/lock/), with no base lock beneath them."""
    lock_dir = lock_dir or Path(tempfile.mkdtemp(prefix="locks-"))
    return subprocess.run([sys.executable, "-m", "pipeline", "check-upgrades", "--python", python, *args,
                           "--lock-dir", str(lock_dir), "--base-lock", str(lock_dir / "no-base-lock.txt")],
                          capture_output=True, text=True)


def rebuild_marker(tmp_path: Path) -> tuple[Path, str]:
    marker = tmp_path / "rebuilt"
    return marker, f"{sys.executable} -c \"open('{marker}', 'w').write('yes')\""


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_upgrade_applies_a_whole_release_then_the_stack_is_current(env, tmp_path):
    # 2.29.1 is offered whole but only for torch 2.9; a pre-release of neuronx-cc is never a release.
    index = neuron_index(tmp_path / "neuron", ["2.26.1", "2.28.1", "2.29.1"], {"neuronx-cc": ["2.25.0.0rc1"]})
    found = check(env, "--neuron-index", index, "--json")
    assert found.returncode == upgrades.UPGRADE_AVAILABLE, found.stderr
    report = json.loads(found.stdout)
    assert report["status"] == "upgrade" and report["torch"] == "2.8.0"
    assert report["installed"] == {"release": "2.26.1", "versions": row("2.26.1")}
    assert report["target"] == {"release": "2.28.1", "versions": row("2.28.1")}
    assert {p["name"]: p["status"] for p in report["packages"]} == dict.fromkeys(neuron_sdk.PACKAGES, "upgrade")
    assert "release 2.29.1 is offered only for torch 2.9.0" in found.stderr
    marker, rebuild = rebuild_marker(tmp_path)
    applied = check(env, "--neuron-index", index, "--apply", "--rebuild-command", rebuild)
    assert applied.returncode == upgrades.UP_TO_DATE, applied.stdout + applied.stderr
    assert "installing release 2.28.1" in applied.stdout and marker.read_text() == "yes"
    assert upgrades.installed_versions(env) == row("2.28.1")  # every package of the row, none ahead (2.24.8799.0)
    assert upgrades.installed_versions(None, ["neuronx-cc"]) == {"neuronx-cc": None}  # this environment untouched
    again = check(env, "--neuron-index", index)
    assert again.returncode == upgrades.UP_TO_DATE, again.stderr
    assert "target release: 2.28.1" in again.stdout and "upgrade" not in again.stdout


def test_one_package_of_a_newer_release_is_not_an_upgrade(env, tmp_path):
    index = neuron_index(tmp_path / "neuron", ["2.26.1"], {"neuronx-cc": [hashed("2.23.6484.0")]})
    result = check(env, "--neuron-index", index, "--apply", "--rebuild-command", "false")
    assert result.returncode == upgrades.UP_TO_DATE, result.stderr
    assert upgrades.installed_versions(env) == row("2.26.1")


@pytest.mark.parametrize("where", ["missing directory", "closed port"])
def test_an_unreachable_neuron_repository_is_an_error_naming_it(env, tmp_path, where):
    index = (tmp_path / "nowhere").as_uri() if where == "missing directory" else f"http://127.0.0.1:{closed_port()}/"
    marker, rebuild = rebuild_marker(tmp_path)
    result = check(env, "--neuron-index", index, "--apply", "--rebuild-command", rebuild)
    assert result.returncode == upgrades.ERROR
    assert f"the Neuron repository {index} does not answer" in result.stderr and "network access" in result.stderr
    assert upgrades.installed_versions(env) == row("2.26.1") and not marker.exists()


def test_public_placeholders_are_never_reported_or_installed(env, tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", public_index(tmp_path / "public", PLACEHOLDER))
    gone = (tmp_path / "nowhere").as_uri()
    for args in ([], ["--json"], ["--apply", "--rebuild-command", "true"]):
        result = check(env, "--neuron-index", gone, *args)
        assert result.returncode == upgrades.ERROR and gone in result.stderr
        assert PLACEHOLDER not in result.stdout + result.stderr
    assert upgrades.installed_versions(env) == row("2.26.1")


def test_a_higher_public_version_loses_to_the_neuron_repository(env, tmp_path, monkeypatch):
    # The dependency-confusion set-up: pip.conf reads PyPI first and the Neuron repository as an extra index, and
    # PyPI serves 99.0 of every Neuron package. pip alone would install 99.0 (no priority between indexes).
    index = neuron_index(tmp_path / "neuron", ["2.26.1", "2.28.1"])
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {public_index(tmp_path / 'public', '99.0')}\nextra-index-url = {index}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", f"{index} {public_index(tmp_path / 'public2', '98.0')}")
    found = check(env, "--neuron-index", index, "--json")
    assert found.returncode == upgrades.UPGRADE_AVAILABLE, found.stderr
    assert json.loads(found.stdout)["target"] == {"release": "2.28.1", "versions": row("2.28.1")}
    assert "99.0" not in found.stdout and "98.0" not in found.stdout
    applied = check(env, "--neuron-index", index, "--apply", "--rebuild-command", "true")
    assert applied.returncode == upgrades.UP_TO_DATE, applied.stdout + applied.stderr
    assert upgrades.installed_versions(env) == row("2.28.1")


def test_a_dependency_only_the_neuron_repository_serves_comes_from_it_whatever_another_index_offers(env, tmp_path,
                                                                                                   monkeypatch):
    # torch-neuronx requires aws-neuronx-runtime-discovery, which only the Neuron repository serves (2.9). pip.conf in
    # production reads PyPI first and the Neuron repository as an extra index; a higher upload to PyPI (99.0, with a
    # dependency of its own) would win in pip (no priority between indexes). --apply installs the Neuron repository's
    # 2.9, names the other upload, and neither it nor its dependency is locked or installed.
    discovery = "aws-neuronx-runtime-discovery"
    index = neuron_index(tmp_path / "neuron", ["2.26.1", "2.28.1"], {discovery: ["2.9"]},
                         {"torch-neuronx": [discovery]})
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", index)
    marker, rebuild = rebuild_marker(tmp_path)
    hostile = simple_index(tmp_path / "hostile", {discovery: ["99.0"], "evil-extra": ["1.0"]},
                           {discovery: ["evil-extra"]})
    monkeypatch.setenv("PIP_INDEX_URL", hostile)
    locks = tmp_path / "locks"
    applied = check(env, "--neuron-index", index, "--apply", "--rebuild-command", rebuild, lock_dir=locks)
    assert applied.returncode == upgrades.UP_TO_DATE, applied.stdout + applied.stderr
    assert f"another index offers {discovery} 99.0 ({tmp_path.as_uri()}/hostile/" in applied.stderr
    assert upgrades.installed_versions(env, [*neuron_sdk.PACKAGES, discovery, "evil-extra"]) == {
        **row("2.28.1"), discovery: "2.9", "evil-extra": None}
    locked = neuron_lock.read(locks / "neuron-2.28.1-torch2.8.0.txt")
    assert {e.name: e.version for e in locked} == {**row("2.28.1"), discovery: "2.9"}
    assert marker.read_text() == "yes"


def test_a_release_newer_than_the_table_is_reported_and_nothing_installed(env, tmp_path):
    # a patch release of the last line for Inf2 (2.31's compiler is 2.26.6360.0): its row is still to be added
    index = neuron_index(tmp_path / "neuron", ["2.26.1", "2.28.1"], {"neuronx-cc": ["2.26.9999.0+7d2e9a01"]})
    marker, rebuild = rebuild_marker(tmp_path)
    for args in ([], ["--apply", "--rebuild-command", rebuild]):
        result = check(env, "--neuron-index", index, *args)
        assert result.returncode == upgrades.TABLE_BEHIND, result.stderr
        assert "offers neuronx-cc 2.26.9999.0+7d2e9a01, newer than every release" in result.stderr
        assert "pipeline/backends/neuron_sdk.py" in result.stderr and "n2-manifest.json" in result.stderr
    report = json.loads(check(env, "--neuron-index", index, "--json").stdout)
    assert report["status"] == "newer-than-table" and report["newer_than_table"] == ["neuronx-cc 2.26.9999.0+7d2e9a01"]
    assert upgrades.installed_versions(env) == row("2.26.1") and not marker.exists()


def test_a_mixed_stack_is_an_error_that_apply_repairs_and_nothing_installed_is_an_upgrade(env, tmp_path):
    index = neuron_index(tmp_path / "neuron", ["2.26.1", "2.28.1"])
    subprocess.run([*upgrades.pip(env), "install", "--quiet", "--no-deps", "--index-url", index,
                    f"neuronx-cc=={hashed('2.23.6484.0')}"], check=True)
    mixed = check(env, "--neuron-index", index)
    assert mixed.returncode == upgrades.ERROR
    assert "not one Neuron SDK release" in mixed.stderr and "--apply replaces them with release 2.28.1" in mixed.stderr
    repaired = check(env, "--neuron-index", index, "--apply", "--rebuild-command", "true")
    assert repaired.returncode == upgrades.UP_TO_DATE, repaired.stderr
    assert upgrades.installed_versions(env) == row("2.28.1")
    subprocess.run([*upgrades.pip(env), "uninstall", "--yes", "--quiet", *neuron_sdk.PACKAGES], check=True)
    missing = check(env, "--neuron-index", index)
    assert missing.returncode == upgrades.UPGRADE_AVAILABLE and "(not installed)" in missing.stdout


def test_a_failed_rebuild_is_an_error(env, tmp_path):
    index = neuron_index(tmp_path / "neuron", ["2.28.1"])
    result = check(env, "--neuron-index", index, "--apply", "--rebuild-command", f"{sys.executable} -c 'exit(4)'")
    assert result.returncode == upgrades.ERROR and "exited with 4" in result.stderr


def test_a_page_is_read_as_pip_reads_it_and_newer_builds_count_by_their_neuron_part(tmp_path):
    page = tmp_path / "simple" / "neuronx-cc"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        '<a href="../../files/neuronx_cc-2.23.6484.0%2Bf702b353-cp311-cp311-linux_x86_64.whl#sha256=00">w</a>\n'
        '<a href="neuronx_cc-2.24.5133.0.tar.gz" data-yanked="broken">s</a>\n<a href="other_pkg-9.0.tar.gz">o</a>\n')
    found = upgrades.offers((tmp_path / "simple").as_uri(), "neuronx-cc")
    assert [(o.version, o.yanked) for o in found] == [("2.23.6484.0+f702b353", False), ("2.24.5133.0", True)]
    assert found[0].url == (tmp_path / "files").as_uri() + "/neuronx_cc-2.23.6484.0%2Bf702b353-cp311-cp311-" \
                                                           "linux_x86_64.whl#sha256=00"
    newest = neuron_sdk.RELEASES[-1]
    available = {name: [upgrades.Offer(name, v, "u") for v in vs] for name, vs in newest.versions().items()}
    assert upgrades.beyond_table(available) == []
    available["torch-neuronx"].append(upgrades.Offer("torch-neuronx", "2.8.0.2.15.40000", "u"))  # Neuron 2.15
    assert upgrades.beyond_table(available) == ["torch-neuronx 2.8.0.2.15.40000"]


def test_releases_after_the_last_line_for_inf2_are_said_plainly_and_never_wait_for_a_row():
    """From SDK 2.32 Neuron ships no torch-neuronx or neuronx-distributed (Inf2 stays at 2.31, security and critical
    fixes only): its compiler (2.27.x) and the native stack's libneuronxla 3.0.x, offered beside 2.31's, are no row
    to add (no exit 4, "table behind", on every scheduled run from then on); the notice says no newer release will
    support this hardware. A patch of 2.31's own line still is a row to add."""
    final = neuron_sdk.release("2.31.0")
    available = {name: [upgrades.Offer(name, v, "u") for v in vs] for name, vs in final.versions().items()}
    available["neuronx-cc"].append(upgrades.Offer("neuronx-cc", "2.27.5334.0", "u"))  # SDK 2.32's
    available["libneuronxla"] += [upgrades.Offer("libneuronxla", v, "u") for v in ("3.0.3854.0", "3.0.5356.0")]
    installed = final.exact_versions("2.9.0")
    result = upgrades.plan(installed, available, "2.9.0")
    assert result.status == "current" and result.exit_code == upgrades.UP_TO_DATE and result.newer_than_table == []
    notice = [n for n in result.notes if neuron_sdk.FINAL_NOTICE in n]
    assert len(notice) == 1 and "offers neuronx-cc 2.27.5334.0, of later lines" in notice[0]
    assert "no newer release will support this hardware" in notice[0]
    available["neuronx-cc"].append(upgrades.Offer("neuronx-cc", "2.26.7000.0", "u"))  # a 2.31 patch
    assert upgrades.plan(installed, available, "2.9.0").status == "newer-than-table"
    # On 2.28.1, with the repository as it is (libneuronxla 3.0.x beside 2.30's and 2.31's rows): an upgrade to
    # 2.31 is offered for torch 2.9, and no notice yet (the native stack's libneuronxla is not a later line)
    offered = {name: [upgrades.Offer(name, v, "u") for r in ("2.28.1", "2.30.0", "2.31.0")
                      for v in neuron_sdk.release(r).versions()[name]] for name in neuron_sdk.PACKAGES}
    offered["libneuronxla"] += [upgrades.Offer("libneuronxla", v, "u") for v in ("3.0.2891.0", "3.0.3854.0")]
    older = upgrades.plan(neuron_sdk.release("2.28.1").exact_versions("2.8.0"), offered, "2.8.0")
    assert older.status == "current" and older.newer_than_table == []
    assert not [n for n in older.notes if neuron_sdk.FINAL_NOTICE in n]  # said where it applies, not everywhere



# -- the first install: one release from its lock file -------------------------------------------------------------

def empty_environment(path: Path) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return str(path / "bin" / "python")


def install_neuron(python: str, lock_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "install-neuron", "--python", python, *args,
                           "--lock-dir", str(lock_dir), "--base-lock", str(lock_dir / "no-base-lock.txt")],
                          capture_output=True, text=True)


def test_the_first_install_takes_every_neuron_file_from_the_neuron_repository_by_sha256(tmp_path, isolated_pip,
                                                                                         monkeypatch):
    """Two indexes as a host's pip settings name them, the public one first; the public one serves 99.0 of every
    Neuron name, aws-neuronx-runtime-discovery (which torch-neuronx requires and only the Neuron repository serves)
    included. The install the docs used to show takes 99.0; install-neuron takes the Neuron repository's files, locks
    them by sha256, and a second host installs those very bytes from the lock with no index at all."""
    discovery = "aws-neuronx-runtime-discovery"
    index = neuron_index(tmp_path / "neuron", ["2.28.1"], {discovery: ["2.9"]}, {"torch-neuronx": [discovery]})
    public = simple_index(tmp_path / "public", {name: ["99.0"] for name in [*neuron_sdk.PACKAGES, discovery]})
    monkeypatch.setenv("PIP_INDEX_URL", public)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", index)
    wanted = {**row("2.28.1"), discovery: "2.9"}

    naive = empty_environment(tmp_path / "naive")  # pip install '.[neuron]' --extra-index-url NEURON, in effect
    subprocess.run([*upgrades.pip(naive), "install", "--quiet", f"torch-neuronx=={wanted['torch-neuronx']}"],
                   check=True, capture_output=True)
    assert upgrades.installed_versions(naive, [discovery]) == {discovery: "99.0"}

    locks = tmp_path / "locks"
    first = empty_environment(tmp_path / "first")
    done = install_neuron(first, locks, "--neuron-index", index)
    assert done.returncode == 0, done.stdout + done.stderr
    assert upgrades.installed_versions(first, list(wanted)) == wanted
    lock = locks / "neuron-2.28.1-torch2.8.0.txt"
    assert f"wrote {lock}" in done.stderr and "commit it" in done.stderr
    entries = neuron_lock.read(lock)
    assert {e.name: e.version for e in entries} == wanted
    for entry in entries:
        path = Path(url2pathname(urlparse(entry.url).path))
        assert path.parent == tmp_path / "neuron" / "wheels"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256

    shutil.rmtree(tmp_path / "neuron" / "simple")  # the Neuron repository's pages gone: the lock alone decides
    second = empty_environment(tmp_path / "second")
    again = install_neuron(second, locks, "--neuron-index", (tmp_path / "gone").as_uri())
    assert again.returncode == 0, again.stdout + again.stderr
    assert upgrades.installed_versions(second, list(wanted)) == wanted

    # Other bytes under a locked URL (a replaced file, a man in the middle): refused by their hash, nothing installed.
    locked_file = Path(url2pathname(urlparse(next(e.url for e in entries if e.name == discovery)).path))
    (tmp_path / "forged").mkdir()
    forged = wheel(tmp_path / "forged", discovery, "2.9", ["evil-extra"])
    shutil.copyfile(forged, locked_file)
    third = empty_environment(tmp_path / "third")
    refused = install_neuron(third, locks)
    assert refused.returncode == 1 and "checked against its sha256" in refused.stderr
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in refused.stderr
    assert set(upgrades.installed_versions(third, list(wanted)).values()) == {None}


def test_a_lock_of_another_release_or_a_malformed_line_is_refused(tmp_path, isolated_pip):
    locks = tmp_path / "locks"
    locks.mkdir()
    lock = locks / "neuron-2.28.1-torch2.8.0.txt"
    lock.write_text("torch-neuronx @ file:///x/torch_neuronx-2.8.0.2.10.16998-py3-none-any.whl --hash=sha256:"
                    + "0" * 64 + "\n")
    env = empty_environment(tmp_path / "env")
    wrong = install_neuron(env, locks)
    assert wrong.returncode == 1 and "does not lock release 2.28.1" in wrong.stderr, wrong.stderr
    lock.write_text("torch-neuronx==2.8.0.2.12.22436\n")  # a pin without a file and a hash
    malformed = install_neuron(env, locks)
    assert malformed.returncode == 1 and "is not 'name @ URL --hash=sha256:HEX'" in malformed.stderr


def install_script(venv: Path, public: str, index: str, base_lock: Path, lock_dir: Path) -> subprocess.CompletedProcess:
    """deploy/install-inf2.sh into a new environment at ``venv``. The pipeline's own dependencies (pip and setuptools
    among them) come from this test environment (no network here), standing for what the real base lock installs;
    the script installs the rest."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "test-environment.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    script = Path(__file__).resolve().parent.parent / "deploy" / "install-inf2.sh"
    return subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VENV": str(venv), "PUBLIC_INDEX": public, "NEURON_INDEX": index,
                               "BASE_LOCK": str(base_lock), "LOCK_DIR": str(lock_dir)})


def test_the_documented_install_script_installs_both_locks_and_the_public_index_cannot_win(tmp_path, isolated_pip,
                                                                                             monkeypatch):
    """deploy/install-inf2.sh, as docs/inf2-host.md and the workflow run it, against two local indexes: a base lock of
    one stand-in package from the public index, the pipeline itself, then release 2.28.1 made and installed from its
    lock. The public index also serves aws-neuronx-runtime-discovery 99.0, and the host's pip settings name the Neuron
    repository as an extra index (the set-up in which pip alone installs 99.0)."""
    discovery = "aws-neuronx-runtime-discovery"
    index = neuron_index(tmp_path / "neuron", ["2.28.1"], {discovery: ["2.9"]}, {"torch-neuronx": [discovery]})
    public = simple_index(tmp_path / "public", {"base-dep": ["1.0"], discovery: ["99.0"]})
    base_wheel = next((tmp_path / "public" / "wheels").glob("base_dep-*.whl"))
    base_lock = tmp_path / "inf2-base.txt"
    base_lock.write_text(f"base-dep==1.0 \\\n    --hash=sha256:{hashlib.sha256(base_wheel.read_bytes()).hexdigest()}\n")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", index)
    venv = tmp_path / "venv"
    done = install_script(venv, public, index, base_lock, tmp_path / "locks")
    assert done.returncode == 0, done.stdout + done.stderr
    python = str(venv / "bin" / "python")
    assert upgrades.installed_versions(python, [*neuron_sdk.PACKAGES, discovery, "base-dep"]) == {
        **row("2.28.1"), discovery: "2.9", "base-dep": "1.0"}
    assert (tmp_path / "locks" / "neuron-2.28.1-torch2.8.0.txt").is_file()
    assert "installed Neuron SDK release 2.28.1" in done.stdout


def test_the_install_script_refuses_a_release_the_base_lock_cannot_hold_before_installing_anything(
        tmp_path, isolated_pip, monkeypatch):
    """Neuron's compiler has pinned numpy below 2 in past releases (aws-neuron-sdk#762); the base lock pins
    numpy==2.2.6. deploy/install-inf2.sh resolves the release against the base lock first (install-neuron
    --lock-only, with pip's vendored packaging): refused with both requirements named and the fix, nothing installed,
    no lock written."""
    index = neuron_index(tmp_path / "neuron", ["2.28.1"], requires={"neuronx-cc": ["numpy<2"]})
    public = simple_index(tmp_path / "public", {"base-dep": ["1.0"], "numpy": ["1.26.4", "2.2.6"]})
    wheels = tmp_path / "public" / "wheels"
    base_lock = tmp_path / "inf2-base.txt"
    base_lock.write_text("".join(
        f"{name}=={version} \\\n    --hash=sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}\n"
        for name, version, path in (("base-dep", "1.0", next(wheels.glob("base_dep-*.whl"))),
                                    ("numpy", "2.2.6", next(wheels.glob("numpy-2.2.6-*.whl"))))))
    monkeypatch.setenv("PIP_INDEX_URL", public)
    venv = tmp_path / "venv"
    done = install_script(venv, public, index, base_lock, tmp_path / "locks")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "The user requested (constraint) numpy==2.2.6" in done.stderr, done.stderr
    assert re.search(r"neuronx-cc \S+ depends on numpy<2", done.stderr), done.stderr
    assert f"move numpy==2.2.6 in the base lock ({base_lock})" in done.stderr and "make lock" in done.stderr
    python = str(venv / "bin" / "python")
    # (numpy is this test environment's, seen through the .pth: the base lock's stand-in package is the witness)
    assert set(upgrades.installed_versions(python, ["base-dep", *neuron_sdk.PACKAGES]).values()) == {None}
    assert not (tmp_path / "locks").exists() or not any((tmp_path / "locks").iterdir())


def test_the_docs_and_the_workflow_install_with_the_script_and_the_base_lock_follows_pyproject():
    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parent.parent
    docs = (root / "docs" / "inf2-host.md").read_text()
    workflow = (root / ".github" / "workflows" / "rebuild.yml").read_text()
    assert "deploy/install-inf2.sh" in docs and "run: deploy/install-inf2.sh" in workflow
    assert "--extra-index-url" not in workflow
    assert all("Do not install" in para for para in docs.split("\n\n") if "--extra-index-url" in para)
    # The base lock: every file hash-pinned, every dependency of pyproject.toml's [project], [s3] and [serve]
    # satisfied, torch and transformers at the [neuron] extra's pins, the build backend present.
    from .helpers import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())
    lock = (root / "deploy" / "lock" / "inf2-base.txt").read_text()
    pins: dict[str, list[str]] = {}  # a universal lock may pin a name twice, under two markers
    for pin in neuron_lock.base_pins(root / "deploy" / "lock" / "inf2-base.txt"):
        pins.setdefault(canonicalize(pin.split("==")[0]), []).append(pin.split("==")[1].split(";")[0].strip())
    blocks = [b for b in lock.split("\n") if b[:1].isalnum()]
    assert len(blocks) == sum(map(len, pins.values())) > 100
    assert all(b.rstrip().endswith("\\") for b in blocks)  # each pin continues with its hashes
    extras = project["project"]["optional-dependencies"]
    wanted = [*project["project"]["dependencies"], *extras["s3"], *extras["serve"],
              *project["build-system"]["requires"],
              *[r for r in extras["neuron"] if r.startswith(("torch==", "transformers=="))]]
    for spec in map(Requirement, wanted):
        assert any(spec.specifier.contains(v, prereleases=True) for v in pins[canonicalize(spec.name)]), spec
    assert not set(map(canonicalize, neuron_sdk.PACKAGES)) & set(pins)  # the Neuron packages have their own locks


def canonicalize(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)
