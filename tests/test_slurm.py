"""The cluster recipe (docs/scale.md, "Across hosts") on a real Slurm: a one-node cluster started on this machine.

Needs root and Debian's slurm-wlm, slurmdbd, munge and mariadb-server (``make test-cluster`` installs them): without
them these tests are skipped, unless ``REQUIRE_SLURM=1`` (CI) makes that a failure. The cluster (tests/slurm_cluster.py)
runs slurmctld, slurmd and slurmdbd with accounting, so ``sacct`` shows what each job asked for and where it ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from .slurm_cluster import ACCOUNT, PARTITION, Cluster, missing_programs
from .test_dvc import checkout_copy, dvc, quicker_validation, ran

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ["512_fp32", "512_bf16"]
FAST = ["validate.throughput.contexts=[short]", "validate.throughput.decode_tokens=4"]

pytestmark = pytest.mark.cluster
if missing_programs() or os.geteuid() != 0:
    if os.environ.get("REQUIRE_SLURM"):
        raise RuntimeError(f"REQUIRE_SLURM=1 but this host cannot start a Slurm cluster (missing: "
                           f"{missing_programs()}, root: {os.geteuid() == 0}): make test-cluster installs the packages")
    pytestmark = [pytest.mark.cluster,
                  pytest.mark.skip(reason="no Slurm here: make test-cluster installs it and runs these tests")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    started = Cluster(tmp_path_factory.mktemp("slurm")).start()
    yield started
    started.stop()


def slurm(cluster, *argv: str) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, env={**os.environ, **cluster.env()}, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


SWEEP = [sys.executable, "-m", "pipeline", "--multirun", "hydra/launcher=pipeline_slurm",
         f"hydra.launcher.partition={PARTITION}"]  # the recipe's command, overrides to follow


def sweep(cluster, cwd: Path, *overrides: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run([*SWEEP, *overrides], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **cluster.env()})


def test_the_cluster_recipe_runs_each_variant_as_a_slurm_job_sized_by_the_preflight(cluster, tmp_path):
    """docs/scale.md's recipe as written, in a checkout: the sweep through Slurm, then ``dvc commit --force``,
    after which ``dvc repro`` runs only the toolchain stage."""
    repo = checkout_copy(tmp_path / "repo", VARIANTS, quicker_validation)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    before = {job["id"] for job in cluster.jobs()}
    out = sweep(cluster, repo, f"+variant={','.join(VARIANTS)}", f"model={params['model']}",
                f"backend={params['backend']}", f"publish={params['publish']}", f"hardware={params['hardware']}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    asked = dict(re.findall(r"slurm: job (\d+) for \S+: (\d+) GiB of memory", out.stderr))
    ran_here = [job for job in cluster.jobs() if job["id"] not in before]
    assert sorted(job["id"] for job in ran_here) == sorted(asked)
    for job in ran_here:  # under Slurm, on its node, with what the preflight said
        assert job["state"] == "COMPLETED" and job["node"] == cluster.node_name, job
        assert job["mem_mb"] == int(asked[job["id"]]) * 1024 and job["cpus"] == 2, job
    for variant in VARIANTS:
        assert (repo / "artifacts" / "gemma4_tiny" / variant / "metrics.json").is_file()
    dvc(repo, "commit", "--force")
    assert ran(dvc(repo, "repro")) == ["toolchain"]


def test_a_variant_no_node_can_hold_is_refused_before_anything_is_submitted(cluster, tmp_path):
    before = cluster.jobs()
    out = sweep(cluster, REPO, "+variant=512_fp32", "backend=cpu", f"artifacts_dir={tmp_path / 'artifacts'}",
                "model.resources.cpu.validate_gb=4000")
    assert out.returncode == 1, out.stderr[-3000:]
    assert re.search(r"no node of partition 'inf2' can run 512_fp32: 400\d GiB of memory, 2 CPU\(s\) \(its largest "
                     r"node has [\d.]+ GiB and \d+ CPUs\)", out.stderr), out.stderr[-3000:]
    assert cluster.jobs() == before and not (tmp_path / "artifacts" / "gemma4_tiny").exists()  # (Hydra's log only)


def test_a_partition_that_does_not_exist_and_a_cluster_that_is_down_are_refused(cluster, tmp_path):
    before = cluster.jobs()
    missing = sweep(cluster, REPO, "+variant=512_fp32", "backend=cpu", f"artifacts_dir={tmp_path / 'a'}",
                    "hydra.launcher.partition=nope")
    assert missing.returncode == 1 and "hydra.launcher.partition='nope': the Slurm cluster has no such partition" \
        in missing.stderr and f"sinfo lists ['{PARTITION}']" in missing.stderr, missing.stderr[-3000:]
    down = tmp_path / "down.conf"
    down.write_text(re.sub(r"SlurmctldPort=\d+", "SlurmctldPort=9", (cluster.root / "slurm.conf").read_text()))
    refused = subprocess.run([*SWEEP, "+variant=512_fp32", "backend=cpu", f"artifacts_dir={tmp_path / 'a'}"], cwd=REPO,
                             capture_output=True, text=True, timeout=300, env={**os.environ, "SLURM_CONF": str(down)})
    assert refused.returncode == 1 and "the Slurm cluster does not answer" in refused.stderr, refused.stderr[-3000:]
    assert cluster.jobs() == before and not (tmp_path / "a" / "gemma4_tiny").exists()  # (Hydra's log only)


def test_an_account_that_does_not_exist_is_refused_before_anything_is_submitted(cluster, tmp_path):
    """Slurm itself judges the account (``sbatch --test-only``, for every job before the first is submitted); the
    cluster enforces associations, as a shared cluster's accounting does."""
    before = cluster.jobs()
    out = sweep(cluster, REPO, "+variant=512_fp32,512_bf16", "backend=cpu", f"artifacts_dir={tmp_path / 'a'}",
                "hydra.launcher.account=nope")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Slurm refuses the job for 512_fp32" in out.stderr and "hydra.launcher.account='nope'" in out.stderr \
        and "Invalid account" in out.stderr and "sacctmgr show associations" in out.stderr, out.stderr[-3000:]
    assert cluster.jobs() == before and not (tmp_path / "a" / "gemma4_tiny").exists()


