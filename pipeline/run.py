"""Composing a configuration's stages and running them: what ``python -m pipeline`` (one variant, or each job of a
multirun), ``schedule`` and ``neuron-check`` call for one configuration.

Each stage runs under its lock (pipeline.stages.STAGES says which), so several runs may share ``artifacts_dir``: a
stage waits for another run of itself, then skips by fingerprint. Logs what ran and what was up to date.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run.py imports lazily: `python -m pipeline --help` must not pay for torch
    from pipeline.stages import StageResult

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
log = logging.getLogger("pipeline")


def load_config(raw, variant_choice: str | None = None):
    """Validate a composed config (``conf/`` plus overrides) into a ``PipelineConfig``; raises one ``ConfigError``
    listing every problem: the schema's, a variant file whose name disagrees, and a ``stage`` the registry lacks."""
    from pipeline.config import problems, structured
    from pipeline.core.errors import ConfigError
    from pipeline.stages import ORDER

    typed = structured(raw)
    found = problems(typed)
    if typed.stage not in ("all", *ORDER):
        found.append(f"stage={typed.stage!r} is not one of {['all', *ORDER]}")
    if typed.variant is not None and variant_choice and typed.variant.name != variant_choice:
        if file_variant_name(variant_choice) == variant_choice:  # the file is right: an override set it
            found.append(f"variant.name={typed.variant.name!r}: a variant's name is its file's ({variant_choice}); "
                         f"drop the override, or copy conf/variant/{variant_choice}.yaml to "
                         f"conf/variant/{typed.variant.name}.yaml and build +variant={typed.variant.name}")
        else:
            found.append(f"conf/variant/{variant_choice}.yaml sets name={typed.variant.name!r}: "
                         "a variant's name must equal its file name")
    if found:
        raise ConfigError(found)
    if typed.variant is not None:
        check_model_fit(typed)  # before the derived name is announced: a variant the model cannot hold is no build
    if typed.variant is not None and variant_choice:
        derived = derived_name(typed.variant, variant_choice)
        if derived != typed.variant.name:
            folder = f"variant_folder {typed.variant_folder}" if typed.variant_folder else "its own folder"
            log.warning("the overrides change variant %s (%s): built as %s, in %s, with its own version and card",
                        variant_choice, ", ".join(changed_fields(typed.variant, variant_choice)), derived, folder)
            typed.variant.name = derived
    return typed


def file_variant_name(choice: str) -> str | None:
    """The ``name`` conf/variant/<choice>.yaml itself sets (None when it cannot be read)."""
    import yaml

    try:
        return yaml.safe_load((CONF_DIR / "variant" / f"{choice}.yaml").read_text()).get("name")
    except (OSError, AttributeError, yaml.YAMLError):
        return None


def expand_derived(arg: str) -> list[str] | None:
    """``+variant=512_fp32+kv1024`` as the overrides that build it: ``+variant=512_fp32 variant.kv_max=1024``
    (params.yaml may list such a name: a DVC knob sweep). None for any other argument; a ``ConfigError`` for a
    derived name that is not the one those overrides make (a field at the file's own value, or out of order)."""
    import yaml

    from pipeline.core import derived_names
    from pipeline.core.errors import ConfigError
    from pipeline.core.shape import BuildShape

    if not arg.startswith("+variant=") or "+" not in arg[len("+variant="):]:
        return None
    name, *parts = arg[len("+variant="):].split("+")
    if not (CONF_DIR / "variant" / f"{name}.yaml").is_file():
        return None  # unknown_override_keys names it
    given = variant_file(name)
    fields = {}
    for part in parts:
        found = derived_names.read_part(part)
        if not found:
            raise ConfigError(f"+variant={arg[9:]}: {part!r} is not a field of a derived name "
                              f"({derived_names.spellings_help()})")
        fields[found[0]] = found[1]
    read = {key: yaml.safe_load(value) for key, value in fields.items()}  # "1024" -> 1024, "[16,64]" -> [16, 64]
    canonical = derived_names.derived_name(name, BuildShape(**{**given, **read}), given)
    if canonical != arg[len("+variant="):]:
        raise ConfigError(f"+variant={arg[9:]} is not how those fields are named: write +variant={canonical} (fields "
                          f"in the order {', '.join(derived_names.FIELDS)}, each one that differs from conf/variant/"
                          f"{name}.yaml)")
    return [f"+variant={name}", *[f"variant.{k}={v}" for k, v in fields.items()]]


def variant_file(name: str) -> dict:
    """The shape's fields as conf/variant/<name>.yaml sets them (tp_degree defaulting as the schema does)."""
    from omegaconf import OmegaConf

    from pipeline.config import VariantConfig
    from pipeline.core.derived_names import FIELDS

    data = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "variant" / f"{name}.yaml"))
    return {key: data.get(key, getattr(VariantConfig, key, None)) for key in FIELDS}


