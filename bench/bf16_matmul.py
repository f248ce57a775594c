"""bf16 matmuls of many rows, by route: torch's bf16 kernels (``native``) against fp32 over the same bf16 values, the
weight's cast included (``fp32``, pipeline/host/bf16_matmul.py), side by side, on this CPU as it is and as an
AVX2-only CPU (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` in a child process: torch's and oneDNN's kernels
limited to AVX2, as on a CPU without bf16 instructions).

The shape is one of google/gemma-4-E4B-it's MLP projections on one of two ranks ([rows, 2560] x [2560, 10240] bf16);
rows are a decode step's (1, 4) and prefill buckets' (16 .. 512). Prints ms per matmul for each route, fp32 with its
weight already wide (the floor the route cannot beat: it casts the weight per call), and native / fp32: above 1 the
fp32 route is faster. ``MIN_ROWS`` (64) is where the route starts.

    python bench/bf16_matmul.py [--threads 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROWS = (1, 4, 16, 64, 128, 512)
HIDDEN, INTERMEDIATE = 2560, 10240


def measure(threads: int, repeat: int) -> dict:
    import torch

    from pipeline.host import bf16_matmul

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    weight = torch.randn(INTERMEDIATE, HIDDEN).bfloat16()
    wide_weight = weight.float()

    def ms(call) -> float:
        call()
        started = time.perf_counter()
        for _ in range(repeat):
            call()
        return round((time.perf_counter() - started) / repeat * 1000, 2)

    linear = torch.nn.functional.linear
    rows = {}
    for n in ROWS:
        x = torch.randn(n, HIDDEN).bfloat16()

        def routed(x=x):
            with bf16_matmul.Fp32Matmuls(min_rows=1):
                return linear(x, weight)

        rows[n] = {"native": ms(lambda x=x: linear(x, weight)), "fp32": ms(routed),
                   "fp32_weight_wide": ms(lambda x=x: linear(x.float(), wide_weight))}
    return {"bf16_flags": list(bf16_matmul.cpu_bf16_flags()), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads, args.repeat)))
        return
    machines = {"this CPU": {}, "as AVX2-only": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
    for name, extra in machines.items():
        out = subprocess.run([sys.executable, __file__, "--child", f"--threads={args.threads}",
                              f"--repeat={args.repeat}"], env={**os.environ, **extra}, cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
        found = json.loads(out)
        print(f"\n{name} (bf16 flags: {found['bf16_flags'] or 'none'}{', limited to AVX2' if extra else ''}), "
              f"{args.threads} threads, [rows, {HIDDEN}] x [{HIDDEN}, {INTERMEDIATE}] bf16, ms per matmul")
        print(f"  {'rows':>5} {'native':>9} {'fp32':>9} {'fp32 (weight wide)':>19} {'native/fp32':>12}")
        for n, r in found["rows"].items():
            print(f"  {n:>5} {r['native']:>9.2f} {r['fp32']:>9.2f} {r['fp32_weight_wide']:>19.2f} "
                  f"{r['native'] / r['fp32']:>12.2f}")


if __name__ == "__main__":
    main()
