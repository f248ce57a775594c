"""Host prefill at google/gemma-4-E4B-it's widths: one thread against every usable CPU, side by side in one run.

Writes bench/rank_weights_rss.py's checkpoint (E4B's vocabulary, hidden and per-layer widths, ``--layers`` layers),
builds the host's float model (pipeline/recipe/host.py ``HostPrefill``, what host-prefill variants run before the
ranks decode), and times a ``--tokens``-token prompt's prefill under ``torch.set_num_threads(1)`` (the validation
process's default, before the per-phase policy) and under the policy's count (validation/generation.py
``host_prefill_threads``: every usable CPU), ``--runs`` each, medians. The projection scales the whole time to E4B's
42 layers (the head's share included: an upper bound), against the 2000 ms first-token floor inf2's host-prefill
variants are gated at (conf/validate/default.yaml). The seed measured 6.3 s on 1 thread and 1.4 s on 32
(optb_server_tp.py).

    python bench/host_prefill_threads.py [--layers 6] [--tokens 16] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

E4B_LAYERS = 42


def timed(prefill, prompt: list[int], threads: int, runs: int) -> float:
    from pipeline.decoding.runner import torch_threads

    seconds = []
    with torch_threads(threads):
        prefill(prompt)  # first-call costs
        for _ in range(runs):
            started = time.perf_counter()
            prefill(prompt)
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import torch

    from bench.rank_weights_rss import write_checkpoint
    from pipeline.decoding.runner import host_prefill_threads
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.host import HostPrefill
    from pipeline.recipe.spec import load_spec

    with tempfile.TemporaryDirectory(prefix="host-prefill-") as tmp:
        path = Path(tmp) / "e4b-widths"
        write_checkpoint(path, args.layers)
        spec = load_spec(path)
        prompt = list(range(2, 2 + args.tokens))
        with Checkpoint(path, "model.", None) as ckpt:
            host = HostPrefill(ckpt, spec, 256, torch.float32)  # the fp32 figure this bench has always reported
            many = host_prefill_threads()
            one_s = timed(host.prefill, prompt, 1, args.runs)
            many_s = timed(host.prefill, prompt, many, args.runs)
    scale = E4B_LAYERS / args.layers
    print(f"host prefill of {args.tokens} tokens, E4B widths, {args.layers} layers (projected to {E4B_LAYERS}):")
    print(f"  1 thread:   {one_s * 1e3:8.0f} ms  (projected {one_s * scale * 1e3:8.0f} ms)")
    print(f"  {many} threads: {many_s * 1e3:8.0f} ms  (projected {many_s * scale * 1e3:8.0f} ms)")
    print(f"  1 thread / {many} threads: {one_s / many_s:.2f}x  (the seed on inf2.8xlarge: 6.3 s / 1.4 s = 4.5x)")
    print(f"  the first-token floor: 2000 ms; projected with the policy: {many_s * scale * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
