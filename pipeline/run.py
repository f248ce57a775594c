"""Composing a configuration's stages and running them: what ``python -m pipeline`` (one variant, or each job of a
multirun), ``schedule`` and ``neuron-check`` call for one configuration.

Each stage runs under its lock (pipeline.stages.STAGES says which), so several runs may share ``artifacts_dir``: a
stage waits for another run of itself, then skips by fingerprint. Logs what ran and what was up to date.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

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
        found.append(f"conf/variant/{variant_choice}.yaml sets name={typed.variant.name!r}: "
                     "a variant's name must equal its file name")
    if found:
        raise ConfigError(found)
    return typed


def unknown_override_keys(overrides: list[str]) -> list[str]:
    """One line for each command-line override whose key the configuration does not have, naming the nearest real
    key. Asked before Hydra composes: Hydra would refuse a misspelt key with advice to add it with ``+``, and take a
    misspelt ``+key=`` as a new key (which ``structured`` then refuses)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from pipeline.config import unknown_key

    parser = OverridesParser.create()
    found = []
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
        problem = unknown_key(key)
        if problem:
            found.append(problem)
    return found


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

    backend = get_backend(resolve(cfg.backend.name))
    backend.check_installed()
    if validates:
        backend.check_load(cfg.variant.shape)


def run_pipeline(cfg) -> list:
    from pipeline.config import available_variants
    from pipeline.core.errors import ConfigError
    from pipeline.host.locking import held
    from pipeline.stages import BY_NAME, ORDER, SHARED, module

    stages = list(ORDER) if cfg.stage == "all" else [cfg.stage]
    if cfg.variant is None and any(s not in SHARED for s in stages):
        names = ", ".join(available_variants(CONF_DIR))
        raise ConfigError(f"stage {cfg.stage!r} builds one variant: add +variant=NAME (one of {names}), or "
                          f"--multirun '+variant=glob(*)' for all of them")
    if cfg.variant is not None and {"trace", "validate"} & set(stages):
        check_backend(cfg, "validate" in stages)
    results = []
    started = time.monotonic()
    for name in stages:
        began = time.monotonic()
        # Several runs may share artifacts_dir (a multirun launcher, the scheduler, two shells): a stage waits for
        # another run of itself, then skips by fingerprint.
        with held(cfg.root, BY_NAME[name].lock_name(cfg.model.name, cfg.variant.name if cfg.variant else None)):
            result = module(name).run(cfg)
        result.seconds = time.monotonic() - began
        log.info("stage %s: %s in %.1f s", name, result.status, result.seconds)
        results.append(result)
    ran = [r.stage for r in results if r.status == "ran"]
    log.info("done in %.1f s%s: ran %s", time.monotonic() - started,
             f" ({cfg.variant.name})" if cfg.variant else "", ", ".join(ran) or "nothing (all up to date)")
    return results
