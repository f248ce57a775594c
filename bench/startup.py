"""What a no-op ``dvc repro`` of this pipeline costs against DVC itself on a trivial twin with the same stage graph,
side by side in one run. Prints both medians and their ratio (goal: at most 1.5).

    python bench/startup.py [--runs 7] [--variants a,b,...] [--keep | --reuse DIR]

Ours: a fresh checkout of this repository's pipeline (its conf/, pipeline/, dvc.yaml and params.yaml, committed to a
new git repository) building the tiny model on the cpu backend with reduced validation settings, built once by
``dvc repro``. A no-op ``dvc repro`` then runs only the always-changed toolchain stage, ``python -m pipeline
stage=toolchain``, which finds its record unchanged.

The twin: a DVC project with the same dvc.yaml (the same stage names, foreach items, deps and outs, and an
always-changed first stage) whose deps and outs mirror the built checkout's file names with a few bytes each. Its
always-changed stage runs ``python -c pass``, so the twin pays an interpreter start too: what the ratio measures is
our command's work beyond starting Python, on top of DVC's own. The other stages never run in a no-op repro; their
commands are ``true`` and their outputs are laid out before the twin's first repro.

The timed runs alternate, ours then the twin's, so load from other processes falls on both. Each run's CPU time
(user + system, the command and its children) is printed beside its wall time: on a shared machine it moves far less
with the load. A third pair of figures, the always-run command alone (``python -m pipeline stage=toolchain`` in the
checkout, ``python -c pass``), shows how much of the difference is that command.

Python writes its bytecode caches as on a user's machine: PYTHONDONTWRITEBYTECODE, if set here, is dropped, or every
run would compile pipeline/ afresh (the twin's ``pass`` compiles nothing).

    python bench/startup.py --reuse DIR    # time the two projects a run with --keep left in DIR again
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
COPY = ["conf", "pipeline", "dvc.yaml", "params.yaml", ".dvc/config", ".dvc/plots", ".dvcignore", ".gitignore"]
TWIN_COPY = [".dvc/config", ".dvc/plots", ".dvcignore", ".gitignore"]  # and the built checkout's params.yaml
ALWAYS_RUN = "python -c pass"
NEVER_RUN = "true"
REPRO = [sys.executable, "-m", "dvc", "repro"]


def env() -> dict:
    """The stages' ``python`` is this interpreter; bytecode caches are written (module docstring). No analytics: its
    daemon would compete for the cores it measures (and there is no network to send to)."""
    kept = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**kept, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float
    """User + system seconds of the command and every process it waited for."""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(cmd: list[str], cwd: Path) -> Timing:
    cpu, started = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env())
    timing = Timing(time.perf_counter() - started, children_cpu() - cpu)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} in {cwd} failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return timing


def commit(repo: Path) -> None:
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.name=bench", "-c", "user.email=bench@localhost",
                                                  "commit", "-q", "-m", "checkout"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def copy_paths(dst: Path, rels: list[str]) -> None:
    for rel in rels:
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, dst / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst / rel)


def edit_yaml(path: Path, edit) -> None:
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def quicker_validation(validate: dict) -> None:
    """Two prompts and one short timed run (tests/helpers.py FAST_VALIDATE): the build only has to exist."""
    validate.update(prompt_names=["capital", "spans_64"], warmup_prompts=0)
    validate["throughput"].update(contexts=["short"], runs=1, warmup_runs=0, decode_tokens=4)


def checkout(dst: Path, variants: list[str] | None) -> Path:
    """This repository's pipeline in a fresh git repository: tiny model, cpu backend, quick validation."""
    copy_paths(dst, COPY)
    edit_yaml(dst / "conf" / "validate" / "default.yaml", quicker_validation)
    edit_yaml(dst / "params.yaml", lambda p: p.update(model="gemma4_tiny", backend="cpu",
                                                      **({"variants": variants} if variants else {})))
    commit(dst)
    return dst


def lock_paths(repo: Path) -> list[str]:
    """Every dep and out dvc.lock records (metrics and plots are outs there too)."""
    stages = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return sorted({entry["path"] for stage in stages.values() for key in ("deps", "outs")
                   for entry in stage.get(key, [])})


def mirror(src: Path, dst: Path, rel: str) -> None:
    """``rel``'s file names under ``src`` (a file, or a folder's files), each holding a few bytes, under ``dst``."""
    files = [src / rel] if (src / rel).is_file() else sorted(p for p in (src / rel).rglob("*") if p.is_file())
    for path in files:
        if "__pycache__" in path.parts:
            continue
        out = dst / path.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"{path.relative_to(src)}\n")


