"""The toolchain record: versions parsed from the real tools' output formats, absent ones recorded as absent, and the
file rewritten only when its content changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.backends.neuron_sdk import release_part
from pipeline.core.errors import PipelineError
from pipeline.stages import toolchain
from pipeline.stages.toolchain import (
    neuronx_cc_full_version,
    parse_dpkg_query,
    parse_neuronx_cc_version,
    parse_rpm_query,
)

from .helpers import config, run

REPO = Path(__file__).resolve().parent.parent

# `neuronx-cc --version` (Neuron SDK 2.27).
NCC_VERSION = """NeuronX Compiler version 2.27.5334.0+f702b353

Python version 3.13.7
HWM version 2.27.0.0-f702b353
NumPy version 1.26.4

Running on AMI ami-0a3c3a20c09d6f377
Running in region usw2-az4
"""

# dpkg-query -W -f='${db:Status-Abbrev}\t${Package}\t${Version}\n' 'aws-neuronx-*' on a Neuron DLAMI: a package
# that was removed ("rc") or is only known ("un") is not installed.
DPKG = """ii \taws-neuronx-collectives\t2.27.34.0-e2a6d4e1d
ii \taws-neuronx-dkms\t2.23.9.0
ii \taws-neuronx-runtime-lib\t2.27.23.0-8deec4dbf
ii \taws-neuronx-tools\t2.25.145.0
rc \taws-neuronx-oci-hook\t2.10.1.0
un \taws-neuronx-gpsimd-tools\t
"""

RPM = """aws-neuronx-dkms\t2.23.9.0-dkms
aws-neuronx-runtime-lib\t2.27.23.0_8deec4dbf-1
"""


def test_neuronx_cc_version_output_is_parsed_with_its_build_hash():
    assert parse_neuronx_cc_version(NCC_VERSION) == "2.27.5334.0+f702b353"
    assert parse_neuronx_cc_version("neuronx-cc: command not found") is None
    assert release_part("2.27.5334.0+f702b353") == "2.27.5334.0" and release_part(None) is None


def test_system_package_listings_are_parsed():
    assert parse_dpkg_query(DPKG) == {"aws-neuronx-collectives": "2.27.34.0-e2a6d4e1d",
                                      "aws-neuronx-dkms": "2.23.9.0",
                                      "aws-neuronx-runtime-lib": "2.27.23.0-8deec4dbf",
                                      "aws-neuronx-tools": "2.25.145.0"}
    assert parse_rpm_query(RPM) == {"aws-neuronx-dkms": "2.23.9.0-dkms",
                                    "aws-neuronx-runtime-lib": "2.27.23.0_8deec4dbf-1"}


def _tool(directory: Path, name: str, script: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text("#!/bin/sh\n" + script)
    (directory / name).chmod(0o755)


def test_neuronx_cc_is_read_from_the_module_first_then_the_command(tmp_path, monkeypatch):
    assert neuronx_cc_full_version() == (None, None)  # neither here
    bin_dir = tmp_path / "bin"
    _tool(bin_dir, "neuronx-cc", f"cat <<'EOF'\n{NCC_VERSION}EOF\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert neuronx_cc_full_version() == ("2.27.5334.0+f702b353", "neuronx-cc --version")
    (tmp_path / "lib" / "neuronxcc").mkdir(parents=True)
    (tmp_path / "lib" / "neuronxcc" / "__init__.py").write_text('__version__ = "2.23.6484.0+3b612583"\n')
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    try:
        assert neuronx_cc_full_version() == ("2.23.6484.0+3b612583", "neuronxcc.__version__")
    finally:
        sys.modules.pop("neuronxcc", None)


def test_the_record_is_rewritten_only_when_it_changes(tmp_path, monkeypatch):
    cfg = config(tmp_path, variant=None)
    path = tmp_path / "toolchain.json"
    first = run(cfg, "toolchain")[0]
    record = json.loads(path.read_text())
    assert first.details["changed"] and record["backend"] == "cpu"
    assert record["neuronx_cc"] == {"version": None, "source": None}  # absent, recorded as absent
    assert record["packages"]["torch-neuronx"]["version"] is None and record["packages"]["torch"]["version"]
    stamp = path.stat().st_mtime_ns
    assert not run(cfg, "toolchain")[0].details["changed"] and path.stat().st_mtime_ns == stamp
    monkeypatch.setattr(toolchain, "system_packages", lambda: {"aws-neuronx-runtime-lib": "2.28.0.0"})
    assert run(cfg, "toolchain")[0].details["changed"]
    assert json.loads(path.read_text())["system_packages"] == {"aws-neuronx-runtime-lib": "2.28.0.0"}


def test_a_broken_record_stops_the_trace_naming_the_file_the_key_and_the_fix(tmp_path):
    """toolchain.json is a ToolchainRecord (tests/test_records.py reads it back byte for byte): a record with a key
    this release does not know, or without one it needs, stops the trace before any work."""
    cfg = config(tmp_path)
    run(cfg, "toolchain")
    path = tmp_path / "toolchain.json"
    written = path.read_bytes()
    for key, broken in [("packages.torch.revision", lambda r: r["packages"]["torch"].update(revision="x")),
                        ("neuronx_cc.source", lambda r: r["neuronx_cc"].pop("source")),
                        ("system_packages.aws-neuronx-dkms", lambda r: r["system_packages"].update(
                            {"aws-neuronx-dkms": 2}))]:
        record = json.loads(written)
        broken(record)
        path.write_text(json.dumps(record))
        with pytest.raises(PipelineError) as refused:
            run(cfg, "trace")
        said = str(refused.value)
        assert str(path) in said and key in said and "run stage=toolchain" in said, said

# What the toolchain command has no use for: it reads versions from package metadata and detects the backend from
# /dev/neuron* and importlib.util.find_spec. Each of these costs a no-op `dvc repro` its import time (torch alone
# about a second).
NOT_IMPORTED = ("torch", "transformers", "safetensors", "tokenizers", "huggingface_hub", "numpy",
                "pipeline.backends.base", "pipeline.backends.cpu", "pipeline.backends.neuron")

# `python -m pipeline ARGS` (runpy, as -m does), then the modules it left loaded.
TOOLCHAIN_COMMAND = """
import json, runpy, sys
args, report = sys.argv[1:-1], sys.argv[-1]
sys.argv = ["pipeline", *args]
runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
with open(report, "w") as f:
    json.dump(sorted(sys.modules), f)
"""


def test_the_toolchain_command_imports_no_torch_and_no_backend(tmp_path):
    """dvc.yaml's always-run stage is ``python -m pipeline stage=toolchain``: every `dvc repro`, even one with nothing
    to do, pays its start-up, so it imports neither torch nor transformers nor a backend module."""
    report = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", TOOLCHAIN_COMMAND, "stage=toolchain", "backend=auto",
                           f"artifacts_dir={tmp_path}", str(report)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "toolchain.json").read_text())
    assert record["packages"]["torch"]["version"] and record["packages"]["transformers"]["version"]
    loaded = json.loads(report.read_text())
    assert "pipeline.stages.toolchain" in loaded and "pipeline.backends" in loaded  # it ran the stage
    heavy = [name for name in NOT_IMPORTED if any(m == name or m.startswith(f"{name}.") for m in loaded)]
    assert not heavy, f"python -m pipeline stage=toolchain imported {heavy}"
