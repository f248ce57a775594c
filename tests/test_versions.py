"""The versions the pipeline supports, and that it reads Gemma-4 the same way under each of them.

These tests run in every environment: the default one (newest versions), ``make test-production`` (the ``[neuron]``
extra's torch 2.8.0 and transformers 5.13.0) and ``make test-lowest`` (every dependency at its lowest allowed
version). The spec of a checkpoint must be exactly what the installed transformers builds (its model is the float
reference), layer for layer; a config.json it would read otherwise is refused; and a torch or transformers outside
the declared range is refused before any work.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.core import versions
from pipeline.core.errors import CheckpointError, ConfigError, UnsupportedModelError
from pipeline.recipe.spec import PER_LAYER_CONFIG_SINCE, reads_per_layer_config, spec_from_config

from .helpers import config, run, tomllib

# Every version environment runs these (the mark names no distribution: they depend on many).
pytestmark = pytest.mark.across_versions

REPO = Path(__file__).resolve().parent.parent


def e4b_layout() -> dict:
    """E4B's text config (tests/test_spec_and_plan.py's, as the release spells it) at small widths: 42 layers, every
    sixth full attention, the last 18 reusing earlier caches."""
    from .test_spec_and_plan import E4B_CONFIG

    text = dict(E4B_CONFIG["text_config"])
    text.update(vocab_size=128, vocab_size_per_layer_input=128, hidden_size=32, intermediate_size=64,
                head_dim=8, global_head_dim=16, hidden_size_per_layer_input=4)
    return text


def tiny_config(**changes) -> dict:
    from pipeline.models.tiny_model import TinyModelConfig, hf_text_config

    return hf_text_config(replace(TinyModelConfig(), **changes))


def built_by_transformers(raw: dict):
    """transformers' own text model for ``raw`` (random weights: only its structure is read)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    cfg = Gemma4TextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    return Gemma4ForCausalLM(cfg).model


@pytest.mark.parametrize("changes", [{}, {"num_kv_shared_layers": 0}, {"num_kv_shared_layers": 4},
                                     {"use_double_wide_mlp": True}, {"global_head_dim": 32}, "e4b"],
                         ids=["tiny", "no-sharing", "four-shared", "double-wide-mlp", "one-head-size", "e4b-layout"])
def test_the_spec_is_what_the_installed_transformers_builds_layer_for_layer(changes):
    if changes == "e4b":
        raw = e4b_layout()
    else:
        raw = tiny_config(**{k: v for k, v in changes.items() if k != "use_double_wide_mlp"})
        raw.update({k: v for k, v in changes.items() if k == "use_double_wide_mlp"})
    spec = spec_from_config(raw)
    model = built_by_transformers(raw)
    for layer, theirs in zip(spec.layers, model.layers, strict=True):
        attn = theirs.self_attn
        assert layer.head_dim == attn.head_dim, layer.index
        assert (not layer.is_producer) == bool(attn.is_kv_shared_layer), layer.index
        assert layer.intermediate_size == theirs.mlp.gate_proj.out_features, layer.index
        if layer.is_producer:
            assert layer.num_kv_heads * layer.head_dim == attn.k_proj.out_features, layer.index


def test_kv_shared_layers_read_the_cache_transformers_stores_for_them():
    spec = spec_from_config(tiny_config())
    model = built_by_transformers(tiny_config())
    stored = {i for i, layer in enumerate(model.layers) if layer.self_attn.store_full_length_kv}
    assert {layer.kv_source for layer in spec.layers if not layer.is_producer} == stored == {3, 4}


def test_a_per_layer_config_the_installed_transformers_would_ignore_is_refused():
    raw = tiny_config()
    raw.pop("global_head_dim", None)
    raw["per_layer_config"] = {"3": {"head_dim": 64}, "7": {"head_dim": 64}}  # how 5.15+ write config.json
    if reads_per_layer_config():
        spec = spec_from_config(raw)
        assert [layer.head_dim for layer in spec.layers if layer.layer_type == "full_attention"] == [64, 64]
        assert spec_from_config(raw) == spec_from_config(tiny_config())  # the two spellings, one model
    else:
        with pytest.raises(CheckpointError, match=rf"transformers 5\.1[34]\.\d+ does not read .*Install a newer "
                                                  rf"transformers: pip install 'transformers>={PER_LAYER_CONFIG_SINCE}"
                                                  ):
            spec_from_config(raw)
        raw["per_layer_config"] = {"3": {"head_dim": 512}, "7": {"head_dim": 512}}  # what it would read anyway
        assert [lay.head_dim for lay in spec_from_config(raw).layers if lay.layer_type == "full_attention"] == [512] * 2


def test_a_checkpoint_without_a_layer_computing_its_own_cache_is_refused():
    with pytest.raises(UnsupportedModelError, match="num_kv_shared_layers=8 of 8 layers"):
        spec_from_config(tiny_config(num_kv_shared_layers=8))


def test_a_library_error_reading_the_config_is_a_message_not_a_traceback(monkeypatch):
    import transformers

    class Broken:
        def __init__(self, **kwargs):
            raise AttributeError("'Gemma4TextConfig' object has no attribute 'something_new'")

    monkeypatch.setattr(transformers, "Gemma4TextConfig", Broken)
    with pytest.raises(CheckpointError, match=r"transformers \S+ can read: 'Gemma4TextConfig' object has no attribute"):
        spec_from_config(tiny_config())


# -- the declared ranges ----------------------------------------------------------------------------------------

