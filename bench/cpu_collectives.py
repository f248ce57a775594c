"""The cpu backend's collectives, measured: a build decoded with its ranks' all-reduces through gloo and through shared
memory (pipeline/backends/cpu_collectives.py), side by side in one run, and one collective alone by each route.

Two measurements, each route in turn per round (``--rounds``), medians:

  one collective   two rank processes, one thread each: an fp32 all-reduce of one token's activations at
                   google/gemma-4-E4B-it's width (2,560) and of the vocabulary head's half row (131,072), by gloo
                   (``_c10d_functional``, what a traced rank records) and by the shared slots.
  decode           a build decoded by ``generate`` (the loop validation and serve run): first token and tokens/s.
                   By default the tiny ``--variant`` built with the pipeline's own stages (CI's size); with
                   ``--build`` a build folder and ``--checkpoint`` its checkpoint (the full-size rehearsal's).

Prints each route's figures and shared memory's ratio against gloo.

    python bench/cpu_collectives.py [--variant 512_bf16] [--tokens 32] [--rounds 3]
    python bench/cpu_collectives.py --build /tmp/rehearse-e4b/artifacts/gemma4_e4b/512_bf16/build \\
        --checkpoint /tmp/rehearse-e4b/checkpoint --tokens 16 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WIDTHS = {"a token's activations (2,560)": 2_560, "half a vocabulary row (131,072)": 131_072}
CALLS = 400


def _one_collective(rank: int, world: int, init: str, results) -> None:
    import torch
    import torch.distributed as dist

    from pipeline.backends import cpu_collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    cpu_collectives.attach(rank, world, init)
    functional = torch.ops._c10d_functional
    routes = {"gloo": lambda x: functional.wait_tensor(functional.all_reduce(x, "sum", "0")),
              "shared_memory": torch.ops.pipeline_cpu.all_reduce_sum}
    figures = {}
    for what, width in WIDTHS.items():
        x = torch.randn(1, width)
        for route, call in routes.items():
            dist.barrier()
            started = time.perf_counter()
            for _ in range(CALLS):
                call(x)
            figures[what, route] = (time.perf_counter() - started) / CALLS * 1e6
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


def one_collective() -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = tempfile.mktemp(prefix="bench-collectives-")
    procs = [ctx.Process(target=_one_collective, args=(r, 2, init, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    figures = results.get(timeout=600)
    for proc in procs:
        proc.join()
    return figures


def build(artifacts: Path, variant: str) -> tuple[Path, Path]:
    """The variant built by the pipeline (cpu backend): its build folder and the checkpoint."""
    for stage in ("toolchain", "model", "trace", "package"):
        subprocess.run([sys.executable, "-m", "pipeline", f"+variant={variant}", f"stage={stage}", "backend=cpu",
                        f"artifacts_dir={artifacts}"], check=True, cwd=REPO, capture_output=True)
    return artifacts / "gemma4_tiny" / variant / "build", artifacts / "gemma4_tiny" / "weights"


def decode(build_dir: Path, checkpoint: Path, tokens: int, rounds: int) -> dict[str, tuple[float, float]]:
    from pipeline.backends import cpu_collectives
    from pipeline.cli.generate import generate

    seen: dict[str, list[tuple[float, float]]] = {route: [] for route in cpu_collectives.CHOICES}
    for _ in range(rounds):
        for route in ("gloo", "shared_memory"):
            os.environ[cpu_collectives.ENV] = route  # read where the build is loaded
            result = generate(build_dir, checkpoint, "What is the capital of France?", tokens, None)
            seen[route].append((result.ttft_ms, result.tokens_per_s))
    os.environ.pop(cpu_collectives.ENV)
    return {route: (statistics.median(f[0] for f in v), statistics.median(f[1] for f in v))
            for route, v in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="512_bf16")
    parser.add_argument("--build", type=Path)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    figures = one_collective()
    print(f"one fp32 all-reduce, two rank processes, mean of {CALLS} calls (microseconds):")
    for what in WIDTHS:
        gloo, ours = figures[what, "gloo"], figures[what, "shared_memory"]
        print(f"  {what:<34} gloo {gloo:8.0f}   shared memory {ours:8.0f}   {gloo / ours:6.1f}x faster")

    with tempfile.TemporaryDirectory(prefix="bench-collectives-") as tmp:
        if args.build:
            build_dir, checkpoint, what = args.build, args.checkpoint, str(args.build)
        else:
            (build_dir, checkpoint), what = build(Path(tmp), args.variant), f"tiny {args.variant}"
        found = decode(build_dir, checkpoint, args.tokens, args.rounds)
    (gloo_ttft, gloo_rate), (ours_ttft, ours_rate) = found["gloo"], found["shared_memory"]
    print(f"decode, {what}, {args.tokens} tokens (median of {args.rounds}):")
    print(f"  gloo           first token {gloo_ttft:9.1f} ms   {gloo_rate:7.2f} tokens/s")
    print(f"  shared memory  first token {ours_ttft:9.1f} ms   {ours_rate:7.2f} tokens/s")
    print(f"  shared memory vs gloo: decode {ours_rate / gloo_rate:.2f}x, first token {gloo_ttft / ours_ttft:.2f}x "
          "faster")


if __name__ == "__main__":
    main()
