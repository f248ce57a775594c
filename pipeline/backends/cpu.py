"""The cpu backend: the recipe traced with TorchScript, one process per rank, real collectives.

Trace: ``tp_degree`` processes join a gloo group; each slices its own weights from the safetensors files, builds its
``StatefulRank``, traces the variant's entry points (``prefill`` and ``decode`` of one module, so they share weights
and caches) with ``torch.jit.trace_module``, zeroes the caches and saves ``tp_<rank>.pt``. The collectives run for
real during tracing, exactly as the neuron backend's ranks compile concurrently.

Load: ``tp_degree`` fresh processes join a new gloo group and ``torch.jit.load`` their rank, whose collectives are
then rewritten to go through shared memory (pipeline/backends/cpu_collectives.py: gloo's latency was a third of a
decode step), and a bf16 build's one-row decode graph runs through torch's own kernels (pipeline/host/bf16_matmul.py
``one_row``); the parent sends each step's inputs to every rank and reads rank 0's outputs. This is what proves the
sharding recipe token for token before anyone pays for an inf2 instance. The processes, their pipes and the runner
are the rank runtime's (pipeline/backends/ranks.py); this module is their main.

Writes: ``<out_dir>/tp_<rank>.pt`` for every rank, and nothing else.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.artifact.archive import VerifiedBuild, require_verified
from pipeline.backends import cpu_collectives
from pipeline.backends.base import TraceRequest, check_request, entry_inputs
from pipeline.backends.ranks import (
    ProcessRunner,
    ServeJob,
    Traced,
    TracedRank,
    TraceJob,
    report_failure,
    serve_commands,
    trace_in_processes,
    trace_result,
)
from pipeline.backends.torchscript import save as save_torchscript
from pipeline.core.build_records import ToolchainRecord, TraceResult
from pipeline.core.fsutil import reporting_full_disk, sha256_file
from pipeline.core.log import relay_output
from pipeline.core.log import setup as setup_logging
from pipeline.core.shape import BuildShape, rank_members
from pipeline.host import bf16_matmul
from pipeline.host.procinfo import die_with_parent, peak_rss_bytes

# Collectives in a saved rank name their process group; every process group this backend creates is the default
# (WORLD) group, which torch names "0".
GROUP_NAME = "0"


def _threads_per_rank(tp_degree: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp_degree)


def _init_group(rank: int, tp_degree: int, init_file: str) -> None:
    if tp_degree == 1:
        return
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp_degree)
    name = dist.group.WORLD.group_name
    if name != GROUP_NAME:
        raise RuntimeError(f"gloo default group is named {name!r}, traced ranks expect {GROUP_NAME!r}")


# -- rank processes -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CpuTracedRank(TracedRank):
    """A rank this backend traced: also the time it took to slice and build it (``load_s``)."""

    load_s: float


def _trace_rank(rank: int, request: TraceRequest, out_dir: str) -> CpuTracedRank:
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.model import build_rank
    from pipeline.recipe.parallel import Parallel
    from pipeline.recipe.plan import ShardPlan, load_rank_state
    from pipeline.recipe.spec import load_spec

    shape = request.shape
    started = time.monotonic()
    spec = load_spec(request.checkpoint.directory)
    plan = ShardPlan(spec, shape.tp_degree)
    with Checkpoint(request.checkpoint.directory, request.checkpoint.text_prefix, request.checkpoint.head_key) as ckpt:
        state = load_rank_state(ckpt, plan, rank, shape.torch_dtype)
    module = build_rank(spec, plan, Parallel(shape.tp_degree, GROUP_NAME), shape.kv_max, shape.torch_dtype, state,
                        shape.batch_size)
    del state
    loaded = time.monotonic()
    with torch.no_grad():
        # Both entries' examples, alive until the rank is saved, as they always were: torch 2.8 writes a trace's
        # example inputs into the file, and what its pickler memoizes there depends on what else is alive (batch 1's
        # bytes are kept as they were).
        examples = {e: entry_inputs(spec, shape, e) for e in ("prefill", "decode")}
        for entry in shape.prefill_entries:  # the ladder's smaller buckets: the same method, traced at their size
            examples.setdefault(entry, entry_inputs(spec, shape, entry))
            if not hasattr(module, entry):
                setattr(module, entry, module.prefill)
        traced = torch.jit.trace_module(module, {e: examples[e] for e in shape.entries}, check_trace=False)
        for name, buf in traced.named_buffers():
            if "_cache_" in name:
                buf.zero_()  # tracing ran the examples through the caches
    path = Path(out_dir) / f"tp_{rank}.pt"
    with reporting_full_disk(path, f"trace: rank {rank}"):
        # No copy of the archive in memory; then without its debug records: the same bytes from any checkout,
        # environment or host.
        save_torchscript(traced, path)
    return CpuTracedRank(rank=rank, file=path.name, size=path.stat().st_size, sha256=sha256_file(path),
                         peak_rss_bytes=peak_rss_bytes(), trace_s=round(time.monotonic() - loaded, 3),
                         load_s=round(loaded - started, 3))


def _serve_rank(rank: int, build: VerifiedBuild, conn, shape: BuildShape, route: str, collectives: str | None) -> None:
    # Loading TorchScript runs code: only files verified against the manifest, unchanged since (stat check).
    build.recheck()
    module = torch.jit.load(str(build.directory / f"tp_{rank}.pt"))
    if route == "fp32":  # this CPU has no bf16 instructions
        bf16_matmul.rewrite_rank(module, bf16_matmul.widened_entries(shape))
    if collectives == "shared_memory":
        cpu_collectives.rewrite_rank(module, shape.entries)
    caches = [buf for name, buf in module.named_buffers() if "_cache_" in name]
    gc.freeze()  # the loaded module is permanent: the per-step garbage collections need not walk it again

    one_row = bf16_matmul.one_row_entries(shape)

    def step(entry: str, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad(), bf16_matmul.one_row() if entry in one_row else contextlib.nullcontext():
            return getattr(module, entry)(*inputs)

    def seed(values: list[torch.Tensor], line: int) -> None:
        for buf, value in zip(caches, values, strict=True):
            buf[line:line + 1].copy_(value)

    def reset() -> None:
        for buf in caches:
            buf.zero_()

    serve_commands(conn, rank, step, seed, reset)


def _rank_main(rank: int, tp_degree: int, init_file: str, job: TraceJob | ServeJob, conn) -> None:
    die_with_parent(parent=mp.parent_process().pid)  # never outlive a parent killed with SIGKILL
    setup_logging()
    relay_output(f"pipeline.rank{rank}")  # gloo prints its connection lines on the command's standard output
    try:
        torch.set_num_threads(_threads_per_rank(tp_degree))
        _init_group(rank, tp_degree, init_file)
        if isinstance(job, TraceJob):
            conn.send(Traced((_trace_rank(rank, job.request, job.out_dir),)))
        else:
            if job.collectives == "shared_memory":
                cpu_collectives.attach(rank, tp_degree, init_file)
            _serve_rank(rank, job.build, conn, job.shape, job.bf16_matmul, job.collectives)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        report_failure(conn, exc)
    finally:
        if tp_degree > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


# -- the backend --------------------------------------------------------------------------------------------------

class CpuBackend:
    name = "cpu"

    def members(self, shape: BuildShape) -> list[str]:
        return rank_members(shape.tp_degree)

    def compiler_id(self, toolchain: ToolchainRecord) -> str:
        version = str(toolchain.version("torch") or torch.__version__)
        return "cpu-torch" + version.split("+")[0]

    def check(self, request: TraceRequest) -> None:
        """Every refusal that needs no tracing, before anything is written."""
        check_request(request)

    def check_installed(self, request: TraceRequest | None = None) -> None:
        """torch is all it needs."""

    def check_load(self, shape: BuildShape) -> None:
        """Every shape a cpu build was traced for runs."""

    def compiler_info(self) -> dict:
        return {"compiler": "torch.jit.trace", "torch": torch.__version__, "python": platform.python_version()}

    def trace(self, request: TraceRequest, out_dir: Path) -> TraceResult:
        check_request(request)
        started = time.monotonic()
        ranks = trace_in_processes(request.shape.tp_degree, request, Path(out_dir), self.members(request.shape),
                                   target=_rank_main)
        return trace_result(ranks, request.shape, started, {"group_name": GROUP_NAME, **self.compiler_info()})

    def load(self, build: VerifiedBuild, shape: BuildShape) -> ProcessRunner:
        # One rank has no collectives; several exchange theirs through shared memory where that is safe (x86-64)
        collectives = cpu_collectives.chosen() if shape.tp_degree > 1 else None
        return ProcessRunner(require_verified(build), shape, target=_rank_main, bf16_matmul=bf16_matmul.chosen(),
                             collectives=collectives)