def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_installed_torch_and_transformers_are_in_the_declared_range():
    assert versions.problems() == []
    from packaging.specifiers import SpecifierSet

    assert versions.supported("transformers") == SpecifierSet(next(
        r.split("transformers", 1)[1] for r in pyproject()["dependencies"] if r.startswith("transformers")))


def test_a_version_outside_the_range_is_refused_before_the_toolchain_stage_writes_anything(monkeypatch, tmp_path):
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "5.12.0" if name == "transformers" else real(name))
    with pytest.raises(ConfigError, match=r"transformers 5\.12\.0 is installed, the pipeline supports "
                                          r"transformers(<6,>=5\.13|>=5\.13,<6): pip install"):
        run(config(tmp_path / "artifacts", variant=None), "toolchain")
    assert not (tmp_path / "artifacts" / "toolchain.json").exists()


def test_the_neuron_extra_pins_a_transformers_and_torch_inside_the_supported_range():
    extra = dict(r.split("==", 1) for r in pyproject()["optional-dependencies"]["neuron"])
    for name in versions.CHECKED:
        assert versions.supported(name).contains(extra[name]), name


def test_the_lowest_versions_environment_pins_every_lower_bound():
    """constraints-lowest.txt (make test-lowest) holds each direct dependency at the floor pyproject.toml declares,
    so no declared range is wider than what a test run saw."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = {}
    for line in (REPO / "constraints-lowest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    project = pyproject()
    extras = project["optional-dependencies"]
    for text in project["dependencies"] + extras["dev"] + extras["serve"]:
        req = Requirement(text)
        if req.name == project["name"]:
            continue  # dev's "gemma4-neuron-pipeline[serve]": the serve extra, checked here too
        floors = [s.version for s in req.specifier if s.operator == ">="]
        assert floors, f"{text} has no lower bound"
        pinned = pins.get(req.name.lower().replace("_", "-"))
        assert pinned and Version(pinned) == Version(floors[0]), f"{text}: constraints-lowest.txt pins {pinned}"


def test_the_production_environment_is_the_neuron_extras_torch_and_transformers():
    pins = dict(line.split("==") for line in (REPO / "constraints-production.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    extra = dict(r.split("==", 1) for r in pyproject()["optional-dependencies"]["neuron"])
    assert pins["torch"] == extra["torch"] and pins["transformers"] == extra["transformers"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", pins["transformers"])
    assert len(pins) > 20  # a resolved environment, every package pinned



def test_the_production_pins_the_base_lock_and_the_production_environment_are_the_inf2_hosts_python():
    """The inf2 DLAMI (Ubuntu 22.04) runs Python 3.10: the Makefile's INF2_PYTHON says so once; the production pins and
    the base lock are resolved for it, and make test-production runs in it (EXPECT_PYTHON, which only that target
    sets)."""
    makefile = (REPO / "Makefile").read_text()
    inf2 = re.search(r"^INF2_PYTHON := (\S+)$", makefile, re.M).group(1)
    assert makefile.count("--python-version $(INF2_PYTHON)") == 2  # make constraints (production) and make lock
    header = (REPO / "constraints-production.txt").read_text().splitlines()[1]
    assert f"--python-version {inf2} " in header, header
    expected = os.environ.get("EXPECT_PYTHON")
    if expected is not None:
        assert expected == inf2 and f"{sys.version_info.major}.{sys.version_info.minor}" == inf2, sys.version


class MarkedTest:
    """What tests/conftest.py's version filter reads of a collected test: its id and its across_versions mark."""

    def __init__(self, *distributions: str):
        self.nodeid = f"test_of[{','.join(distributions)}]"
        self.mark = pytest.mark.across_versions(*distributions).mark

    def get_closest_marker(self, name: str):
        return self.mark if name == "across_versions" else None


def test_make_test_lowest_reruns_a_test_only_where_a_distribution_it_names_differs(tmp_path):
    import importlib.metadata

    from .conftest import pinned_versions, tested_at_these_versions

    filelock = importlib.metadata.version("filelock")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"# via uv\nFileLock=={filelock}\n    # via gemma4\npyyaml==0.0.1 ; python_version < '4'\n"
                           "--index-url https://example.invalid\n")
    pins = pinned_versions(constraints)
    assert pins == {"filelock": filelock, "pyyaml": "0.0.1"}
    assert tested_at_these_versions(MarkedTest("FileLock"), pins)  # the same version: run by the other environment
    assert not tested_at_these_versions(MarkedTest("filelock", "PyYAML"), pins)  # one differs: run here too
    assert not tested_at_these_versions(MarkedTest("filelock", "torch"), pins)  # one not pinned there
    assert not tested_at_these_versions(MarkedTest(), pins)  # names none: depends on everything
    with pytest.raises(pytest.UsageError, match="'no-such-dist', which is not installed"):
        tested_at_these_versions(MarkedTest("no-such-dist"), {})


def test_every_across_versions_mark_names_installed_distributions():
    """A misspelt name would make make test-lowest refuse to start (or, spelt as another package, skip a test)."""
    import importlib.metadata

    marks = [m for f in sorted(REPO.glob("tests/test_*.py")) for m in re.findall(r"across_versions\(([^)]*)\)",
                                                                                   f.read_text())]
    named = {name for mark in marks for name in re.findall(r"\"([^\"]+)\"", mark)}
    assert {"torch", "transformers", "safetensors"} <= named
    for name in named:
        importlib.metadata.version(name)
