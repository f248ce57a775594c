"""A two-variant sweep through Slurm (``hydra/launcher=pipeline_slurm``, one job per variant) versus the same sweep
with Hydra's local launcher (``basic``: one variant after the other), from scratch into two fresh artifact
directories, side by side in one run on a one-node Slurm cluster started here (tests/slurm_cluster.py). Prints both
wall times, their ratio, and each Slurm job's overhead from submission to start (``sacct``'s Submit and Start).

    python bench/slurm_sweep.py [--variants 512_fp32,512_bf16] [--keep]

Needs root and the Slurm packages (``make slurm-packages``). Each job asks for what the preflight says its variant
needs and the node's two CPUs, so on this machine Slurm runs the jobs one after the other too: the ratio measures what
Slurm adds (submission, scheduling, the job's own Python start-up), not what a cluster of several nodes would gain.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FAST = ["validate.throughput.contexts=[short]", "validate.throughput.decode_tokens=4"]


def timed(argv: list[str], env: dict, log: Path) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode}); see {log}")
    return seconds, proc.stderr


def job_times(cluster, job_ids: list[str]) -> list[tuple[str, float, float]]:
    """Each job's name, seconds from submission to start, and from start to end (sacct: whole seconds)."""
    rows = []
    for job in cluster.jobs(job_ids):
        submit, start, end = (datetime.fromisoformat(job[key]) for key in ("submit", "start", "end"))
        rows.append((job["name"], (start - submit).total_seconds(), (end - start).total_seconds()))
    return rows


def main() -> None:
    import re

    from tests.slurm_cluster import PARTITION, Cluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="512_fp32,512_bf16")
    parser.add_argument("--keep", action="store_true", help="keep the artifact directories and the cluster's logs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slurm-sweep-"))
    cluster = Cluster(work / "cluster").start()
    try:
        env = {**os.environ, **cluster.env()}
        common = [sys.executable, "-m", "pipeline", "--multirun", f"+variant={args.variants}", "backend=cpu", *FAST]
        local_s, _ = timed([*common, "hydra/launcher=basic", f"artifacts_dir={work / 'local'}",
                            f"hydra.sweep.dir={work / 'sweep-local'}"], env, work / "local.log")
        slurm_s, said = timed([*common, "hydra/launcher=pipeline_slurm", f"hydra.launcher.partition={PARTITION}",
                               f"artifacts_dir={work / 'slurm'}", f"hydra.sweep.dir={work / 'sweep-slurm'}"], env,
                              work / "slurm.log")
        job_ids = re.findall(r"slurm: job (\d+) for", said)
        print(f"variants: {args.variants} (cpu backend, tiny model, from scratch)")
        print(f"local launcher (basic): {local_s:7.1f} s")
        print(f"Slurm (pipeline_slurm): {slurm_s:7.1f} s   ratio Slurm/local {slurm_s / local_s:.2f}")
        for name, waited, ran in job_times(cluster, job_ids):
            print(f"  {name}: submitted to started {waited:3.0f} s, ran {ran:3.0f} s (sacct, whole seconds)")
        print(f"Slurm's cost per job: {(slurm_s - local_s) / len(job_ids):.1f} s (the wall-time difference over "
              f"{len(job_ids)} jobs; a job that waits for the one before it to free the node's CPUs waits as long as "
              "that one runs)")
    finally:
        cluster.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    main()
