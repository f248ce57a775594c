"""How this host runs bf16 matmuls of many rows: torch's bf16 kernels (``native``), or in fp32 over the same bf16
values, rounded back to bf16 (``fp32``), chosen from what the CPU reports; and of one row: torch's own kernels, not
oneDNN's. Nothing is written.

Why. On a CPU with bf16 instructions (avx512_bf16, AMX) torch hands bf16 matmuls to oneDNN, which is fast. On one
without them (AVX2-only, as many cloud instances and CI runners are) torch's bf16 kernels' cost grows with every
row: bench/bf16_matmul.py, 2 cores limited to AVX2, a [rows, 2560] x [2560, 10240] matmul took 1.5 ms at 1 row and
5.9 at 4, but 143 ms at 128 rows and 561 ms at 512, where fp32 over the same values, the weight's cast included, took
91 and 198 ms (1.6x and 2.8x faster; even at 64 rows). A decode step's few rows are faster as they are: the weight's
cast alone (~35 ms there) costs more than it saves, so only a matmul of ``MIN_ROWS`` rows or more takes the route.

What it computes. Both routes multiply the same bf16 values and accumulate in fp32 (torch's bf16 kernels accumulate
in fp32, as oneDNN's and a NeuronCore's do), and round the result to bf16 once: they differ only in the order of the
fp32 sums, far below bf16's rounding step, so a bf16 build's tokens and logits agree between routes to that rounding
(tests/test_bf16_matmul.py) and parity means what it meant. The reference stage measures transformers' bf16 noise
through the fp32 route on every CPU (``Fp32Matmuls(min_rows=1)``), so the yardstick is the same figure everywhere.

One row. A bf16 graph of one row per call (a decode step of one sequence) runs through torch's own bf16 kernels,
never oneDNN's (``one_row``): on a CPU with avx512_bf16, oneDNN's one-row kernel is the slower one by far (the bench
above: 3.22 against 1.54 ms; E4B's decode step at full size, tp_degree 2 on 2 cores: 551 ms through it, 309 ms
through torch's, the same bf16 values multiplied and summed in fp32 by both), while from 4 rows on oneDNN's is the
faster (3.32 against 5.88 ms). A CPU without bf16 instructions runs torch's anyway.

Two mechanisms, one rule. Eager code (the host's prefill model, transformers in the reference stage) runs under
``Fp32Matmuls``, a torch function mode. A loaded TorchScript rank (the cpu backend) cannot be reached by a mode: its
graphs for ``MIN_ROWS`` rows or more are inlined and each ``aten::linear`` and ``aten::matmul`` rewritten to cast to
fp32, multiply and cast back to its input's dtype (a no-op cast in an fp32 graph). The rank files are not touched.

``PIPELINE_BF16_MATMUL=native|fp32`` overrides the choice (``auto``, the default, reads the CPU): the tests force
the fp32 route on a CPU that has bf16 instructions.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from pipeline.core.errors import InputError

ENV = "PIPELINE_BF16_MATMUL"
ROUTES = ("native", "fp32")
MIN_ROWS = 64
"""Rows from which the fp32 route is taken where it is chosen: the break-even of the measurement above (1.04x)."""
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
"""/proc/cpuinfo flags that give torch fast bf16 matmuls (x86's AVX-512 BF16 and AMX; Arm's BF16 extension)."""
CPUINFO = Path("/proc/cpuinfo")


def cpu_bf16_flags(cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """The bf16 instruction flags this CPU reports (empty: none, or no /proc/cpuinfo to read)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return ()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            present = set(value.split())
            return tuple(flag for flag in BF16_FLAGS if flag in present)
    return ()


def chosen(cpuinfo: Path = CPUINFO) -> str:
    """``native`` where the CPU has bf16 instructions, else ``fp32``; ``PIPELINE_BF16_MATMUL`` overrides."""
    wanted = os.environ.get(ENV, "auto").strip() or "auto"
    if wanted in ROUTES:
        return wanted
    if wanted != "auto":
        raise InputError(f"{ENV}={wanted!r} is not one of auto, {', '.join(ROUTES)}: unset it to choose from the "
                          "CPU's flags")
    return "native" if cpu_bf16_flags(cpuinfo) else "fp32"


def overridden() -> bool:
    """Whether ``PIPELINE_BF16_MATMUL`` chose the route instead of the CPU's flags."""
    return os.environ.get(ENV, "auto").strip() not in ("", "auto")


# -- eager code ------------------------------------------------------------------------------------------------------

def _rows(t: torch.Tensor) -> int:
    return t.shape[-2] if t.dim() >= 2 else 1


class Fp32Matmuls(TorchFunctionMode):
    """Inside it, a bf16 ``linear``/``matmul``/``bmm`` of ``min_rows`` rows or more runs in fp32 over the same values
    and returns bf16; anything else runs as it is."""

    LINEAR = {torch.nn.functional.linear}
    MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}

    def __init__(self, min_rows: int = MIN_ROWS):
        super().__init__()
        self.min_rows = min_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.LINEAR or func in self.MATMUL:
            a, b = args[0], args[1]
            rows = a.numel() // max(1, a.shape[-1]) if func in self.LINEAR else _rows(a)
            if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and rows >= self.min_rows:
                if func in self.LINEAR:
                    return linear_in_slices(a, b, args[2] if len(args) > 2 else kwargs.get("bias"))
                wide = [x.float() if isinstance(x, torch.Tensor) else x for x in args]
                return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


