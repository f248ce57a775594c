"""Every tiny variant built serially (Hydra's basic multirun, one variant after the other) versus with the
memory-aware scheduler (``python -m pipeline schedule``), from scratch into two fresh artifact directories, side by
side in one run. Prints both wall times and their ratio (goal: at most 0.7 on 2 cores).

    python bench/schedule_speed.py [--variants a,b,...] [--keep]

Both runs do the same work: the shared stages once, then trace, package, validate and publish for every variant
(cpu backend). Each checks at the end that every variant was published.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def timed(cmd: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}); see {log}")
    return seconds


def published(root: Path) -> list[str]:
    out = subprocess.run(["git", "tag"], cwd=root / "published", capture_output=True, text=True, check=True).stdout
    return sorted(out.split())


def main() -> None:
    from pipeline.config import available_variants

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", help="comma-separated (default: every variant in conf/variant/)")
    parser.add_argument("--keep", action="store_true", help="keep the two artifact directories")
    args = parser.parse_args()
    variants = args.variants.split(",") if args.variants else available_variants(REPO / "conf")
    work = Path(tempfile.mkdtemp(prefix="schedule-bench-"))
    serial_dir, scheduled_dir = work / "serial", work / "scheduled"
    py = sys.executable
    print(f"{len(variants)} variants, {os.cpu_count()} cores, cpu backend; logs in {work}")

    serial = timed([py, "-m", "pipeline", "--multirun", f"+variant={','.join(variants)}", "backend=cpu",
                    f"artifacts_dir={serial_dir}"], work / "serial.log")
    print(f"serial (multirun, one at a time): {serial:7.1f} s")
    scheduled = timed([py, "-m", "pipeline", "schedule", "--variants", ",".join(variants), "backend=cpu",
                       f"artifacts_dir={scheduled_dir}"], work / "scheduled.log")
    print(f"scheduler:                        {scheduled:7.1f} s")
    for root in (serial_dir, scheduled_dir):
        if len(published(root)) != len(variants):
            raise SystemExit(f"{root}: published {published(root)}, expected {len(variants)} versions")
    print(f"wall-time ratio scheduler / serial: {scheduled / serial:.2f} (goal <= 0.7)")
    peak = [line for line in (work / "scheduled.log").read_text().splitlines() if "at most" in line]
    if peak:
        print(peak[-1].split("schedule: ", 1)[-1])
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
