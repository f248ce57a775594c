"""Lowering the recipe with torch-xla, and how often its graphs compile: against the cpu backend's TorchScript trace
and against a recipe that passes the decode position as a Python int.

On the tiny model (or ``--checkpoint DIR``), at tp_degree 1, in one process on torch-xla's CPU device:

- lowering: the seconds to lower each entry point (prefill over a bucket, decode over one token) to its HLO module,
  and in all, side by side with ``torch.jit.trace_module`` of the same rank (the cpu backend's trace), as a ratio;
- compiles per 100 decode steps after the warm-up, the recipe as built (positions are device tensors) against the
  same steps with the position read back as a Python int (the pattern the trace's check refuses): goal 0 against
  about 100.

Needs torch-xla (the ``[xla]`` extra: ``make test-xla`` sets up .venv-production with it):

    .venv-production/bin/python bench/xla_lowering.py [--checkpoint DIR] [--kv-max 512] [--bucket 128] [--steps 100]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def rank_state(checkpoint: Path, dtype):
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.plan import ShardPlan, load_rank_state
    from pipeline.recipe.spec import load_spec

    spec = load_spec(checkpoint)
    with Checkpoint(checkpoint, "model.") as ckpt:
        return spec, load_rank_state(ckpt, ShardPlan(spec, 1), 0, dtype)


def torchscript_seconds(spec, shape, state) -> dict[str, float]:
    import torch

    from pipeline.backends.base import example_inputs
    from pipeline.recipe.model import build_rank
    from pipeline.recipe.parallel import Parallel
    from pipeline.recipe.plan import ShardPlan

    module = build_rank(spec, ShardPlan(spec, 1), Parallel(1), shape.kv_max, shape.torch_dtype, dict(state))
    out = {}
    for entry, tokens in (("prefill", shape.bucket), ("decode", 1)):
        started = time.perf_counter()
        with torch.no_grad():
            torch.jit.trace_module(module, {entry: example_inputs(spec, tokens)}, check_trace=False)
        out[entry] = time.perf_counter() - started
    return out


def xla_seconds(xla_rank, spec, shape, state) -> dict[str, float]:
    module = xla_rank.rank_module(spec, shape, dict(state))
    out = {}
    for entry in ("prefill", "decode"):
        started = time.perf_counter()
        xla_rank.lower(module, spec, shape, entry)
        out[entry] = time.perf_counter() - started
    return out


def compiles_per_steps(xla_rank, spec, shape, state, steps: int, python_int: bool) -> int:
    import torch

    from pipeline.recipe.model import RankDecoder

    rope = RankDecoder._rope

    def rope_sliced_at_a_python_int(self, positions):
        # The position read back as a Python int and used as a slice bound: a constant of the graph, so a new graph
        # every step (what the trace's check refuses).
        start, count = int(positions.view(-1)[0]), positions.shape[-1]
        return rope(self, torch.arange(self.kv_max, device=positions.device)[start:start + count].view(1, count))

    if python_int:
        RankDecoder._rope = rope_sliced_at_a_python_int
    try:
        module = xla_rank.rank_module(spec, shape, dict(state))

        def step(entry: str, start: int) -> None:
            with torch.no_grad():
                xla_rank.write_back(module, module(*xla_rank.entry_inputs(spec, shape, entry, start))[1:])
            xla_rank.sync()

        for entry in shape.entries:  # the warm-up
            step(entry, 0)
        before = xla_rank.counter("UncachedCompile")
        for i in range(steps):
            step("decode", shape.bucket + i % (shape.kv_max - shape.bucket))
        return xla_rank.counter("UncachedCompile") - before
    finally:
        RankDecoder._rope = rope


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint directory (default: the tiny model)")
    parser.add_argument("--kv-max", type=int, default=512)
    parser.add_argument("--bucket", type=int, default=128)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()

    from pipeline.backends import xla_rank
    from pipeline.core.shape import BuildShape

    xla_rank.set_environment(1, debug=False)
    started = time.perf_counter()
    import torch_xla  # noqa: F401 - timed: what every xla process pays first

    import_s = time.perf_counter() - started
    shape = BuildShape(args.kv_max, args.bucket, args.dtype, "device", 1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from pipeline.models.tiny_model import TinyModelConfig, generate

            checkpoint = generate(TinyModelConfig(), Path(tmp) / "tiny")
        spec, state = rank_state(checkpoint, shape.torch_dtype)
        torchscript = torchscript_seconds(spec, shape, state)
        lowered = xla_seconds(xla_rank, spec, shape, state)
        recipe = compiles_per_steps(xla_rank, spec, shape, state, args.steps, python_int=False)
        naive = compiles_per_steps(xla_rank, spec, shape, state, args.steps, python_int=True)

    print(f"import torch_xla: {import_s:.2f} s; shape {shape.kv_max}/{shape.bucket} {shape.dtype}, "
          f"{spec.num_layers} layers, hidden {spec.hidden_size}")
    print(f"{'graph':10} {'xla lower s':>12} {'jit.trace s':>12} {'ratio':>7}")
    for entry in ("prefill", "decode"):
        ratio = lowered[entry] / torchscript[entry]
        print(f"{entry:10} {lowered[entry]:12.3f} {torchscript[entry]:12.3f} {ratio:7.2f}")
    total, base = sum(lowered.values()), sum(torchscript.values())
    print(f"{'total':10} {total:12.3f} {base:12.3f} {total / base:7.2f}")
    per_100 = 100 / args.steps
    print(f"compiles per 100 decode steps after the warm-up: recipe {recipe * per_100:.0f} (goal 0), "
          f"position as a Python int {naive * per_100:.0f}")
    return 0 if recipe == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