SLICE_ELEMENTS = 1 << 26
"""A weight is widened to fp32 at most this many elements at a time (256 MiB): E4B's tied vocabulary head, widened
whole, is 2.7 GB beside the bf16 model (the reference stage's peak rose from 19.8 to 22.0 GiB at full size)."""


def linear_in_slices(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(x, weight, bias)`` in fp32 over the bf16 values, rounded to bf16, the weight widened a slice of output
    features at a time (each output is the same sum either way: the slices split the outputs, not the reduction)."""
    wide_x = x.float()
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.bfloat16)
    step = max(1, SLICE_ELEMENTS // max(1, weight.shape[-1]))
    for start in range(0, weight.shape[0], step):
        part = slice(start, start + step)
        wide_bias = None if bias is None else bias[part].float()
        out[..., part] = torch.nn.functional.linear(wide_x, weight[part].float(), wide_bias)
    return out


def _bf16_graph_rows(shape) -> dict[str, int]:
    """A bf16 build's rank graphs and the rows each multiplies per call (sequences x tokens); none of an fp32
    build's."""
    if shape.dtype != "bf16":
        return {}
    return {e: math.prod(shape.entry_rows(e)) for e in shape.entries}


def one_row_entries(shape) -> tuple[str, ...]:
    """The rank graphs of a bf16 build of ``shape`` that multiply one row per call (decode's at batch 1)."""
    return tuple(e for e, rows in _bf16_graph_rows(shape).items() if rows == 1)


@contextlib.contextmanager
def one_row() -> Iterator[None]:
    """Run the block's matmuls through torch's own kernels, not oneDNN's (one row of bf16: see above)."""
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False  # (mkldnn.flags() would also flip oneDNN's TF32 switch, and warn)
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


@contextlib.contextmanager
def eager(route: str) -> Iterator[None]:
    """Run the block's bf16 matmuls by ``route``."""
    if route == "fp32":
        with Fp32Matmuls():
            yield
    else:
        yield


# -- TorchScript ranks -------------------------------------------------------------------------------------------------

_CAST = """
    %f32 : int = prim::Constant[value=6]()
    %no : bool = prim::Constant[value=0]()
    %none : NoneType = prim::Constant()"""
# (pattern, replacement): the result is cast back to the dtype the op was given. The recipe's linears have no bias
# (Gemma has none); a bf16 bias would meet fp32 operands and fail loudly at the first call, not silently.
REWRITES = (
    ("""
graph(%x, %w, %b):
    %y = aten::linear(%x, %w, %b)
    return (%y)""", """
graph(%x, %w, %b):""" + _CAST + """
    %dt : int = prim::dtype(%w)
    %x32 = aten::to(%x, %f32, %no, %no, %none)
    %w32 = aten::to(%w, %f32, %no, %no, %none)
    %y32 = aten::linear(%x32, %w32, %b)
    %y = aten::to(%y32, %dt, %no, %no, %none)
    return (%y)"""),
    ("""
graph(%a, %b):
    %y = aten::matmul(%a, %b)
    return (%y)""", """
graph(%a, %b):""" + _CAST + """
    %dt : int = prim::dtype(%a)
    %a32 = aten::to(%a, %f32, %no, %no, %none)
    %b32 = aten::to(%b, %f32, %no, %no, %none)
    %y32 = aten::matmul(%a32, %b32)
    %y = aten::to(%y32, %dt, %no, %no, %none)
    return (%y)"""),
)


def widened_entries(shape) -> tuple[str, ...]:
    """The rank graphs of a build of ``shape`` (a ``BuildShape``) the fp32 route widens: a bf16 build's graphs that
    multiply ``MIN_ROWS`` rows or more (sequences x tokens per call; none of an fp32 build's)."""
    return tuple(e for e, rows in _bf16_graph_rows(shape).items() if rows >= MIN_ROWS)


def rank_graphs_widened(shape) -> bool:
    """Whether this host runs some rank graph of a build of ``shape`` in fp32 (what the preflight counts for
    validation): the fp32 route chosen, and a graph it widens."""
    return chosen() == "fp32" and bool(widened_entries(shape))


def rewrite_rank(module: torch.jit.ScriptModule, entries: Iterable[str]) -> list[str]:
    """Give each of ``entries`` (``widened_entries``) the fp32 route, before its first call (its executor is built
    from the graph then). Returns the entries rewritten."""
    rewritten = []
    for entry in entries:
        graph = getattr(module, entry).graph
        torch._C._jit_pass_inline(graph)  # the linears live in submodules' methods, which decode shares
        for pattern, replacement in REWRITES:
            torch._C._jit_pass_custom_pattern_based_rewrite_graph(pattern, replacement, graph)
        rewritten.append(entry)
    return rewritten