def twin_stage(stage: dict) -> dict:
    body = stage.get("do", stage)
    body["cmd"] = ALWAYS_RUN if stage.get("always_changed") else NEVER_RUN
    return stage


def twin(built: Path, dst: Path) -> Path:
    """A trivial DVC project with ``built``'s stage graph and file layout (module docstring)."""
    dst.mkdir(parents=True)
    copy_paths(dst, TWIN_COPY)
    shutil.copy(built / "params.yaml", dst / "params.yaml")
    dvc_yaml = yaml.safe_load((built / "dvc.yaml").read_text())
    dvc_yaml["stages"] = {name: twin_stage(stage) for name, stage in dvc_yaml["stages"].items()}
    (dst / "dvc.yaml").write_text(yaml.safe_dump(dvc_yaml, sort_keys=False))
    for rel in lock_paths(built):
        mirror(built, dst, rel)
    commit(dst)
    return dst


def build(repo: Path) -> float:
    """The first ``dvc repro``, then one more so that the timed runs start from a settled state."""
    seconds = run(REPRO, repo).wall
    run(REPRO, repo)
    return seconds


def stage_count(repo: Path) -> int:
    return len(yaml.safe_load((repo / "dvc.lock").read_text())["stages"])


def prepare(work: Path, variants: list[str] | None) -> tuple[Path, Path]:
    ours = checkout(work / "ours", variants)
    print(f"ours: first dvc repro (tiny model, cpu backend) {build(ours):.0f} s")
    trivial = twin(ours, work / "twin")
    print(f"twin: first dvc repro {build(trivial):.1f} s")
    return ours, trivial


def summary(label: str, timings: list[Timing]) -> tuple[float, float]:
    wall, cpu = statistics.median(t.wall for t in timings), statistics.median(t.cpu for t in timings)
    runs = ", ".join(f"{t.wall:.2f}" for t in timings)
    print(f"{label:<44} median {wall:5.2f} s wall, {cpu:5.2f} s CPU  (wall per run: {runs})")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed no-op runs of each (default 7)")
    parser.add_argument("--variants", help="comma-separated (default: params.yaml's, 31 stages)")
    parser.add_argument("--keep", action="store_true", help="keep the two projects (for --reuse)")
    parser.add_argument("--reuse", type=Path, help="a folder a run with --keep left: time its projects again")
    args = parser.parse_args()
    if args.runs < 1:
        raise SystemExit(f"--runs={args.runs}: give at least 1")
    if args.reuse and not (args.reuse / "ours" / "dvc.lock").is_file():
        raise SystemExit(f"--reuse {args.reuse}: no built project in it (ours/dvc.lock); run with --keep first")
    work = args.reuse or Path(tempfile.mkdtemp(prefix="startup-bench-"))
    print(f"{os.cpu_count()} cores; projects in {work}")
    if args.reuse:  # as built then, with the pipeline code of that time
        ours, trivial = work / "ours", work / "twin"
    else:
        ours, trivial = prepare(work, args.variants.split(",") if args.variants else None)
    stages = stage_count(ours)
    if stage_count(trivial) != stages:
        raise SystemExit(f"the twin has {stage_count(trivial)} stages, ours {stages}")

    toolchain = [sys.executable, "-m", "pipeline", "stage=toolchain", "backend=cpu"]
    times: dict[str, list[Timing]] = {"ours": [], "twin": [], "toolchain": [], "pass": []}
    for _ in range(args.runs):  # interleaved: a load spike falls on both
        times["ours"].append(run(REPRO, ours))
        times["twin"].append(run(REPRO, trivial))
        times["toolchain"].append(run(toolchain, ours))
        times["pass"].append(run([sys.executable, "-c", "pass"], trivial))
    print(f"{stages} stages in each; {args.runs} no-op runs each, interleaved")
    ours_wall, ours_cpu = summary("no-op dvc repro, ours", times["ours"])
    twin_wall, twin_cpu = summary("no-op dvc repro, twin", times["twin"])
    summary("  its always-run command, ours (toolchain)", times["toolchain"])
    summary("  its always-run command, twin (pass)", times["pass"])
    print(f"ratio ours / twin: {ours_wall / twin_wall:.2f} wall, {ours_cpu / twin_cpu:.2f} CPU (goal <= 1.5)")
    if not (args.keep or args.reuse):
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
