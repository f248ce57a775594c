"""Command line: ``python -m pipeline +variant=NAME [stage=NAME] [overrides]`` (Hydra), and subcommands.

Subcommands: ``python -m pipeline pull SOURCE VERSION`` (pipeline/pull.py),
``python -m pipeline generate RANK_DIR --checkpoint DIR --prompt TEXT`` (pipeline/generate.py),
``python -m pipeline schedule [OVERRIDE ...]`` (pipeline/schedule.py: many variants at once, memory permitting) and
``python -m pipeline check-upgrades [--apply]`` (pipeline/upgrades.py: a newer Neuron SDK release on the Neuron
repository?) and
``python -m pipeline neuron-check`` (pipeline/neuron_check.py: the first run on an inf2 host, every layout).

Runs the stages of shared/DESIGN.md in order (toolchain, model, reference, trace, package, validate, publish), or
the one named by ``stage=``. The configuration is validated in full before any stage starts; a stage whose outputs
match their inputs' fingerprint is skipped (``force=true`` rebuilds). ``--multirun '+variant=glob(*)'`` builds every
variant. Errors a user can act on exit with code 1 and a message naming the setting and the fix.
"""

from __future__ import annotations

import logging
import sys

from pipeline.run import CONF_DIR, run_pipeline

log = logging.getLogger("pipeline")


def _hydra_entry() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def task(raw: DictConfig) -> None:
        from pipeline.config import load_config
        from pipeline.errors import PipelineError
        from pipeline.log import quiet_third_party

        quiet_third_party()
        try:
            cfg = load_config(raw, HydraConfig.get().runtime.choices.get("variant"))
            run_pipeline(cfg)
        except PipelineError as exc:
            log.error("%s", exc)
            sys.exit(1)

    task()


def _pull(argv: list[str]) -> int:
    from pipeline.pull import main as pull_main

    return pull_main(argv)


def _generate(argv: list[str]) -> int:
    from pipeline.generate import main as generate_main

    return generate_main(argv)


def _schedule(argv: list[str]) -> int:
    from pipeline.schedule import main as schedule_main

    return schedule_main(argv)


def _check_upgrades(argv: list[str]) -> int:
    from pipeline.upgrades import main as upgrades_main

    return upgrades_main(argv)


def _neuron_check(argv: list[str]) -> int:
    from pipeline.neuron_check import main as check_main

    return check_main(argv)


SUBCOMMANDS = {"pull": _pull, "generate": _generate, "schedule": _schedule, "check-upgrades": _check_upgrades,
               "neuron-check": _neuron_check}


INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped with Ctrl-C


def main() -> None:
    try:
        if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
            command = sys.argv.pop(1)
            sys.exit(SUBCOMMANDS[command](sys.argv[1:]))
        _hydra_entry()
    except KeyboardInterrupt:
        # One line, not the tracebacks of every frame the interruption passed through: every output is written
        # under a temporary name and renamed only when complete, so nothing half-written is left to warn about.
        print("interrupted: nothing half-written was kept; run the same command again to finish", file=sys.stderr)
        sys.exit(INTERRUPTED)


if __name__ == "__main__":
    main()
