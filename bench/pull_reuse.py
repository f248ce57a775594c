"""Using a pulled version again: the check by its ``Pulled`` record against hashing every rank file (the baseline,
what ``pull --verify-full`` and every pull did before the record).

Writes two rank files (random bytes, ``--size-mib`` in total) with a manifest and a record beside them, as ``pull``
leaves a version in its cache, then times both checks in the same run, each ``--repeat`` times: the full hash
(``pipeline.artifact.pulled.reverified(full=True)``) and the check by the record (``reverified``). The files are in the
page cache when hashed (they were just written), the full hash's best case: on a cold cache it reads them from disk.

    python bench/pull_reuse.py [--size-mib 2048] [--repeat 3] [--dir /tmp/pull-reuse-bench]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHUNK = 8 << 20


def write_rank(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for start in range(0, size, CHUNK):
            block = os.urandom(min(CHUNK, size - start))
            digest.update(block)
            f.write(block)
    return digest.hexdigest()


def pulled_version(root: Path, size_mib: int):
    """A rank directory with its manifest and ``Pulled`` record beside it, as pull leaves one: (directory, manifest)."""
    from pipeline.artifact.archive import verify_build
    from pipeline.artifact.manifest import SCHEMA_VERSION, Manifest, manifest_beside
    from pipeline.artifact.pulled import pulled_beside, record

    rank_dir = root / "gemma4_e4b-bench"
    rank_dir.mkdir(parents=True, exist_ok=True)
    per_rank = size_mib * 2**20 // 2
    members = [{"path": f"tp_{rank}.pt", "size": per_rank, "sha256": write_rank(rank_dir / f"tp_{rank}.pt", per_rank)}
               for rank in (0, 1)]
    manifest = Manifest.from_json({
        "schema_version": SCHEMA_VERSION, "version": "512_bf16-cpu-torch2.13.0-0123abcd", "fingerprint": "0" * 64,
        "model": {"name": "gemma4_e4b", "hub_id": None, "revision": None, "config_digest": "c" * 64,
                  "weights_digest": "d" * 64},
        "variant": {"name": "512_bf16", "kv_max": 512, "bucket": 128, "dtype": "bf16", "prefill": "device",
                    "tp_degree": 2},
        "backend": "cpu", "compiler": {"id": "cpu-torch2.13.0", "args": [], "versions": {"torch": "2.13.0"}},
        "toolchain": {"schema_version": 2, "backend": "cpu", "packages": {"torch": {"version": "2.13.0"}},
                      "neuronx_cc": {"version": None, "source": None}, "system_packages": {}},
        "layout": "per_rank", "members": members,
        "archive": {"name": "a.tar.zst", "format": "tar.zst", "size": 1, "sha256": "e" * 64, "root": rank_dir.name},
    }, "the bench's manifest")
    manifest.write(manifest_beside(rank_dir))
    build = verify_build(rank_dir, manifest.members)
    record(build, manifest, "f" * 40, "bench").write(pulled_beside(rank_dir))
    return rank_dir, manifest


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pull-reuse-bench"))
    args = parser.parse_args()
    from pipeline.artifact.pulled import reverified

    rank_dir, manifest = pulled_version(args.dir, args.size_mib)
    hows = set()

    def full() -> None:
        hows.add(reverified(rank_dir, manifest, full=True)[1])

    def by_record() -> None:
        hows.add(reverified(rank_dir, manifest)[1])

    full_s, record_s = timed(full, args.repeat), timed(by_record, args.repeat)
    assert hows == {"hashed", "by its record"}, hows
    print(f"rank files: {args.size_mib} MiB in 2 files; median of {args.repeat}")
    print(f"  hashed in full (baseline): {full_s * 1e3:10.1f} ms  ({args.size_mib / full_s:7.0f} MiB/s)")
    print(f"  by its Pulled record:      {record_s * 1e3:10.1f} ms")
    print(f"  ratio: the record's check takes 1/{full_s / record_s:.0f} of the full hash's time")


if __name__ == "__main__":
    main()
