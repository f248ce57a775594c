"""What returning the aliased KV caches with every decode step would cost, at google/gemma-4-E4B-it's widths.

A host-prefill build's graph returns ``(logits, *caches)`` and aliases each cache output to its state input, so the
runtime updates the caches in place; but every output of the graph is in its metaneff, and torch-neuronx returns them
(the stand-in does: tests/fake_neuron). If the runtime copies each returned cache to host memory every step, decode pays
for it whatever this side does with them (the runner only reads the logits: tests/test_neuron_contract.py). This bench
measures, side by side in one run, for each host-prefill variant's ``kv_max``:

  bytes    one rank's caches per step (pipeline/backends/neuron_memory.py ``kv_bytes``, E4B's config)
  baseline a host copy of the logits only (what decode must move: one fp32 row of the vocabulary)
  copy     a host copy of those cache bytes too (``torch.Tensor.clone``, this machine's memory bandwidth: a lower
           bound of a device-to-host transfer)

and prints the copy's cost against inf2's decode budget (30 tokens/s: 33 ms a token). Only an inf2 host shows whether
the runtime makes the copy (docs/inf2-host.md, first-run checklist: decode ms/token of a host-prefill build against the
device-prefill build of the same kv_max, which returns the logits only).

    python bench/aliased_outputs.py [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DECODE_BUDGET_MS = 1000 / 30  # conf/validate/default.yaml: inf2's decode floor, 30 tokens/s


def median_ms(work, runs: int) -> float:
    work()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()

    import torch

    from pipeline.backends.neuron_memory import kv_bytes
    from pipeline.core.shape import BuildShape
    from pipeline.recipe.spec import spec_from_config
    from tests.test_spec_and_plan import E4B_CONFIG

    spec = spec_from_config(E4B_CONFIG)
    logits = torch.zeros(1, spec.vocab_size)
    baseline = median_ms(lambda: logits.clone(), args.runs)
    print(f"E4B, one rank (tp_degree 2): logits copy {baseline:.3f} ms; decode budget {DECODE_BUDGET_MS:.1f} ms/token")
    for kv_max in (256, 512, 2048):
        shape = BuildShape(kv_max, 64, "bf16", "host", 2)
        size = kv_bytes(spec, shape)
        caches = torch.zeros(size // 2, dtype=torch.bfloat16)
        copy = median_ms(lambda held=caches: (logits.clone(), held.clone()), args.runs)
        print(f"  kv_max {kv_max:5d}: caches {size / 2**20:7.1f} MiB per step; copy {copy:7.3f} ms "
              f"({copy / baseline:6.1f}x the logits alone, {100 * copy / DECODE_BUDGET_MS:5.1f}% of the budget)")


if __name__ == "__main__":
    main()
