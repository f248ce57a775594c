"""Shared fixtures: the tiny model built once per session, prompts, and the transformers reference.

``make test`` runs on both cores (pytest-xdist): each worker is a session of its own, so what a session fixture builds
is built once per test run through ``built_once``, by the first worker to ask, and read by the others."""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

# Tests never reach the network: any accidental Hub call fails fast instead of hanging.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# This user's cache (pulled versions, the trusted state of each source: pipeline/core/cache.py) is the test run's own,
# shared by the processes the tests start, never the user's.
if "GEMMA4_PIPELINE_CACHE" not in os.environ:  # pytest-xdist's workers inherit the controller's, which removes it
    os.environ["GEMMA4_PIPELINE_CACHE"] = tempfile.mkdtemp(prefix="gemma4-test-cache-")
    atexit.register(shutil.rmtree, os.environ["GEMMA4_PIPELINE_CACHE"], ignore_errors=True)
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true",
                     help="run the tests in reverse order: a test that leans on an earlier test's side effects fails")
    parser.addoption("--already-tested-with", metavar="CONSTRAINTS",
                     help="deselect each across_versions test whose named distributions are all installed here at "
                          "the versions CONSTRAINTS pins: the environment built from CONSTRAINTS runs it already")


def pytest_collection_modifyitems(config, items):
    # Every test must pass alone and in any subset; reversing the order is the cheap audit of that (`make test
    # PYTEST_ARGS=--reverse`): module- and session-scoped fixtures are then built by what were the last tests.
    if config.getoption("--reverse"):
        items.reverse()
    constraints = config.getoption("--already-tested-with")
    if constraints:
        pins = pinned_versions(Path(constraints))
        same = [item for item in items if tested_at_these_versions(item, pins)]
        if same:
            config.hook.pytest_deselected(items=same)
            items[:] = [item for item in items if item not in same]


def canonical_name(distribution: str) -> str:
    """A distribution's name as pip compares it (PEP 503: case, ``-``, ``_`` and ``.`` do not matter)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def pinned_versions(constraints: Path) -> dict[str, str]:
    """``name==version`` lines of a pip constraints file (comments, options and markers dropped)."""
    pins = {}
    for line in constraints.read_text().splitlines():
        requirement = line.split("#", 1)[0].split(";", 1)[0].strip()
        if "==" in requirement and not requirement.startswith("-"):
            name, version = requirement.split("==", 1)
            pins[canonical_name(name.strip())] = version.strip()
    return pins


def tested_at_these_versions(item: pytest.Item, pins: dict[str, str]) -> bool:
    """Whether every distribution the test's ``across_versions`` mark names is installed at its pin. A mark that names
    none depends on every package (an end-to-end run, serve, the Hub): it is never deselected."""
    marker = item.get_closest_marker("across_versions")
    if marker is None or not marker.args:
        return False
    for distribution in marker.args:
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            raise pytest.UsageError(f"{item.nodeid}: its across_versions mark names {distribution!r}, which is not "
                                    "installed: name the distribution as pip does") from None
        if pins.get(canonical_name(distribution)) != installed:
            return False
    return True


NEW_TOKENS = 32


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> object:
    """``build(folder)``'s result, built once per test run: alone, into a new temporary folder; under pytest-xdist,
    by the first worker to ask, under the run's common temporary folder (the other workers wait on its lock, then read
    the result it left as JSON). What is built there is shared: a test that changes anything works on a copy."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / "built-once"
    shared.mkdir(exist_ok=True)
    folder, result = shared / name, shared / f"{name}.json"
    with FileLock(shared / f"{name}.lock"):
        if not result.exists():
            folder.mkdir()
            result.write_text(json.dumps(build(folder), default=_as_json))
    return _from_json(json.loads(result.read_text()))


def _as_json(value):
    if isinstance(value, Path):
        return {"path": str(value)}
    if isinstance(value, subprocess.CompletedProcess):
        return {"completed": [value.args, value.returncode, value.stdout, value.stderr]}
    raise TypeError(f"built_once cannot share a {type(value).__name__}")


def _from_json(value):
    if isinstance(value, dict) and value.keys() == {"path"}:
        return Path(value["path"])
    if isinstance(value, dict) and value.keys() == {"completed"}:
        return subprocess.CompletedProcess(*value["completed"])
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from pipeline.models.tiny_model import TinyModelConfig, generate

    return built_once(tmp_path_factory, "tiny", lambda folder: generate(TinyModelConfig(), folder / "weights"))


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


