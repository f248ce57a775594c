"""Decode threads, measured: the decode loop's tokens/s at 1, 2 and every usable CPU, side by side in one run.

Two measurements, each thread count in turn per round (``--rounds``), medians:

  cpu backend   one tiny build (``--variant``, the embedded model, built with the pipeline's own stages), decoded by
                ``generate`` (validation/generation.py ``Generator``, the loop validation and serve run) with
                ``decode_threads`` at each count: the host's torch threads beside the two rank processes.
  host share    what the host does per token on inf2, where the NeuronCores run the graph: the token's row of the
                embedding table and of the per-layer table, at google/gemma-4-E4B-it's widths (262,144 x 2,560 and
                262,144 x 42 x 256, bf16, scaled as HostEmbeddings does), and the argmax of 262,144 logits.

Prints tokens/s (steps/s for the host share) per count and the ratio against 1 thread, the default
(decoding/runner.py ``DECODE_THREADS``; validate.throughput.decode_threads and ``--decode-threads`` set it).

    python bench/decode_threads.py [--variant 512_fp32] [--tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VOCAB, HIDDEN, LAYERS, PER_LAYER = 262_144, 2_560, 42, 256  # google/gemma-4-E4B-it's text config


def build(artifacts: Path, variant: str) -> tuple[Path, Path]:
    """The variant built by the pipeline (cpu backend): its build folder and the checkpoint."""
    for stage in ("toolchain", "model", "trace", "package"):
        subprocess.run([sys.executable, "-m", "pipeline", f"+variant={variant}", f"stage={stage}", "backend=cpu",
                        f"artifacts_dir={artifacts}"], check=True, cwd=REPO, capture_output=True)
    return artifacts / "gemma4_tiny" / variant / "build", artifacts / "gemma4_tiny" / "weights"


def cpu_backend(build_dir: Path, weights: Path, counts: list[int], tokens: int, rounds: int) -> dict[int, float]:
    from pipeline.cli.generate import generate

    seen: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            result = generate(build_dir, weights, "Tell me about the sea.", tokens, None, decode_threads=n)
            seen[n].append(result.tokens_per_s)
    return {n: statistics.median(v) for n, v in seen.items()}


def host_share(counts: list[int], steps: int, rounds: int) -> dict[int, float]:
    import torch

    from pipeline.decoding.runner import torch_threads

    # Untouched pages cost nothing: only the rows a step reads are ever faulted in, as with the mapped checkpoint.
    embed = torch.empty(VOCAB, HIDDEN, dtype=torch.bfloat16)
    per_layer = torch.empty(VOCAB, LAYERS * PER_LAYER, dtype=torch.bfloat16)
    logits = torch.randn(VOCAB)
    tokens = torch.randint(0, VOCAB, (steps,)).tolist()

    def step(token: int) -> int:
        row = embed[token].float() * HIDDEN ** 0.5
        layers = per_layer[token].float().view(LAYERS, PER_LAYER) * PER_LAYER ** 0.5
        return int(torch.argmax(logits + row[0] + layers[0, 0]))

    seen: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            with torch_threads(n):
                step(tokens[0])
                started = time.perf_counter()
                for token in tokens:
                    step(token)
                seen[n].append(steps / (time.perf_counter() - started))
    return {n: statistics.median(v) for n, v in seen.items()}


def report(title: str, unit: str, figures: dict[int, float]) -> None:
    print(title)
    for n, value in figures.items():
        print(f"  {n} thread(s): {value:10.1f} {unit}   {value / figures[1]:.2f}x of 1 thread")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="512_fp32")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from pipeline.host.procinfo import usable_cpus

    counts = sorted({1, 2, usable_cpus()})
    report(f"host share of a decode step at E4B's widths ({args.steps} steps, median of {args.rounds}):", "steps/s",
           host_share(counts, args.steps, args.rounds))
    with tempfile.TemporaryDirectory(prefix="decode-threads-") as tmp:
        build_dir, weights = build(Path(tmp), args.variant)
        report(f"cpu backend, tiny {args.variant}, {args.tokens} tokens (median of {args.rounds}):", "tokens/s",
               cpu_backend(build_dir, weights, counts, args.tokens, args.rounds))


if __name__ == "__main__":
    main()
