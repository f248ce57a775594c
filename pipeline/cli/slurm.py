"""What a variant asks Slurm for, and whether the cluster has a node that can give it.

A Slurm job builds one variant, every stage in turn, so it asks for the larger of the variant's build and validate
needs: the preflight's own figures (``model.resources.<backend>`` overrides and all), the numbers the local scheduler
uses (cli/schedule.py). Slurm, not the project, then decides what runs together. Before anything is submitted the
partition is read with ``sinfo``: a partition that does not exist, a controller that does not answer, or a variant whose
need exceeds every node of the partition is refused, with the numbers, and nothing is submitted or built. Then each
job is put to Slurm with ``sbatch --test-only`` (Slurm validates it and schedules nothing): whatever else Slurm would
refuse at submission (an account that does not exist or that the user does not belong to, a QOS, a limit) is refused
for every variant before the first one is submitted.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import dataclass

from pipeline.core.errors import ConfigError, PipelineError

GIB = 1 << 30


@dataclass(frozen=True)
class Request:
    """What one variant's job asks Slurm for."""

    variant: str
    mem_gb: int
    cpus: int

    def describe(self) -> str:
        return f"{self.variant}: {self.mem_gb} GiB of memory, {self.cpus} CPU(s)"


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    mem_mb: int


def variant_request(cfg, cpus_per_task: int | None) -> Request:
    """The larger of the variant's build and validate needs (bytes, rounded up to whole GiB), and its CPUs: the
    launcher's ``cpus_per_task`` when set (an inf2 node's every vCPU), else one per rank."""
    from pipeline.backends import resolve
    from pipeline.backends.registry import backend_entry
    from pipeline.cli.schedule import checkpoint_spec, variant_tasks
    from pipeline.host import preflight

    backend = resolve(cfg.backend.name)
    shape = cfg.variant.shape
    estimate = preflight.estimate(checkpoint_spec(cfg), shape, backend_entry(backend), cfg.model.resources.get(backend))
    tasks = variant_tasks(cfg.variant.name, backend, shape, estimate.resources, cfg.backend.max_parallel)
    memory = max(task.memory for task in tasks)
    return Request(cfg.variant.name, max(1, math.ceil(memory / GIB)), cpus_per_task or shape.tp_degree)


def partition_nodes(partition: str | None) -> list[Node]:
    """The nodes of ``partition`` (the default partition when None), as ``sinfo`` reports them."""
    argv = ["sinfo", "-h", "-N", "-o", "%N %c %m"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise PipelineError("hydra/launcher=pipeline_slurm: sinfo is not installed here: submit from a host of the "
                            "Slurm cluster (one with the Slurm client commands)") from None
    except subprocess.TimeoutExpired:
        raise PipelineError("hydra/launcher=pipeline_slurm: sinfo did not answer within 60 s: is the Slurm "
                            "controller up? (scontrol ping)") from None
    if out.returncode != 0:
        said = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit code {out.returncode}"
        raise PipelineError(f"hydra/launcher=pipeline_slurm: the Slurm cluster does not answer ({said}): check that "
                            "slurmctld is up (scontrol ping) and SLURM_CONF points at its slurm.conf")
    nodes = []
    for line in out.stdout.splitlines():
        name, cpus, mem = line.split()
        nodes.append(Node(name, int(cpus), int(mem.rstrip("+"))))
    if not nodes:
        raise ConfigError(f"hydra.launcher.partition={partition!r}: the Slurm cluster has no such partition, or it "
                          f"has no nodes; sinfo lists {available_partitions()}")
    return nodes


def available_partitions() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=60)
    return sorted(set(out.stdout.split()))


def check_submittable(requests: list[Request], partition: str | None, account: str | None, qos: str | None) -> None:
    """Ask Slurm whether it would accept each job (``sbatch --test-only``: validated, never queued)."""
    given = {key: value for key, value in (("partition", partition), ("account", account), ("qos", qos)) if value}
    for request in requests:
        argv = ["sbatch", "--test-only", f"--mem={request.mem_gb}G", f"--cpus-per-task={request.cpus}",
                f"--job-name=pipeline-{request.variant}", "--wrap=true", *(f"--{k}={v}" for k, v in given.items())]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            said = " ".join(out.stderr.split()) or f"exit code {out.returncode}"
            settings = ", ".join(f"hydra.launcher.{key}={value!r}" for key, value in given.items())
            raise PipelineError(f"hydra/launcher=pipeline_slurm: Slurm refuses the job for {request.describe()} "
                                f"({settings or 'the defaults'}): {said}. Use an account and QOS you belong to "
                                "(sacctmgr show associations user=$USER format=cluster,account,partition,qos); "
                                "nothing was submitted")


def check_fits(requests: list[Request], nodes: list[Node], partition: str | None) -> None:
    """Refuse, before anything is submitted, every variant no node of the partition can hold."""
    largest_mem = max(n.mem_mb for n in nodes)
    largest_cpus = max(n.cpus for n in nodes)
    wrong = [r for r in requests if r.mem_gb * 1024 > largest_mem or r.cpus > largest_cpus]
    if wrong:
        raise PipelineError(
            "hydra/launcher=pipeline_slurm: no node of partition " + repr(partition or "(default)") + " can run "
            + "; ".join(r.describe() for r in wrong)
            + f" (its largest node has {largest_mem / 1024:.1f} GiB and {largest_cpus} CPUs): use a partition of "
            "larger nodes, or lower the variant's needs (model.resources.<backend>)")