def chat_ids(tokenizer, text: str) -> list[int]:
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=False)
    return tokenizer(templated, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """Three chat prompts: shorter than one 32-token bucket, about three buckets, about five buckets.

    All are longer than the tiny model's 16-token sliding window, and with 32 new tokens the longest stays under a
    kv_max of 256.
    """
    from pipeline.models.texts import PASSAGES, QUESTIONS

    ids = [chat_ids(tokenizer, QUESTIONS[0]), chat_ids(tokenizer, PASSAGES[0]),
           chat_ids(tokenizer, " ".join(PASSAGES[:2]))]
    assert [len(i) for i in ids] == sorted(len(i) for i in ids)
    assert ids[0] and len(ids[0]) < 32 < len(ids[1]) and len(ids[2]) + NEW_TOKENS <= 256
    return ids


@pytest.fixture(scope="session")
def hf_model(tiny_dir):
    import torch
    from transformers import Gemma4ForCausalLM

    return Gemma4ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="session")
def hf_reference(hf_model, prompts):
    """transformers' own greedy generation: ``[(tokens, logits [steps, vocab])]`` per prompt."""
    import torch

    out = []
    for ids in prompts:
        gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
        out.append((gen.sequences[0, len(ids):].tolist(), torch.stack(gen.logits)[:, 0].float()))
    return out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m pipeline ARGS`` from the repository, which must succeed."""
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=Path(__file__).parent.parent,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="session")
def tiny_512_fp32(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The tiny model's 512_fp32 built, validated and published (``publish=local``, unsigned) by the command users
    run, with the default settings: its artifacts folder and the completed process. Tests only read it
    (tests/test_pipeline.py, tests/test_serve.py)."""
    def build(folder: Path):
        root = folder / "artifacts"
        return root, run_cli("+variant=512_fp32", "backend=cpu", f"artifacts_dir={root}")

    return built_once(tmp_path_factory, "e2e", build)


BATCHED = "512_fp32+bs4"  # 512_fp32 at batch 4: fp32, so every sequence is token for token the reference's


@pytest.fixture(scope="session")
def tiny_batched(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The tiny model's 512_fp32 at batch 4 built, validated (its prompts decoded alone and together, 1 to 4
    sequences in flight) and published (``publish=local``, unsigned) by the command users run, validation shortened
    (tests.helpers.FAST_VALIDATE): its artifacts folder and the completed process. Tests only read it."""
    from .helpers import FAST_VALIDATE

    def build(folder: Path):
        root = folder / "artifacts"
        return root, run_cli(f"+variant={BATCHED}", "backend=cpu", f"artifacts_dir={root}", *FAST_VALIDATE)

    return built_once(tmp_path_factory, "batched", build)


@pytest.fixture
def fake_neuron(monkeypatch, tmp_path_factory):
    """The stand-in Neuron SDK (tests/fake_neuron), installed as the pinned release: on sys.path, PYTHONPATH (for the
    compile and validation processes) and PATH, with its own NeuronCores (2) and lease directory."""
    from . import fake_sdk

    site = fake_sdk.install(tmp_path_factory.mktemp("neuron-sdk"))
    with fake_sdk.activated(site, monkeypatch):
        yield site


@pytest.fixture(scope="session")
def neuron_checked(tmp_path_factory):
    """``python -m pipeline neuron-check --keep DIR`` on the stand-in SDK (tp_degree 2): its completed process, and
    the artifacts folder it built (512_fp32 device prefill, 256_bf16_host host prefill; nothing published)."""
    import subprocess
    import sys

    from . import fake_sdk

    def build(folder: Path):
        site = fake_sdk.install(folder / "neuron-sdk")
        keep = folder / "neuron-check"
        # The stand-in decodes on this machine's CPU, so inf2's throughput floor (30 tok/s) measures the machine's
        # load, not the code: a busy 2-core host falls under it. The floor is lowered to the cpu backend's sanity
        # floor here; the gates themselves are tested in test_validation.py and test_rebuild.py.
        floor = "validate.throughput.floors.neuron.inf2_8xlarge.tokens_per_s=5"
        out = subprocess.run([sys.executable, "-m", "pipeline", "neuron-check", "--keep", str(keep), floor],
                             capture_output=True, text=True, env={**os.environ, **fake_sdk.env(site)},
                             cwd=Path(__file__).parent.parent, timeout=600)
        return out, keep / "artifacts"

    return built_once(tmp_path_factory, "neuron-checked", build)


@pytest.fixture(scope="session")
def validated_512_fp32(tmp_path_factory) -> Path:
    """A healthy 512_fp32 build of the tiny model, traced, packaged, validated (tests.helpers.FAST_VALIDATE) and
    published to the local target. Shared: a test that changes anything works on a copy."""
    from .helpers import FAST_VALIDATE, config, run

    def build(folder: Path) -> Path:
        run(config(folder / "artifacts", *FAST_VALIDATE))
        return folder / "artifacts"

    return built_once(tmp_path_factory, "validated", build)
