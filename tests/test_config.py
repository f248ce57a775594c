"""Every conf file composes and validates; schema errors name the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from pipeline.config import available_variants
from pipeline.core.errors import ConfigError
from pipeline.run import load_config

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def every_option():
    for group in GROUPS:
        for path in sorted((CONF / group).glob("*.yaml")):
            yield group, path.stem


@pytest.mark.parametrize(("group", "option"), list(every_option()))
def test_every_conf_file_composes_and_validates(group, option, tmp_path):
    overrides = [f"+variant={option}"] if group == "variant" else [f"{group}={option}", "+variant=512_bf16"]
    if group == "model" and option != "gemma4_tiny":
        overrides.append(f"model.path={tmp_path}")  # a local checkpoint instead of the Hub (validation only)
    if (group, option) == ("publish", "hub"):
        overrides.append("publish.repo_id=tester/builds")  # the file's placeholder is refused (test_hub.py)
    cfg = load_config(composed(overrides), option if group == "variant" else "512_bf16")
    if group == "variant":
        assert cfg.variant.name == option
        assert cfg.variant.kv_max % cfg.variant.bucket == 0


def test_the_default_config_has_no_variant():
    cfg = load_config(composed([]))
    assert cfg.variant is None and cfg.model.name == "gemma4_tiny" and cfg.stage == "all"


def test_params_yaml_lists_only_existing_variants():
    params = yaml.safe_load((CONF.parent / "params.yaml").read_text())
    assert set(params["variants"]) <= set(available_variants(CONF))
    assert {"256_bf16_host", "512_bf16_host", "2048_bf16_host", "512_bf16", "512_fp32", "2048_bf16",
            "2048_fp32"} <= set(params["variants"])
    assert set(params) == {"model", "backend", "publish", "hardware", "variants"}  # group choices dvc.yaml passes


@pytest.mark.parametrize(("override", "message"), [
    ("variant.kv_max=abc", "variant.kv_max: Value 'abc' of type 'str' could not be converted to Integer"),
    ("variant.kv_max=-512", "variant.kv_max=-512 and variant.bucket=128 must be positive"),
    ("variant.dtype=fp16", "variant.dtype='fp16' is not one of ['bf16', 'fp32']"),
    ("variant.prefill=gpu", "variant.prefill='gpu' is not one of ['device', 'host']"),
    ("variant.bucket=100", "variant.kv_max=512 is not a multiple of variant.bucket=100"),
    ("validate.parity.bf16=fuzzy", "validate.parity.bf16='fuzzy' is not one of ['exact', 'teacher_forced', 'logits']"),
    ("validate.parity.logits.divergence_tol=-1", "validate.parity.logits.divergence_tol=-1.0 must not be negative"),
    ("validate.parity.logits.tol_map.top5=[0.0,-0.1]", "tol_map.top5=[0.0, -0.1] must be [atol, rtol], both >= 0"),
    ("backend.name=tpu", "backend.name='tpu' is not one of ['auto', 'cpu', 'neuron']"),
    ("publish.repo_id='not a repo'", "publish.repo_id='not a repo' must look like"),
    ("stage=compile", "stage='compile' is not one of"),
    ("validate.max_new_tokens=0", "validate.max_new_tokens=0 must be at least 1"),
    ("model.revision=main", "model.revision='main' must pin a commit (40 hex digits)"),
])
def test_bad_values_are_named_with_their_allowed_values(override, message):
    overrides = ["+variant=512_bf16", override]
    if override.startswith("model.revision"):
        overrides.insert(0, "model=gemma4_e4b")
    with pytest.raises(ConfigError) as err:
        load_config(composed(overrides), "512_bf16")
    assert message in str(err.value)


def test_unknown_keys_are_named():
    """A misspelt key in a conf file (Hydra itself refuses a misspelt command-line override)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(composed(["+variant=512_bf16"]))
    data["validate"]["max_new_tokns"] = 3
    with pytest.raises(ConfigError, match=r"unknown key 'validate.max_new_tokns'"):
        load_config(data, "512_bf16")


def test_a_variant_whose_name_differs_from_its_file_is_refused():
    with pytest.raises(ConfigError, match=r"conf/variant/512_bf16.yaml sets name='other'"):
        load_config(composed(["+variant=512_bf16", "variant.name=other"]), "512_bf16")


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(composed(["+variant=512_bf16", "variant.dtype=fp16", "backend.name=tpu"]), "512_bf16")
    assert len(err.value.problems) == 2
