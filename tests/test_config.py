"""Every conf file composes and validates; schema errors name the key and the fix (an unknown key: the nearest real
one); choices are enums that hash and write as the plain strings they stand for."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hydra import compose, initialize_config_dir

from pipeline.config import available_variants
from pipeline.core.errors import ConfigError
from pipeline.models.tiny_model import TinyModelConfig
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


def test_the_pipeline_builds_the_tiny_model_the_tests_build():
    # tests/conftest.py generates TinyModelConfig(); the model stage generates the composed model.tiny. One source:
    # conf/model/gemma4_tiny.yaml adds nothing to the dataclass's defaults, and an override reshapes the same model.
    assert load_config(composed([])).model.tiny == TinyModelConfig()
    assert load_config(composed(["+model.tiny.seed=7"])).model.tiny == TinyModelConfig(seed=7)


def committed_params() -> dict:
    """params.yaml as committed: a user's workspace run (``dvc exp run -S ...``, the README's own line) rewrites the
    workspace's copy with its values, which are their experiment, not the project's file (docs/scale.md)."""
    shown = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=CONF.parent, capture_output=True, text=True)
    return yaml.safe_load(shown.stdout if shown.returncode == 0 else (CONF.parent / "params.yaml").read_text())


def test_params_yaml_lists_only_existing_variants():
    params = committed_params()
    assert set(params["variants"]) <= set(available_variants(CONF))
    assert {"256_bf16_host", "512_bf16_host", "2048_bf16_host", "512_bf16", "512_fp32", "2048_bf16",
            "2048_fp32"} <= set(params["variants"])
    assert set(params) == {"model", "backend", "publish", "hardware", "variants", "sweep"}  # what dvc.yaml reads
    # a sweep is an experiment's (dvc exp run -S 'sweep.base=[512_fp32]' -S sweep.kv_max=1024): none by default, and
    # its fields are the ones a derived name spells (tp_degree aside: both NeuronCores of an inf2 device; and
    # smaller_buckets, a list, which DVC cannot put in a stage's command: "Cannot interpolate data of type 'list'")
    from pipeline.core.derived_names import FIELDS

    assert params["sweep"] == {"base": [], **{key: "base" for key in FIELDS
                                              if key not in ("tp_degree", "smaller_buckets")}}


@pytest.mark.parametrize(("override", "message"), [
    ("variant.kv_max=abc", "variant.kv_max: Value 'abc' of type 'str' could not be converted to Integer"),
    ("variant.kv_max=-512", "variant.kv_max=-512 and variant.bucket=128 must be positive"),
    ("variant.dtype=fp16", "variant.dtype='fp16' is not one of ['bf16', 'fp32']"),
    ("variant.prefill=gpu", "variant.prefill='gpu' is not one of ['device', 'host']"),
    ("variant.bucket=100", "variant.kv_max=512 is not a multiple of variant.bucket=100"),
    ("validate.parity.bf16=fuzzy", "validate.parity.bf16='fuzzy' is not one of ['exact', 'teacher_forced', 'logits']"),
    ("validate.parity.logits.divergence_tol=-1", "validate.parity.logits.divergence_tol=-1.0 must not be negative"),
    ("validate.parity.logits.tol_map.top5=[0.0,-0.1]", "tol_map.top5=[0.0, -0.1] must be [atol, rtol], both >= 0"),
    ("backend.name=tpu", "backend.name='tpu' is not one of ['auto', 'cpu', 'neuron', 'xla']"),
    ("publish.repo_id='not a repo'", "publish.repo_id='not a repo' must look like"),
    ("stage=compile", "stage='compile' is not one of"),
    ("validate.max_new_tokens=0", "validate.max_new_tokens=0 must be at least 1"),
    ("validate.throughput.decode_threads=0", "validate.throughput.decode_threads=0 must be at least 1"),
    ("model.revision=main", "model.revision='main' must pin a commit (40 hex digits)"),
    ("model.source=git", "model.source='git' is not one of ['tiny', 'hub']"),
    ("publish.target=s3", "publish.target='s3' is not one of ['local', 'hub']"),
    ("validate.parity.fp32=close", "validate.parity.fp32='close' is not one of ['exact', 'teacher_forced', 'logits']"),
    ("validate.throughput.contexts=[short,full]",
     "validate.throughput.contexts[1]='full' is not one of ['short', 'half', 'near_max']"),
    ("publish.regression.throughput_backends=[gpu]",
     "publish.regression.throughput_backends[0]='gpu' is not one of ['cpu', 'neuron', 'xla']"),
    ("validate.throughput.floors.neuron.inf2_xlarge.tokens_per_s=fast",  # two levels down: OmegaConf leaves it
     "validate.throughput.floors.neuron.inf2_xlarge.tokens_per_s: Value 'fast' of type 'str' could not be converted"),
    ("validate.throughput.floors.cpu.any.tokens_per_s=0", "validate.throughput.floors.cpu.any.tokens_per_s=0 must be "
                                                          "positive (or null)"),
    ("model.resources.cpu.disk_gb=-1", "model.resources.cpu.disk_gb=-1.0 must not be negative"),
])
def test_bad_values_are_named_with_their_allowed_values(override, message):
    overrides = ["+variant=512_bf16", override]
    if override.startswith("model.revision"):
        overrides.insert(0, "model=gemma4_e4b")
    with pytest.raises(ConfigError) as err:
        load_config(composed(overrides), "512_bf16")
    assert message in str(err.value)


def test_a_key_misspelt_in_a_conf_file_is_named_with_the_nearest_real_key():
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(composed(["+variant=512_bf16"]))
    data["validate"]["max_new_tokns"] = 3
    with pytest.raises(ConfigError) as err:
        load_config(data, "512_bf16")
    assert err.value.problems == ["unknown key 'validate.max_new_tokns': did you mean 'validate.max_new_tokens'?"]


@pytest.mark.parametrize(("override", "message"), [
    ("+validate.max_new_tokenz=3", "unknown key 'validate.max_new_tokenz': did you mean 'validate.max_new_tokens'?"),
    ("+variant.max_new_tokens=3", "unknown key 'variant.max_new_tokens': did you mean 'validate.max_new_tokens'?"),
    ("+model.resources.nuron.disk_gb=1", "unknown key 'model.resources.nuron': did you mean 'model.resources.neuron'?"),
    ("+validate.throughput.floors.cpu.any.tokens_per_sec=3",  # two levels down: OmegaConf leaves it unchecked
     "unknown key 'validate.throughput.floors.cpu.any.tokens_per_sec': did you mean "
     "'validate.throughput.floors.cpu.any.tokens_per_s'?"),
    ("+validate.foo=1", "unknown key 'validate.foo': validate has max_new_tokens, prompts, warmup_prompts, parity, "
                        "throughput, prompt_names"),
])
def test_an_added_unknown_key_is_named_with_the_nearest_real_key(override, message):
    """``+section.key=`` passes Hydra (it adds the key) and reaches the schema as an unknown key."""
    with pytest.raises(ConfigError) as err:
        load_config(composed(["+variant=512_bf16", override]), "512_bf16")
    assert err.value.problems == [message]


def test_a_variant_whose_name_differs_from_its_file_is_refused(monkeypatch):
    import pipeline.run

    # an override names itself, not the file (which does not set it)
    with pytest.raises(ConfigError, match=r"variant.name='other': a variant's name is its file's \(512_bf16\)"):
        load_config(composed(["+variant=512_bf16", "variant.name=other"]), "512_bf16")
    monkeypatch.setattr(pipeline.run, "file_variant_name", lambda choice: "other")  # a file that sets another name
    with pytest.raises(ConfigError, match=r"conf/variant/512_bf16.yaml sets name='other'"):
        load_config(composed(["+variant=512_bf16", "variant.name=other"]), "512_bf16")


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(composed(["+variant=512_bf16", "variant.dtype=fp16", "backend.name=tpu"]), "512_bf16")
    assert len(err.value.problems) == 2


def test_a_refused_value_hides_no_other_problem_and_invents_none():
    """A refused choice stands in as its enum's first member, so the rest of its section is still checked
    (variant.kv_max), and no rule fires for a value nobody chose (model.source=hub would ask for model.hub_id);
    a value of the wrong type is named once, not again as missing."""
    with pytest.raises(ConfigError) as err:
        load_config(composed(["+variant=512_bf16", "variant.dtype=fp16", "variant.kv_max=0", "model.source=git",
                              "publish.target=s3"]), "512_bf16")
    assert sorted(err.value.problems) == sorted([
        "variant.dtype='fp16' is not one of ['bf16', 'fp32']",
        "variant.kv_max=0 and variant.bucket=128 must be positive",
        "model.source='git' is not one of ['tiny', 'hub']",
        "publish.target='s3' is not one of ['local', 'hub']"])
    with pytest.raises(ConfigError) as err:
        load_config(composed(["+variant=512_bf16", "variant.kv_max=lots", "validate.max_new_tokens=0"]), "512_bf16")
    assert err.value.problems == ["variant.kv_max: Value 'lots' of type 'str' could not be converted to Integer",
                                  "validate.max_new_tokens=0 must be at least 1"]


def test_choices_hash_and_write_as_the_plain_strings_they_stand_for():
    """Typing a setting with an enum changes no fingerprint and no record: members format, print and serialise as
    their values, so a build's fingerprint and version are what they were when these settings were strings."""
    import json
    from dataclasses import asdict
    from enum import Enum

    from pipeline import config
    from pipeline.core import shape
    from pipeline.core.records import fingerprint
    from pipeline.stages import trace

    enums = [e for module in (config, shape) for e in vars(module).values()
             if isinstance(e, type) and issubclass(e, Enum) and e.__module__ == module.__name__]
    assert len(enums) >= 9
    for member in (m for e in enums for m in e):
        assert f"{member}" == str(member) == member.value and json.dumps(member) == json.dumps(member.value)

    def plain(value):
        if isinstance(value, dict):
            return {plain(k): plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value.value if isinstance(value, Enum) else value

    cfg = load_config(composed(["+variant=512_bf16_host", "backend=neuron"]), "512_bf16_host")
    written = yaml.safe_load((CONF / "variant" / "512_bf16_host.yaml").read_text())
    variant = json.loads(json.dumps(asdict(cfg.variant)))  # build.json's "variant", as the conf file says
    assert variant.pop("smaller_buckets") == [] and variant == written  # (a host-prefill file has no ladder)
    settings = trace.build_settings(cfg, SimpleNamespace(weights_digest="w" * 64), cfg.backend.name)
    validate = {"parity": asdict(cfg.validate.parity), "throughput": asdict(cfg.validate.throughput)}
    assert fingerprint(settings) == fingerprint(plain(settings))
    assert fingerprint(validate) == fingerprint(plain(validate))


@pytest.mark.parametrize(("key", "value"), [("kv_max", 1024), ("bucket", 64), ("dtype", "fp32"), ("prefill", "host"),
                                            ("tp_degree", 1)])
def test_every_field_of_the_build_shape_changes_the_derived_name(key, value):
    """A build with any one shape field changed is named for it, and the name stands for that override again."""
    from dataclasses import fields, replace

    from pipeline.core.shape import BuildShape
    from pipeline.run import derived_name, expand_derived, variant_file

    assert key in {f.name for f in fields(BuildShape)}
    base = BuildShape(**variant_file("512_bf16"))
    assert getattr(base, key) != value
    name = derived_name(replace(base, **{key: value}), "512_bf16")
    assert name != "512_bf16" and name.startswith("512_bf16+")
    assert expand_derived(f"+variant={name}") == ["+variant=512_bf16", f"variant.{key}={value}"]


@pytest.mark.parametrize(("ladder", "part", "override"), [([16, 64], "sb16-64", "[16,64]"), ([], "sbnone", "[]")])
def test_a_ladder_is_spelled_in_a_derived_name_and_read_back(ladder, part, override):
    """variant.smaller_buckets, a list: ``512_bf16+sb16-64`` (an empty ladder ``sbnone``), and the name stands for
    the override again (as Hydra reads a list)."""
    from dataclasses import replace

    from pipeline.core.shape import BuildShape
    from pipeline.run import derived_name, expand_derived, variant_file

    base = BuildShape(**variant_file("512_bf16"))
    assert base.smaller_buckets == (16, 32)
    name = derived_name(replace(base, smaller_buckets=tuple(ladder)), "512_bf16")
    assert name == f"512_bf16+{part}"
    assert expand_derived(f"+variant={name}") == ["+variant=512_bf16", f"variant.smaller_buckets={override}"]
    assert derived_name(replace(base, smaller_buckets=[16, 32]), "512_bf16") == "512_bf16"  # a list as the file's tuple


def test_the_derived_spelling_covers_every_shape_field_in_order():
    """A shape field without a spelling would build into the named variant's folder under its name: refused on
    import. A derived name out of the fields' order, or with a part no field spells, is refused naming the fix."""
    from dataclasses import dataclass, fields

    from pipeline.core.derived_names import FIELDS, spelled_fields
    from pipeline.core.errors import ConfigError
    from pipeline.core.shape import BuildShape
    from pipeline.run import expand_derived

    assert FIELDS == tuple(f.name for f in fields(BuildShape))

    @dataclass
    class Wider(BuildShape):
        batch: int = 1

    with pytest.raises(TypeError, match="must spell every field of Wider"):
        spelled_fields(Wider)
    with pytest.raises(ConfigError, match=r"write \+variant=512_bf16\+kv1024\+fp32"):
        expand_derived("+variant=512_bf16+fp32+kv1024")
    with pytest.raises(ConfigError,
                       match=r"'q8' is not a field .*kv<N>, b<N>, bf16 or fp32, device or host, tp<N>, bs<N>"):
        expand_derived("+variant=512_bf16+q8")
