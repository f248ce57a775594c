"""Adding a backend as docs/design.md's "How to add a backend" says: its module, its conf file and its table entry,
in a copy of the package, and nothing else; the pipeline then builds, validates and publishes with it."""

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .helpers import FAST_VALIDATE

REPO = Path(__file__).resolve().parent.parent

# A backend of its own that builds as the cpu backend does: what it computes is not the point here, how little a new
# backend has to touch is. (A real one would not import another backend's module: tests/test_layers.py holds that.)
MODULE = '''"""The echo backend: the cpu backend's ranks under another name (tests/test_backends.py)."""

from pipeline.backends.cpu import CpuBackend


class EchoBackend(CpuBackend):
    name = "echo"
'''
ENTRY = '''    BackendEntry("echo", "pipeline.backends.echo:EchoBackend", ("torch",),
                 (*COMMON_BUILD_CODE, "backends/torchscript.py", "backends/cpu.py", "backends/echo.py"), CPU_FACTORS),
'''


def added_backend(root: Path) -> Path:
    """A copy of the package and its configuration with the echo backend added in three files."""
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "pipeline", src / "pipeline", ignore=ignore)
    shutil.copytree(REPO / "conf", src / "conf", ignore=ignore)
    shutil.copytree(REPO / "hydra_plugins", src / "hydra_plugins", ignore=ignore)
    (src / "pipeline" / "backends" / "echo.py").write_text(MODULE)
    (src / "conf" / "backend" / "echo.yaml").write_text("# the cpu backend's ranks under another name\nname: echo\n"
                                                        "max_parallel: 0\n")
    registry = src / "pipeline" / "backends" / "registry.py"
    text = registry.read_text()
    end = text.index("\n)}\n", text.index("BACKENDS: dict[str, BackendEntry]"))
    registry.write_text(text[:end + 1] + ENTRY + text[end + 1:])
    return src


def changed_files(copy: Path, original: Path) -> list[str]:
    """Files that differ between two trees, or are in one only."""
    found = []

    def walk(cmp: filecmp.dircmp, at: str) -> None:
        found.extend(f"{at}{name}" for name in [*cmp.diff_files, *cmp.left_only, *cmp.right_only])
        for name, sub in cmp.subdirs.items():
            walk(sub, f"{at}{name}/")

    walk(filecmp.dircmp(copy, original, ignore=["__pycache__"]), "")
    return sorted(found)


def test_a_new_backend_is_its_module_its_conf_file_and_its_table_entry(tmp_path):
    src = added_backend(tmp_path)
    assert sorted(changed_files(src / "pipeline", REPO / "pipeline") + changed_files(src / "conf", REPO / "conf")) \
        == ["backend/echo.yaml", "backends/echo.py", "backends/registry.py"]
    env = {**os.environ, "PYTHONPATH": str(src)}
    artifacts = tmp_path / "artifacts"
    run = subprocess.run([sys.executable, "-m", "pipeline", "+variant=512_fp32", "backend=echo", "publish=local",
                          f"artifacts_dir={artifacts}", *FAST_VALIDATE], cwd=src, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    variant = artifacts / "gemma4_tiny" / "512_fp32"
    assert json.loads((variant / "build.json").read_text())["backend"] == "echo"
    assert json.loads((variant / "validation.json").read_text())["parity"]["passed"] is True
    published = json.loads((artifacts / "published" / "versions.json").read_text())
    assert [(row["backend"], row["metrics"]["parity"]["passed"]) for row in published["versions"]] == [("echo", True)]
    # a backend that names no conf file is no choice (the schema's Backend comes from conf/backend/)
    (src / "conf" / "backend" / "echo.yaml").unlink()
    gone = subprocess.run([sys.executable, "-m", "pipeline", "+variant=512_fp32", "backend=echo",
                           f"artifacts_dir={artifacts}", "stage=toolchain"], cwd=src, env=env, capture_output=True,
                          text=True, timeout=300)
    assert gone.returncode == 2 and "echo" in gone.stderr
