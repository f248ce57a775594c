"""``python -m pipeline schedule [OVERRIDE ...]``: build many variants at once on one host, as many as its memory
allows.

Each variant is three tasks in order (build: trace and package; validate; publish), each started when the host has
room for it: its preflight need within what running tasks leave of RAM + swap, ``--jobs`` at most, the NeuronCores
it holds free; publishes and host-prefill neuron builds (a fixed rendezvous port) one at a time, and with
``--quiet-validate`` (the neuron backend's default) a validation alone, so the figures the regression gate compares
are undisturbed. The shared stages run first, once; validate and publish go before new builds, so variants finish
early; a task too big even for an idle host runs alone (its own preflight says why it cannot), and a failed task
stops its variant only. Tasks are forked from this process and log to
``<artifacts_dir>/logs/schedule/``. docs/scale.md has the commands; ``--dry-run`` prints the needs and the budget.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

from pipeline.cli import plain
from pipeline.core.log import exit_on_error, log, setup
from pipeline.core.units import GIB
from pipeline.stages import phases

PRIORITY = {"publish": 0, "validate": 1, "build": 2}  # finish started variants before starting new ones


@dataclass(frozen=True)
class Task:
    variant: str
    name: str  # build | validate | publish
    stages: tuple[str, ...]
    memory: int = 0  # bytes it may use at its peak
    neuron_cores: int = 0
    exclusive: str | None = None
    """Runs with no other task of the same group: ``publish`` (one repository), ``trace-port`` (host-prefill
    neuron compiles: parallel_model_trace always rendezvous on port 2022, pipeline/backends/neuron_cores.py)."""
    alone: bool = False  # runs with nothing else at all (a throughput measurement on a quiet host)


@dataclass(frozen=True)
class Budget:
    memory: int
    slots: int  # tasks at once
    neuron_cores: int = 0

    def describe(self) -> str:
        return (f"{self.memory / GIB:.1f} GiB of RAM + swap, {self.slots} task(s) at once, "
                f"{self.neuron_cores} free NeuronCore(s)")


def variant_tasks(variant: str, backend: str, shape, resources, max_parallel: int,
                  quiet_validate: bool = False) -> list[Task]:
    """The three tasks of one variant, with what each needs."""
    from pipeline.backends.registry import backend_entry
    from pipeline.host import preflight

    entry = backend_entry(backend)
    build = preflight.trace_need(resources, entry, shape, max_parallel, [])
    check = preflight.validate_need(resources, entry, shape)
    stages = phases()  # build: trace, package; validate; publish (pipeline.stages.STAGES)
    # A neuron compile holds its NeuronCores too (its ranks initialise the runtime; ModelBuilder loads the weights
    # onto the cores at the end of its trace), so a compile and a validate share the cores as two validates do.
    return [Task(variant, "build", stages["build"], build.memory, build.neuron_cores,
                 exclusive=entry.build_group(shape)),
            Task(variant, "validate", stages["validate"], check.memory, check.neuron_cores, alone=quiet_validate),
            Task(variant, "publish", stages["publish"], 0, 0, exclusive="publish")]


def checkpoint_spec(cfg):
    """The spec of the checkpoint ``cfg`` builds, which the needs are derived from: the model stage's copy when it has
    run, else ``model.path``'s or the tiny model's config, else the pinned Hub revision's config.json alone."""
    from pipeline.core.errors import PipelineError
    from pipeline.paths import Paths
    from pipeline.recipe.spec import load_spec, spec_from_config

    m = cfg.model
    weights = Paths.of(cfg).weights
    if (weights / "config.json").is_file():
        return load_spec(weights)
    if m.path is not None:
        return load_spec(Path(m.path))
    if m.source == "tiny":
        from pipeline.models.tiny_model import hf_text_config

        return spec_from_config(hf_text_config(m.tiny))
    from huggingface_hub import hf_hub_download

    try:
        return load_spec(Path(hf_hub_download(m.hub_id, "config.json", revision=m.revision)).parent)
    except OSError as exc:  # offline, or the Hub refused: every huggingface_hub error is an OSError
        raise PipelineError(f"schedule: the needs are derived from {m.hub_id}'s config.json, which could not be "
                            f"fetched ({exc}): run stage=model first, or give model.path=DIR") from exc


