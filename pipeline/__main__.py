"""Command line: ``python -m pipeline +variant=NAME [stage=NAME] [overrides]`` (Hydra) builds; ``python -m pipeline
SUBCOMMAND`` runs one of ``SUBCOMMANDS`` (pull, serve, versions, ...), each ``pipeline/cli/<module>.py``.

A build runs the stages of docs/design.md in order, or the one ``stage=`` names, after validating the whole
configuration; a stage whose outputs match their inputs' fingerprint is skipped. A user's error exits 1 naming the
setting and the fix; a misspelt subcommand or key exits 2 before anything starts, naming the nearest real one.
"""

from __future__ import annotations

import sys

from pipeline.run import CONF_DIR, run_pipeline, unknown_override_keys


def _hydra_entry() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def task(raw: DictConfig) -> None:
        from hydra.types import RunMode

        from pipeline.core.errors import PipelineError
        from pipeline.core.log import exit_on_error, log, setup_under_hydra
        from pipeline.run import load_config

        setup_under_hydra()
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            with exit_on_error():
                run_pipeline(load_config(raw, hydra_cfg.runtime.choices.get("variant")))
            return
        # One job of a sweep: its failure is recorded, and the sweep goes on; pipeline/summary.py says what every
        # job did once all have ended, and exits 1 if any failed.
        from pipeline import summary

        cfg, error = None, None
        try:
            cfg = load_config(raw, hydra_cfg.runtime.choices.get("variant"))
            run_pipeline(cfg)
        except PipelineError as exc:
            log.error("%s", exc)
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if cfg is not None:
            summary.write(hydra_cfg.runtime.output_dir, summary.outcome(cfg, error))
        else:
            summary.write(hydra_cfg.runtime.output_dir,
                          summary.JobOutcome(hydra_cfg.runtime.choices.get("variant"), False, error))

    task()


SUBCOMMANDS = {  # name: (its module under pipeline/cli/, imported only when it runs; what it does)
    "versions": ("versions", "list what a repository publishes, and which versions fit this host (--json for scripts)"),
    "pull": ("pull", "fetch a published version (or a variant's newest that fits this host), verify it, unpack it"),
    "generate": ("generate", "run a pulled or built version on a prompt (greedy), with its timing"),
    "serve": ("serve", "serve a published version over HTTP (OpenAI-compatible routes, /generate, /health, /metrics)"),
    "eval": ("eval", "score a published version on lm-eval's tasks through serve, beside its checkpoint's fp32 "
                     "reference"),
    "schedule": ("schedule", "build many variants at once, as memory and NeuronCores allow"),
    "check-upgrades": ("upgrades", "is a newer Neuron SDK release on the Neuron repository? (--apply: install it, "
                                   "then rebuild)"),
    "install-neuron": ("install_neuron", "install a Neuron SDK release from its lock file, every file by sha256 (the "
                                         "first install on an inf2 host)"),
    "neuron-check": ("neuron_check", "the first run on an inf2 host: every layout, built and checked"),
    "check-remote": ("remote", "can this host read and write the DVC remote? (before a rebuild's build work)"),
    "refresh-index": ("refresh_index", "write the published signed index again before it expires (the scheduled "
                                       "rebuild runs it)"),
}


def run_subcommand(name: str, argv: list[str]) -> int:
    """Its module's ``main(argv)``: imported here, so a build pays for no subcommand's imports."""
    import importlib

    return importlib.import_module(f"pipeline.cli.{SUBCOMMANDS[name][0]}").main(argv)


def overview() -> str:
    """What ``--help`` prints before Hydra's own help (the configuration groups and their options)."""
    from pipeline.stages import ORDER

    lines = ["usage: python -m pipeline [+variant=NAME] [stage=NAME] [KEY=VALUE ...]    build (Hydra overrides)",
             "       python -m pipeline SUBCOMMAND [ARGS ...]                           (SUBCOMMAND --help for more)",
             "", "subcommands:"]
    lines += [f"  {name:<16}{what}" for name, (_, what) in SUBCOMMANDS.items()]
    lines += ["", "common overrides:",
              "  +variant=NAME              one variant (conf/variant/); --multirun '+variant=glob(*)' for all",
              f"  stage=NAME                 one stage: {', '.join(ORDER)} (default: all)",
              "  model=gemma4_e4b           the real model (default: the embedded tiny one); model.path=DIR for a copy",
              "  backend=cpu|neuron         (default: auto)      hardware=inf2_8xlarge|inf2_xlarge (default: auto)",
              "  publish=hub publish.repo_id=ORG/NAME            force=true: rebuild what is up to date", ""]
    return "\n".join(lines)


def not_a_subcommand(word: str) -> str | None:
    """Why ``word`` (the first argument) is neither a subcommand nor a Hydra override, or None."""
    if word in SUBCOMMANDS or word.startswith(("-", "+", "~")) or "=" in word:
        return None
    import difflib  # only for a mistyped subcommand: every build and every dvc.yaml stage starts here

    close = difflib.get_close_matches(word, list(SUBCOMMANDS), n=1)
    hint = f": did you mean {close[0]!r}?" if close else ""
    return (f"python -m pipeline: {word!r} is not a subcommand{hint} Subcommands: {', '.join(SUBCOMMANDS)}; a build "
            "takes overrides KEY=VALUE (python -m pipeline --help)")