def changed_fields(variant, name: str) -> list[str]:
    """``key=value (file: value)`` for each field of ``variant`` that differs from conf/variant/<name>.yaml's."""
    from pipeline.core.derived_names import FIELDS, text

    given = variant_file(name)
    return [f"variant.{key}={getattr(variant, key)} (the file: {given[key]})" for key in FIELDS
            if text(key, getattr(variant, key)) != text(key, given[key])]


def derived_name(variant, name: str) -> str:
    """The name a build of ``name`` with other field values goes by: ``512_bf16+kv1024+fp32``. A build is named
    after what it is, so an override never writes under the named variant's folder, version or card; the same
    overrides give the same name (and so find the same build)."""
    from pipeline.core import derived_names

    return derived_names.derived_name(name, variant, variant_file(name))


def unknown_override_keys(overrides: list[str]) -> list[str]:
    """One line for each command-line override whose key the configuration does not have, naming the nearest real
    key. Asked before Hydra composes: Hydra would refuse a misspelt key with advice to add it with ``+``, and take a
    misspelt ``+key=`` as a new key (which ``structured`` then refuses)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from pipeline.config import unknown_key

    parser = OverridesParser.create()
    found = []
    # A search path of one's own (hydra.searchpath, --config-dir) may add group choices: Hydra names a missing one.
    own_choices = any(a.startswith(("hydra.searchpath", "--config-dir", "-cd")) for a in overrides)
    for arg in overrides:
        if arg.startswith("-") or not ("=" in arg or arg.startswith("~")):
            continue  # Hydra's own flags and their values (--multirun, --cfg job)
        try:
            override = parser.parse_override(arg)
        except HydraException:
            continue  # Hydra says what is wrong with it
        key = override.key_or_group
        if override.package is not None or key.split(".")[0] == "hydra" or "/" in key:
            continue  # Hydra's settings, and config groups under a path (hydra/launcher=...)
        if (CONF_DIR / key).is_dir():
            problem = None if own_choices else unknown_choice(key, override)
        else:
            problem = unknown_key(key)
        if problem:
            found.append(problem)
    return found


def unknown_choice(group: str, override) -> str | None:
    """Why ``group=VALUE`` names no file of conf/<group>/ (a sweep, ``glob(*)`` or ``a,b``, is Hydra's to expand)."""
    if override.is_sweep_override() or override.is_delete():
        return None
    value = override.value()
    choices = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    if not isinstance(value, str) or value in choices:
        return None
    import difflib

    close = difflib.get_close_matches(value, choices, n=1)
    return (f"{group}={value} is not one of {choices} (conf/{group}/)" + (f": did you mean {close[0]!r}?" if close
                                                                          else ""))


def compose(overrides: list[str], variant: str | None = None):
    """The validated config that ``python -m pipeline OVERRIDES`` would run, composed through Hydra's API: what the
    subcommands that run stages (``schedule``, ``neuron-check``) use. A misspelt key is named as on the command line."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from pipeline.core.errors import ConfigError

    misspelt = unknown_override_keys(overrides)
    if misspelt:
        raise ConfigError(misspelt)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return load_config(hydra_compose(config_name="config", overrides=overrides), variant)


def check_backend(cfg, validates: bool) -> None:
    """What the backend can tell before any stage runs: its packages, and whether it can run this variant's build
    (backend=xla runs tp_degree 1 only), so a run that would fail at validate does not trace and package first."""
    from pipeline.backends import get_backend, resolve
    from pipeline.stages import trace as trace_stage

    name = resolve(cfg.backend.name)
    backend = get_backend(name)
    backend.check_installed(trace_stage.request(cfg, name))
    if validates:
        backend.check_load(cfg.variant.shape)


def check_model_fit(cfg) -> None:
    """A variant the model cannot hold (a cache longer than its positions), refused as soon as the model's config is
    known: before any stage for the embedded tiny model (its config is made here) or a checkpoint already fetched,
    else right after the model stage fetched it, before the reference (the trace stage asks again)."""
    from pipeline.config import ModelSource
    from pipeline.core.errors import ConfigError
    from pipeline.models.tiny_model import hf_text_config
    from pipeline.paths import Paths
    from pipeline.recipe.spec import load_spec, spec_from_config

    weights = Paths.of(cfg).weights
    if (weights / "config.json").is_file():
        spec = load_spec(weights)
    elif cfg.model.source == ModelSource.tiny and cfg.model.path is None:
        spec = spec_from_config(hf_text_config(cfg.model.tiny))
    else:
        return
    problem = spec.positions_problem(cfg.variant.kv_max)
    if problem:
        raise ConfigError(problem)


def dvc_default_remote(root: str | None) -> str | None:
    """The DVC repository's default remote (``[core] remote`` in .dvc/config or .dvc/config.local), or None."""
    import configparser

    parser = configparser.ConfigParser()
    for name in ("config", "config.local"):
        path = Path(root or ".") / ".dvc" / name
        try:
            parser.read_string(path.read_text(), str(path))
        except (OSError, configparser.Error):
            continue
    return parser.get("core", "remote", fallback=None) or None


def check_publish_target(cfg) -> None:
    """A build headed for the Hub that the Hub would refuse (or for a local folder of another model's builds), refused
    before it is built (dvc.yaml's trace stage is given the publish target for this), naming every reason at once."""
    from pipeline.backends import resolve
    from pipeline.core.errors import PublishError
    from pipeline.stages.publish import target_problems

    found = target_problems(cfg, resolve(cfg.backend.name))
    if found:
        raise PublishError(f"publish={cfg.publish.target} would refuse this build, so nothing was built:\n" +
                           "\n".join(f"  - {p}" for p in found))


def check_prompts_cover(cfg) -> None:
    """Before a trace: the validation prompts the reference holds cover the variant's shape (one near a bucket, one
    spanning buckets: validate's own refusal, ``select_prompts``), so a derived kv_max or bucket they cannot validate
    (512_fp32+kv384) is refused before the hours of tracing, not after. Nothing to ask without a reference yet, or one
    made for other prompts (the reference stage makes it again, and validate asks then)."""
    from pipeline.paths import Paths
    from pipeline.validation.reference_records import ReferenceRecord
    from pipeline.validation.worker import select_prompts

    record = ReferenceRecord.read_if_valid(Paths.of(cfg).reference)
    if record is None:  # none, or one this release cannot read: the reference stage makes it again
        return
    names = [p.name for p in record.prompts]
    if names == [p.name for p in cfg.validate.prompts] and record.max_new_tokens == cfg.validate.max_new_tokens:
        select_prompts(record.prompts, cfg.variant.shape, record.max_new_tokens, cfg.validate.prompt_names)


def run_pipeline(cfg) -> list[StageResult]:
    from pipeline.config import available_variants
    from pipeline.core.errors import ConfigError
    from pipeline.host.locking import held
    from pipeline.paths import Paths
    from pipeline.stages import BY_NAME, ORDER, SHARED, StageStatus, module

    stages = list(ORDER) if cfg.stage == "all" else [cfg.stage]
    if cfg.variant is None and any(s not in SHARED for s in stages):
        names = ", ".join(available_variants(CONF_DIR))
        raise ConfigError(f"stage {cfg.stage!r} builds one variant: add +variant=NAME (one of {names}), or "
                          f"--multirun '+variant=glob(*)' for all of them")
    if cfg.variant is not None and {"trace", "validate"} & set(stages):
        check_backend(cfg, "validate" in stages)  # (the model's fit was checked by load_config)
    if cfg.variant is not None and {"trace", "publish"} & set(stages):
        check_publish_target(cfg)
    results = []
    started = time.monotonic()
    for name in stages:
        began = time.monotonic()
        # Several runs may share artifacts_dir (a multirun launcher, the scheduler, two shells): a stage waits for
        # another run of itself, then skips by fingerprint.
        if name == "trace":
            check_prompts_cover(cfg)
        with held(cfg.root, BY_NAME[name].lock_name(cfg.model.name, Paths.of(cfg).variant)):
            result = module(name).run(cfg)
        if name == "model" and cfg.variant is not None and {"trace", "validate"} & set(stages):
            check_model_fit(cfg)  # the checkpoint is here now: before the reference's minutes
        result.seconds = time.monotonic() - began
        log.info("stage %s: %s in %.1f s", name, result.status, result.seconds)
        results.append(result)
    if os.environ.get("DVC_STAGE", "").startswith("publish@") and not dvc_default_remote(os.environ.get("DVC_ROOT")):
        log.warning("no DVC remote is set: the `dvc push` dvc repro suggests has nowhere to send these builds. Add "
                    "one (dvc remote add -d storage s3://BUCKET/PATH; docs/rebuilds.md), or keep them in this "
                    "checkout's .dvc/cache")
    ran = [r.stage for r in results if r.status == StageStatus.ran]
    log.info("done in %.1f s%s: ran %s", time.monotonic() - started,
             f" ({cfg.variant.name})" if cfg.variant else "", ", ".join(ran) or "nothing (all up to date)")
    return results