def fits(task: Task, running: list[Task], budget: Budget) -> bool:
    if running and (task.alone or any(t.alone for t in running)):
        return False
    return (len(running) < budget.slots
            and sum(t.memory for t in running) + task.memory <= budget.memory
            and sum(t.neuron_cores for t in running) + task.neuron_cores <= budget.neuron_cores
            and not (task.exclusive and any(t.exclusive == task.exclusive for t in running)))


def choose(ready: list[Task], running: list[Task], budget: Budget) -> list[Task]:
    """The ready tasks to start now: first fit, validate and publish before builds. On an idle host the first ready
    task starts even if it does not fit (its preflight then says why it cannot run)."""
    chosen: list[Task] = []
    for task in sorted(ready, key=lambda t: PRIORITY[t.name]):
        if fits(task, running + chosen, budget):
            chosen.append(task)
    if not chosen and not running and ready:
        chosen.append(min(ready, key=lambda t: PRIORITY[t.name]))
    return chosen


@dataclass
class Outcome:
    task: Task
    ok: bool
    started: float
    seconds: float


@dataclass
class Scheduler:
    """Runs every variant's tasks in order through ``runner`` (``start(task)``; ``wait() -> (task, ok)``)."""

    budget: Budget
    runner: object
    outcomes: list[Outcome] = field(default_factory=list)
    peak_memory: int = 0
    peak_tasks: int = 0

    def run(self, plans: list[list[Task]], clock=time.monotonic) -> list[Outcome]:
        queues = {plan[0].variant: deque(plan) for plan in plans if plan}  # one variant's tasks, in order
        running: dict[Task, float] = {}
        while any(queues.values()) or running:
            busy = {t.variant for t in running}
            ready = [q[0] for variant, q in queues.items() if q and variant not in busy]
            for task in choose(ready, list(running), self.budget):
                queues[task.variant].popleft()
                log.info("schedule: start %s %s (needs %.1f GiB)", task.variant, task.name, task.memory / GIB)
                self.runner.start(task)
                running[task] = clock()
            self.peak_memory = max(self.peak_memory, sum(t.memory for t in running))
            self.peak_tasks = max(self.peak_tasks, len(running))
            task, ok = self.runner.wait()
            started = running.pop(task)
            self.outcomes.append(Outcome(task, ok, started, clock() - started))
            log.info("schedule: %s %s %s in %.1f s", task.variant, task.name, "done" if ok else "FAILED",
                     clock() - started)
            if not ok:
                queues[task.variant].clear()  # the rest of this variant depends on what failed
        return self.outcomes


# -- running tasks in forked processes -------------------------------------------------------------------------------

def _task_main(cfg, stages: tuple[str, ...], log_path: str) -> None:
    from pipeline.run import run_pipeline

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    setup()  # again: the handler the scheduler set writes to its stream, not to this task's file
    with exit_on_error():
        for stage in stages:
            cfg.stage = stage
            run_pipeline(cfg)


class ForkRunner:
    """Each task in a process forked from the scheduler (which has imported everything once already)."""

    def __init__(self, configs: dict, log_dir: Path):
        self.configs, self.log_dir = configs, log_dir
        self.ctx = mp.get_context("fork")
        self.procs: dict = {}

    def start(self, task: Task) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{task.variant}.{task.name}.log"
        proc = self.ctx.Process(target=_task_main, args=(self.configs[task.variant], task.stages, str(log_path)),
                                name=f"{task.variant}.{task.name}")
        proc.start()
        self.procs[proc.sentinel] = (task, proc)

    def wait(self) -> tuple[Task, bool]:
        sentinel = wait(list(self.procs))[0]
        task, proc = self.procs.pop(sentinel)
        proc.join()
        if proc.exitcode != 0:
            log.error("schedule: %s %s failed (exit %s); its log: %s", task.variant, task.name, proc.exitcode,
                      self.log_dir / f"{task.variant}.{task.name}.log")
        return task, proc.exitcode == 0

    def stop(self) -> None:
        for _, proc in self.procs.values():
            proc.kill()
            proc.join()


# -- the command ----------------------------------------------------------------------------------------------------

def compose(variant: str | None, overrides: list[str]):
    from pipeline.run import compose as compose_config

    return compose_config(([f"+variant={variant}"] if variant else []) + overrides, variant)