def test_two_jobs_of_one_variant_build_it_once(cluster, tmp_path):
    """Two sweeps submit the same variant at once into one artifacts_dir, each job given one CPU so that Slurm runs
    both side by side on the node: the stage locks hold across the jobs, one traces and the other finds it built."""
    artifacts = tmp_path / "artifacts"
    before = {job["id"] for job in cluster.jobs()}
    env = {**os.environ, **cluster.env()}
    sweeps = []
    for name in ("a", "b"):
        argv = [*SWEEP, f"hydra.launcher.account={ACCOUNT}", "hydra.launcher.cpus_per_task=1",
                f"hydra.sweep.dir={tmp_path / name}", "+variant=512_fp32", "backend=cpu", f"artifacts_dir={artifacts}",
                *FAST]
        sweeps.append(subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=env))
    for proc in sweeps:
        _, err = proc.communicate(timeout=1200)
        assert proc.returncode == 0, err[-3000:]
    ran_here = [job for job in cluster.jobs() if job["id"] not in before]
    assert len(ran_here) == 2 and all(job["state"] == "COMPLETED" and job["cpus"] == 1 for job in ran_here)
    logs = "".join(p.read_text() for name in ("a", "b") for p in (tmp_path / name / ".submitit").rglob("*_log.err"))
    assert logs.count("trace: 512_fp32 built in") == 1, logs[-4000:]
    assert logs.count("trace: 512_fp32 is up to date") == 1, logs[-4000:]
    assert (artifacts / "gemma4_tiny" / "512_fp32" / "metrics.json").is_file()


def test_a_cancelled_job_leaves_no_partial_output_and_resubmitting_completes_it(cluster, tmp_path):
    artifacts = tmp_path / "artifacts"
    args = [*SWEEP, "+variant=512_fp32", "backend=cpu", f"artifacts_dir={artifacts}", *FAST]
    env = {**os.environ, **cluster.env()}
    first = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    variant_dir = artifacts / "gemma4_tiny" / "512_fp32"
    deadline = time.monotonic() + 600
    while not any(p.name.startswith(".") and "tmp" in p.name for p in variant_dir.glob(".*")) and \
            time.monotonic() < deadline:  # the trace's staging directory: the job is mid-build
        time.sleep(0.2)
    running = [job for job in cluster.jobs() if job["state"] == "RUNNING"]
    assert len(running) == 1, running
    slurm(cluster, "scancel", running[0]["id"])
    first.communicate(timeout=300)
    assert next(j for j in cluster.jobs() if j["id"] == running[0]["id"])["state"] == "CANCELLED"
    # Nothing half-written: no build, no record. (submitit lets Slurm's SIGTERM pass, so the job dies of the SIGKILL
    # that follows; its staging directory stays until the next trace removes it.)
    assert not (variant_dir / "build").exists() and not (variant_dir / "build.json").exists()
    again = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env, timeout=1200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (variant_dir / "metrics.json").is_file() and not list(variant_dir.glob(".*.tmp-*"))
