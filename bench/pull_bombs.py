"""``pull`` of an archive header bomb: how long, and how much memory, before it is refused?

Builds, validates and publishes the tiny model's 512_fp32 to a local folder (the pipeline's own stages, the quick
validation settings of the tests), then pulls, side by side in one run, each in a fresh process that reports its own
wall time and peak resident memory (VmHWM):

  baseline  the published version, as published (it unpacks: the work of a normal pull).
  bomb      the same version with its archive replaced (the manifest edited to match, unsigned, the tag moved: what a
            writer of the repository can do) by ``--gib`` GiB of PAX extended header, zstd-compressed to a few KB,
            and its members declared 4.5 GiB each (what a full-size E4B build's allow in all).

Printed as ratios against the baseline. Goals: the bomb refused in about the baseline's time and memory.
``--repo`` pulls with another checkout's pipeline (an earlier commit, for a before/after).

    python bench/pull_bombs.py [--gib 2] [--repo /path/to/checkout]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAST_VALIDATE = ["validate.prompt_names=[capital]", "validate.throughput.contexts=[short]",
                 "validate.throughput.runs=1", "validate.throughput.warmup_runs=0",
                 "validate.throughput.decode_tokens=4", "validate.warmup_prompts=0"]
ONE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from pipeline.cli.pull import LocalSource, pull
started = time.perf_counter()
try:
    pull(LocalSource(Path(sys.argv[2])), sys.argv[3], Path(sys.argv[4]), None, True)
    outcome = "unpacked"
except Exception as exc:
    outcome = f"refused: {type(exc).__name__}: {str(exc)[:160]}"
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": time.perf_counter() - started, "peak_rss": peak, "outcome": outcome}))
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=b@example.com", *args], cwd=repo, check=True,
                   capture_output=True)


def publish(artifacts: Path) -> tuple[Path, str]:
    subprocess.run([sys.executable, "-m", "pipeline", "+variant=512_fp32", "backend=cpu", f"artifacts_dir={artifacts}",
                    *FAST_VALIDATE], cwd=REPO, check=True, capture_output=True)
    manifest = json.loads((artifacts / "gemma4_tiny" / "512_fp32" / "dist" / "manifest.json").read_text())
    return artifacts / "published", manifest["version"]


def write_bomb(path: Path, root: str, gib: float) -> None:
    """A tar.zst whose first header announces ``gib`` GiB of PAX records (zeros), streamed: never held in memory."""
    import zstandard

    header = tarfile.TarInfo(f"{root}/././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, int(gib * 2**30)
    chunk = b"\0" * (8 << 20)
    with open(path, "wb") as f, zstandard.ZstdCompressor(level=3).stream_writer(f) as out:
        out.write(header.tobuf(tarfile.GNU_FORMAT))
        left = header.size
        while left > 0:
            out.write(chunk[:min(len(chunk), left)])
            left -= len(chunk)
        out.write(b"\0" * 1024)


def plant_bomb(repo: Path, version: str, gib: float) -> int:
    """The version's archive replaced by the bomb, its manifest edited to match (unsigned), the tag moved."""
    git(repo, "checkout", "-q", "main")
    manifest_path = repo / "512_fp32" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    archive = repo / "512_fp32" / manifest["archive"]["name"]
    write_bomb(archive, manifest["archive"]["root"], gib)
    data = archive.read_bytes()
    manifest["archive"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    for member in manifest["members"]:
        member["size"] = int(4.5 * 2**30)
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (repo / "512_fp32" / "manifest.sig").unlink(missing_ok=True)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "bomb")
    git(repo, "tag", "-f", version, "HEAD")
    return len(data)


def pull_once(checkout: Path, repo: Path, version: str, dest: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", ONE, str(checkout), str(repo), version, str(dest)], cwd=checkout,
                         capture_output=True, text=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose pipeline pulls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pull-bombs-") as tmp:
        published, version = publish(Path(tmp) / "artifacts")
        baseline = pull_once(args.repo, published, version, Path(tmp) / "a")
        size = plant_bomb(published, version, args.gib)
        bomb = pull_once(args.repo, published, version, Path(tmp) / "b")
    mib = 2**20
    print(f"pull of {version} ({args.repo}), then of a {size / 1024:.0f} KB archive announcing {args.gib:g} GiB of "
          "PAX header")
    for name, run in (("baseline", baseline), ("bomb", bomb)):
        print(f"  {name:<8} {run['seconds']:6.1f} s  peak RSS {run['peak_rss'] / mib:7.0f} MiB  {run['outcome']}")
    print(f"  bomb / baseline: time {bomb['seconds'] / baseline['seconds']:.1f}x, peak RSS "
          f"{bomb['peak_rss'] / baseline['peak_rss']:.2f}x   (goal: about 1x each)")


if __name__ == "__main__":
    main()