def measure_budget(backend: str, jobs: int | None, memory_gib: float | None) -> Budget:
    from pipeline.backends.registry import backend_entry
    from pipeline.host import preflight

    res = preflight.measure([], with_neuron=backend_entry(backend).on_neuron_cores)
    memory = int(memory_gib * GIB) if memory_gib is not None else res.usable_memory
    free_cores = max(0, (res.neuron_cores or 0) - res.neuron_cores_busy)
    return Budget(memory, jobs or os.cpu_count() or 1, free_cores)


def summary_table(outcomes: list[Outcome], variants: list[str]) -> str:
    lines = [f"  {'variant':<16} {'task':<9} {'result':<7} {'seconds':>8}"]
    for o in sorted(outcomes, key=lambda o: (variants.index(o.task.variant), o.started)):
        lines.append(f"  {o.task.variant:<16} {o.task.name:<9} {'ok' if o.ok else 'FAILED':<7} {o.seconds:>8.1f}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pipeline schedule", description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every variant (backend=cpu model=...)")
    parser.add_argument("--variants", help="comma-separated variant names (default: every file in conf/variant/)")
    parser.add_argument("--jobs", type=int, help="tasks at once (default: one per CPU core)")
    parser.add_argument("--memory-gib", type=float, help="memory budget (default: this host's RAM + swap)")
    parser.add_argument("--quiet-validate", action=argparse.BooleanOptionalAction, default=None,
                        help="validate with nothing else running, so throughput figures compare across builds "
                             "(default: on for the neuron backend, off for cpu)")
    parser.add_argument("--dry-run", action="store_true", help="print the tasks, their needs and the budget")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace, variants: list[str], known: list[str]) -> None:
    """Refuse what the scheduler decides itself, or cannot do, before any config is composed."""
    from pipeline.core.errors import ConfigError

    unknown = [v for v in variants if v not in known]
    if unknown:
        raise ConfigError(f"--variants {unknown} are not in conf/variant/ ({', '.join(known)})")
    if any(o.startswith(("+variant", "variant=", "stage=")) for o in args.overrides):
        raise ConfigError("the scheduler picks variants and stages itself: use --variants, not +variant/stage=")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs={args.jobs} must be at least 1")


def main(argv: list[str]) -> int:
    from pipeline.backends import resolve
    from pipeline.backends.registry import backend_entry
    from pipeline.config import available_variants
    from pipeline.host import preflight
    from pipeline.run import CONF_DIR, run_pipeline
    from pipeline.stages import SHARED

    args = parse_args(argv)
    setup()
    known = available_variants(CONF_DIR)
    variants = args.variants.split(",") if args.variants else known
    with exit_on_error():
        check_args(args, variants, known)
        configs = {v: compose(v, list(args.overrides)) for v in variants}  # every config checked before any work
        first = configs[variants[0]]
        backend = resolve(first.backend.name)
        quiet = backend_entry(backend).quiet_validate() if args.quiet_validate is None else args.quiet_validate
        budget = measure_budget(backend, args.jobs, args.memory_gib)
        log.info("schedule: %d variants on %s; budget %s", len(variants), backend, budget.describe())
        if not args.dry_run:
            shared = compose(None, list(args.overrides))
            for stage in SHARED:
                shared.stage = stage
                run_pipeline(shared)
        spec = checkpoint_spec(first)  # every variant builds the same checkpoint (the overrides are shared)
        entry = backend_entry(backend)
        plans = [variant_tasks(v, backend, c.variant.shape, preflight.estimate(
            spec, c.variant.shape, entry, c.model.resources.get(backend)).resources, c.backend.max_parallel, quiet)
                 for v, c in configs.items()]
        for plan in plans:
            log.info("schedule: %s needs %s", plan[0].variant,
                     ", ".join(f"{t.name} {t.memory / GIB:.1f} GiB" for t in plan))
        if args.dry_run:
            return 0
        runner = ForkRunner(configs, first.root / "logs" / "schedule")
        scheduler = Scheduler(budget, runner)
        try:
            outcomes = scheduler.run(plans)
        finally:
            runner.stop()
    failed = sorted({o.task.variant for o in outcomes if not o.ok})
    log.info("schedule: at most %d task(s) and %.1f GiB declared at once\n%s", scheduler.peak_tasks,
             scheduler.peak_memory / GIB, summary_table(outcomes, variants))
    if failed:
        log.error("schedule: %d variant(s) failed: %s", len(failed), ", ".join(failed))
        return 1
    return 0