def refused(problems: list[str]) -> None:
    """Exit 2 (a usage error, as for a misspelt subcommand) with one line per problem, if there are any."""
    if problems:
        print("\n".join(f"python -m pipeline: {p}" for p in problems), file=sys.stderr)
        sys.exit(2)


def expanded(args: list[str]) -> list[str]:
    """The arguments with a derived variant name (``+variant=512_fp32+kv1024``, as params.yaml may list one) spelled
    as the overrides that build it, and a field set to ``base`` left out; a derived name that is not the canonical
    one is a usage error (exit 2)."""
    from pipeline.core.errors import ConfigError
    from pipeline.run import expand_derived

    out = []
    for arg in args:
        if keeps_the_files_value(arg):
            continue
        if arg.startswith("variant="):  # Hydra: "Could not override 'variant'. No match in the defaults list"
            refused([f"{arg}: a variant is added to the configuration, not overridden: write +{arg}"])
        try:
            out += expand_derived(arg) or [arg]
        except ConfigError as exc:
            refused(exc.problems)
    return for_every_variant(out)


def keeps_the_files_value(arg: str) -> bool:
    """``variant.kv_max=base`` (a field of the build shape set to ``base``): the variant file's own value, as if not
    given. What dvc.yaml's sweep stages pass for a field the sweep leaves alone (params.yaml's ``sweep``)."""
    from pipeline.core.derived_names import FIELDS

    key, _, value = arg.partition("=")
    return value == "base" and key.removeprefix("variant.") in FIELDS and key.startswith("variant.")


def for_every_variant(args: list[str]) -> list[str]:
    """In a multirun over ``+variant=...``, a fixed ``variant.KEY=VALUE`` applies to every variant swept: Hydra first
    composes the config without the swept group (its sweeper's config), where ``variant.KEY`` has nowhere to go
    ("Could not override 'variant.kv_max'"), so it is passed as ``++variant.KEY=VALUE`` (add or override), which each
    job's config then applies over its variant's file."""
    multirun = any(a in ("-m", "--multirun") for a in args)
    sweeps_variant = any(a.startswith("+variant=") for a in args)
    if not (multirun and sweeps_variant):
        return args
    return ["+" + a if a.startswith("+variant.") else "++" + a if a.startswith("variant.") else a for a in args]


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped with Ctrl-C


# What every command exits with (README, "Exit codes"): the same for the build and for every subcommand.
EXIT_CODES = {0: "done", 1: "refused or failed: the message names the setting and the fix",
              2: "usage: a misspelt subcommand, key, group choice or argument, or a Python that is not the "
                 "pipeline's environment", 3: "check-upgrades: an upgrade is available",
              4: "check-upgrades: a Neuron release newer than the table", 130: "interrupted (Ctrl-C)"}
# What the build and every subcommand import before anything else: absent, this Python is not the pipeline's
# environment (a newcomer's system python3 after make demo made .venv), and even --help is refused, by name.
REQUIRED = ("hydra", "omegaconf", "torch", "transformers", "safetensors")
REQUIRED_BY = {"serve": ("fastapi", "uvicorn", "prometheus_client")}


def environment_problem(command: str) -> str | None:
    import importlib.util

    missing = [m for m in (*REQUIRED, *REQUIRED_BY.get(command, ())) if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    extra = " (the [serve] extra: pip install -e '.[serve]')" if set(missing) <= set(REQUIRED_BY.get(command, ())) \
        else ""
    return (f"python -m pipeline: {sys.executable} lacks {', '.join(missing)}{extra}: it is not the pipeline's "
            "environment. Run .venv/bin/python -m pipeline ..., or activate it first: . .venv/bin/activate "
            "(make demo and make test create .venv)")


def main() -> None:
    try:
        first = sys.argv[1] if len(sys.argv) > 1 else ""
        if first in ("--version", "-V"):
            from pipeline import __version__

            print(f"gemma4-neuron-pipeline {__version__}")
            sys.exit(0)
        problem = environment_problem(first)
        if problem:
            print(problem, file=sys.stderr)
            sys.exit(2)
        if first in SUBCOMMANDS:
            sys.argv.pop(1)
            sys.exit(run_subcommand(first, sys.argv[1:]))
        problem = not_a_subcommand(first) if first else None
        if problem:
            print(problem, file=sys.stderr)
            sys.exit(2)
        if first in ("-h", "--help"):
            print(overview())  # then Hydra's help: the configuration groups and every option
        else:
            sys.argv[1:] = expanded(sys.argv[1:])
            refused(unknown_override_keys(sys.argv[1:]))
        _hydra_entry()
    except KeyboardInterrupt:
        # One line, not the tracebacks of every frame the interruption passed through: every output is written
        # under a temporary name and renamed only when complete, so nothing half-written is left to warn about.
        print("interrupted: nothing half-written was kept; run the same command again to finish", file=sys.stderr)
        sys.exit(INTERRUPTED)


if __name__ == "__main__":
    main()
