"""Packing a rank directory: this packer against ``tar czf`` (the seed's way), ``tar -I 'zstd -T0'`` and a plain copy.

Writes two bf16-like rank files (normally distributed weights rounded to bf16, ``--size-mib`` in total) and packs
them four ways in one run, each into a fresh file on the same file system and flushed to disk (``sync -f``; the
packer fsyncs itself). Prints time, speed and output size of each, and the ratios the packer is held to: at least
30x faster than ``tar czf`` with no larger output, and at least two thirds of plain-copy speed.

    python bench/pack_speed.py [--size-mib 1024] [--dir /tmp/pack-bench]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def write_ranks(src: Path, size_mib: int) -> list[str]:
    import torch

    src.mkdir(parents=True, exist_ok=True)
    names = ["tp_0.pt", "tp_1.pt"]
    per_rank = size_mib * 2**20 // 2 // 2  # bf16 values per rank file
    for rank, name in enumerate(names):
        path = src / name
        if path.exists() and path.stat().st_size == per_rank * 2:
            continue
        gen = torch.Generator().manual_seed(rank)
        with open(path, "wb") as f:
            for start in range(0, per_rank, 1 << 26):
                n = min(1 << 26, per_rank - start)
                f.write((0.02 * torch.randn(n, generator=gen)).to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    return names


def timed(fn) -> float:
    import os

    os.sync()  # no method pays for another's (or the inputs') pending writeback
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def shell(cmd: str, out: Path) -> None:
    subprocess.run(cmd, shell=True, check=True)
    subprocess.run(["sync", "-f", str(out)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pack-bench"))
    args = parser.parse_args()
    from pipeline.artifact.archive import pack

    src, out = args.dir / "ranks", args.dir / "out"
    names = write_ranks(src, args.size_mib)
    total = sum((src / n).stat().st_size for n in names)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for n in names:  # read every input once so that each method starts from the page cache alike
        (src / n).read_bytes()

    results = {}
    results["this packer (tar.zst)"] = (timed(lambda: pack(src, names, "ranks", out / "a.tar.zst", "tar.zst")),
                                       out / "a.tar.zst")
    results["tar -I 'zstd -T0'"] = (timed(lambda: shell(f"tar -I 'zstd -T0 -q' -cf {out}/b.tar.zst -C {src} .",
                                                        out / "b.tar.zst")), out / "b.tar.zst")
    results["cp (plain copy)"] = (timed(lambda: shell(f"cp -r {src} {out}/c", out / "c")), out / "c")
    results["tar czf (the seed's way)"] = (timed(lambda: shell(f"tar czf {out}/d.tar.gz -C {src} .",
                                                               out / "d.tar.gz")), out / "d.tar.gz")

    def size(path: Path) -> int:
        return sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size

    print(f"input: {len(names)} bf16-like rank files, {total / 2**20:.0f} MiB")
    print(f"{'method':<28}{'seconds':>9}{'MB/s':>9}{'size %':>9}")
    for name, (seconds, path) in results.items():
        print(f"{name:<28}{seconds:9.2f}{total / 1e6 / seconds:9.0f}{100 * size(path) / total:9.1f}")
    ours, gz, copy = (results[k][0] for k in ("this packer (tar.zst)", "tar czf (the seed's way)", "cp (plain copy)"))
    ours_size, gz_size = size(results["this packer (tar.zst)"][1]), size(results["tar czf (the seed's way)"][1])
    print(f"speed vs tar czf:   {gz / ours:6.1f}x   (goal >= 30x)")
    print(f"size vs tar czf:    {ours_size / gz_size:6.3f}    (goal <= 1.0)")
    print(f"speed vs plain copy: {copy / ours:5.2f}    (goal >= 0.67)")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
