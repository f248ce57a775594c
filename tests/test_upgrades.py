"""check-upgrades against a file:// simple index (PEP 503) of stand-in wheels, in a throwaway environment."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline import upgrades

OLD = {"neuronx-cc": "2.23.6484.0", "torch-neuronx": "2.8.0.2.10.16998", "neuronx-distributed": "0.17.26333"}
NEW_NCC = "2.24.5133.0"


def wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of ``name`` ``version`` (metadata, one module, RECORD)."""
    dist = name.replace("-", "_")
    files = {
        f"{dist}_stand_in/__init__.py": f"__version__ = {version!r}\n",
        f"{dist}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
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


def simple_index(root: Path, releases: dict[str, list[str]]) -> str:
    """A PEP 503 simple index under ``root``; returns its file:// URL."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    names = []
    for name, versions in releases.items():
        project = root / "simple" / name
        project.mkdir(parents=True, exist_ok=True)
        links = [f'<a href="{wheel(wheels, name, v).as_uri()}">{name}-{v}</a>' for v in versions]
        (project / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
        names.append(f'<a href="{name}/">{name}</a>')
    (root / "simple" / "index.html").write_text("<html><body>" + "".join(names) + "</body></html>\n")
    return (root / "simple").as_uri()


@pytest.fixture
def isolated_pip(monkeypatch):
    """pip sees only the indexes a test names (no user/site pip.conf, no find-links from the environment)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def env(tmp_path, isolated_pip) -> tuple[Path, str]:
    """A new environment with the old Neuron stack installed from a local index; returns (python, index URL)."""
    index = simple_index(tmp_path / "index", {
        "neuronx-cc": [OLD["neuronx-cc"], NEW_NCC, "2.25.0.0rc1"],  # a pre-release is never chosen
        "torch-neuronx": [OLD["torch-neuronx"]],
        "neuronx-distributed": ["0.16.0", OLD["neuronx-distributed"]],
    })
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    python = str(tmp_path / "env" / "bin" / "python")
    subprocess.run([*upgrades.pip(python), "install", "--quiet", "--index-url", index,
                    *[f"{k}=={v}" for k, v in OLD.items()]], check=True, capture_output=True)
    return python, index


def check(python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "check-upgrades", "--python", python, *args],
                          capture_output=True, text=True)


def test_an_upgrade_is_found_then_applied_then_the_stack_is_current(env, tmp_path):
    python, index = env
    found = check(python, "--index-url", index, "--json")
    assert found.returncode == upgrades.UPGRADE_AVAILABLE, found.stderr
    report = json.loads(found.stdout)
    assert report["status"] == "upgrade"
    assert {p["name"]: (p["installed"], p["newest"], p["status"]) for p in report["packages"]} == {
        "neuronx-cc": (OLD["neuronx-cc"], NEW_NCC, "upgrade"),
        "torch-neuronx": (OLD["torch-neuronx"], OLD["torch-neuronx"], "current"),
        "neuronx-distributed": (OLD["neuronx-distributed"], OLD["neuronx-distributed"], "current"),
    }
    marker = tmp_path / "rebuilt"
    rebuild = f"{sys.executable} -c \"open('{marker}', 'w').write('yes')\""
    applied = check(python, "--index-url", index, "--apply", "--rebuild-command", rebuild)
    assert applied.returncode == upgrades.UP_TO_DATE, applied.stdout + applied.stderr
    assert f"installing neuronx-cc=={NEW_NCC}" in applied.stdout and marker.read_text() == "yes"
    assert upgrades.installed_versions(python, ["neuronx-cc"]) == {"neuronx-cc": NEW_NCC}
    assert upgrades.installed_versions(None, ["neuronx-cc"]) == {"neuronx-cc": None}  # this environment untouched
    again = check(python, "--index-url", index)
    assert again.returncode == upgrades.UP_TO_DATE, again.stderr
    assert "neuronx-cc" in again.stdout and "upgrade" not in again.stdout


def test_a_missing_package_counts_as_an_upgrade(env, tmp_path):
    python, index = env
    subprocess.run([*upgrades.pip(python), "uninstall", "--yes", "--quiet", "torch-neuronx"], check=True)
    result = check(python, "--index-url", index)
    assert result.returncode == upgrades.UPGRADE_AVAILABLE
    assert "(not installed)" in result.stdout and "missing" in result.stdout


def test_an_unreadable_index_or_unknown_package_is_an_error(env, tmp_path):
    python, index = env
    gone = check(python, "--index-url", (tmp_path / "nowhere").as_uri())
    assert gone.returncode == upgrades.ERROR and "asking the package index" in gone.stderr
    unknown = check(python, "--index-url", index, "--package", "neuronx-nothing")
    assert unknown.returncode == upgrades.ERROR and "neuronx-nothing" in unknown.stderr


def test_a_failed_rebuild_is_an_error(env):
    python, index = env
    result = check(python, "--index-url", index, "--apply", "--rebuild-command", f"{sys.executable} -c 'exit(4)'")
    assert result.returncode == upgrades.ERROR and "exited with 4" in result.stderr


def test_index_arguments_default_to_the_neuron_repository():
    args = type("Args", (), {"index_url": None, "extra_index_url": None, "find_links": None})
    assert upgrades.index_arguments(args) == ["--extra-index-url", "https://pip.repos.neuron.amazonaws.com"]
    args.index_url, args.find_links = "https://mirror/simple", ["/wheels"]
    assert upgrades.index_arguments(args) == ["--index-url", "https://mirror/simple", "--find-links", "/wheels"]
