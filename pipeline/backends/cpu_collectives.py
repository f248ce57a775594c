"""The cpu backend's collectives at load time: the ranks' all-reduces and gathers through shared memory, not gloo.

Why: a rank graph's collectives are recorded as ``_c10d_functional`` calls on the gloo group (recipe/parallel.py),
and gloo over loopback TCP is slow for what a decode step sends: measured on a 2-core VM (bench/cpu_collectives.py),
one all-reduce of a token's activations (10 KB) took 1.4 ms, and E4B's decode step makes 84 of them and a gather:
about a quarter of the step. Two processes on one host need no network: each rank writes its part into a slot of a
shared mapping, raises its flag, and reads the others' parts once every flag is up. The NeuronCores' collectives are
the device's (the neuron backend never runs this); this is the stand-in's runtime only, and rank files are unchanged.

How: ``attach`` (every rank process, after joining the gloo group) maps one file of ``2 x world`` slots of
``SLOT_BYTES`` and a flag per rank, created by rank 0 with its blocks reserved (``posix_fallocate``: a full disk is an
error here, never a SIGBUS in the middle of a step) and unlinked once every rank has mapped it, so nothing is left
behind whatever ends the processes. ``rewrite_rank`` replaces each ``all_reduce`` + ``wait_tensor`` (and
``all_gather_into_tensor`` + ``wait_tensor``) of a loaded rank's graphs with this module's ops, before their first
call. Call ``n`` of every rank (the graphs are the same on every rank, so their collectives come in the same order)
uses the slots of parity ``n % 2``: a rank reaches call ``n + 2`` only after every rank raised its flag for ``n +
1``, which each does after reading call ``n``'s slots, so no slot is written while it is read.

Same numbers as gloo: the parts are summed in fp32 in rank order, the same result on every rank; at two ranks that is
exactly gloo's ``a + b`` (fp32 addition commutes), which ``tests/test_cpu_collectives.py`` checks bit for bit. A part
larger than ``SLOT_BYTES`` (a long prefill bucket of a wide model) goes through gloo, on every rank alike (the size is
the same on each). Only on x86-64, whose stores become visible in program order (a part is written before its flag);
elsewhere, and with ``PIPELINE_CPU_COLLECTIVES=gloo``, the graphs keep gloo's.

Waiting: a rank checks the flags in a loop, a few checks spinning, then yielding its core at each check
(``sched_yield``: back at once when no other process wants that core, as when the ranks have a core each), then in
short naps; so ranks that share their cores with other work (a busy host, tests in parallel) never spin against the
rank they wait for. (Spinning for milliseconds first, tried: ``make test``, two workers' rank processes on two cores,
had run a third of its tests after 8 minutes, where it runs them all in 12.)

Writes: the mapped file, under /dev/shm when it has room (else beside gloo's rendezvous file), removed at once.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.core.errors import BuildError, InputError
from pipeline.recipe import parallel

ENV = "PIPELINE_CPU_COLLECTIVES"
CHOICES = ("shared_memory", "gloo")
SLOT_BYTES = 8 << 20  # one rank's part of one call: E4B's 512-token prefill (5.2 MB fp32) and a batch-4 gather fit
FLAG_STRIDE = 64  # bytes between two ranks' flags: one cache line each, so that raising one does not stall the others
SPIN_CHECKS = 100  # ~ 20 us of checks; then each check yields the core (at once back if nothing else wants it)
YIELD_CHECKS = 20_000  # ~ 20 ms of those on an idle core; then naps
NAP_S = 50e-6

_LIBRARY = torch.library.Library("pipeline_cpu", "DEF")
_LIBRARY.define("all_reduce_sum(Tensor x) -> Tensor")
_LIBRARY.define("all_gather_dim0(Tensor x, int world) -> Tensor")

# The rewrites, in TorchScript IR: a collective and its wait become one call of this module's op. (The reduce op is a
# constant in a loaded rank; the pattern cannot match a constant's value, so rewrite_rank checks every one is "sum".)
REWRITES = (
    ("""
graph(%x, %op, %group):
    %y = _c10d_functional::all_reduce(%x, %op, %group)
    %z = _c10d_functional::wait_tensor(%y)
    return (%z)""", """
graph(%x, %op, %group):
    %z = pipeline_cpu::all_reduce_sum(%x)
    return (%z)"""),
    ("""
graph(%x, %world, %group):
    %y = _c10d_functional::all_gather_into_tensor(%x, %world, %group)
    %z = _c10d_functional::wait_tensor(%y)
    return (%z)""", """
graph(%x, %world, %group):
    %z = pipeline_cpu::all_gather_dim0(%x, %world)
    return (%z)"""),
)


def chosen() -> str:
    """What this process's ranks use: ``PIPELINE_CPU_COLLECTIVES`` if set (refused if unknown), else shared memory on
    x86-64 and gloo elsewhere."""
    value = os.environ.get(ENV, "").strip()
    if value:
        if value not in CHOICES:
            raise InputError(f"{ENV}={value!r} is not one of {', '.join(CHOICES)}: unset it (shared memory where "
                             "it is safe) or set one of them")
        return value
    return "shared_memory" if platform.machine().lower() in ("x86_64", "amd64") else "gloo"


class SharedSlots:
    """One rank's view of the mapping: the flags, the slots, and the number of calls made so far."""

    def __init__(self, path: Path, rank: int, world: int):
        self.rank, self.world, self.calls = rank, world, 0
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, mapping_bytes(world))
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self._map, dtype=np.int64, count=world * FLAG_STRIDE // 8)[::FLAG_STRIDE // 8]
        raw = torch.frombuffer(self._map, dtype=torch.uint8, offset=header_bytes(world))
        self.slots = raw.view(2, world, SLOT_BYTES)

    def exchange(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape and dtype on each), in rank order; None if it is larger than a slot."""
        x = x.contiguous()
        size = x.numel() * x.element_size()
        if size > SLOT_BYTES:
            return None
        self.calls += 1
        parity = self.calls % 2
        self.slots[parity, self.rank, :size].copy_(x.view(-1).view(torch.uint8))
        self.flags[self.rank] = self.calls  # after the part: x86-64 makes stores visible in program order
        self._wait_for(self.calls)
        return [self.slots[parity, r, :size].view(x.dtype).view(x.shape) for r in range(self.world)]

    def _wait_for(self, call: int) -> None:
        checks = 0
        while int(self.flags.min()) < call:
            checks += 1
            if checks < SPIN_CHECKS:
                continue
            if checks < SPIN_CHECKS + YIELD_CHECKS:
                os.sched_yield()
            else:
                time.sleep(NAP_S)


_slots: SharedSlots | None = None


def header_bytes(world: int) -> int:
    return max(mmap.PAGESIZE, world * FLAG_STRIDE)


def mapping_bytes(world: int) -> int:
    return header_bytes(world) + 2 * world * SLOT_BYTES


def attach(rank: int, world: int, rendezvous: str) -> None:
    """Map this group's slots (every rank process, after ``init_process_group``; ``rendezvous`` is the group's
    unique init file). Rank 0 creates the file; it is unlinked once every rank has it mapped."""
    import torch.distributed as dist

    global _slots
    path = _slots_path(rendezvous, mapping_bytes(world))
    if rank == 0:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, mapping_bytes(world))  # ENOSPC now, not SIGBUS on a later write
            finally:
                os.close(fd)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise BuildError(f"no room for the ranks' shared collectives ({mapping_bytes(world) >> 20} MiB) at "
                             f"{path}: {exc.strerror}. Free some space there, or set {ENV}=gloo") from exc
    dist.barrier()
    _slots = SharedSlots(path, rank, world)
    dist.barrier()
    if rank == 0:
        path.unlink()


def _slots_path(rendezvous: str, size: int) -> Path:
    """Under /dev/shm (memory, no writeback) when it has room for several such groups; else beside the rendezvous
    file. The name is the rendezvous folder's (unique per group)."""
    name = f"{Path(rendezvous).parent.name}-collectives"
    shm = Path("/dev/shm")
    try:
        stat = os.statvfs(shm)
        if os.access(shm, os.W_OK) and stat.f_bavail * stat.f_frsize >= 4 * size:
            return shm / name
    except OSError:
        pass
    return Path(rendezvous).parent / name


def _parts(x: torch.Tensor) -> list[torch.Tensor] | None:
    if _slots is None:
        raise RuntimeError("pipeline_cpu collectives called in a process that did not attach() its group")
    return _slots.exchange(x)


def _world_group() -> str:
    """The gloo group the rank graphs' own collectives name: the process's default group (cpu.py checks its name)."""
    import torch.distributed as dist

    return dist.group.WORLD.group_name


def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    parts = _parts(x)
    if parts is None:  # larger than a slot: gloo's, on every rank alike (the traced graph's own collective)
        return parallel.all_reduce_sum(x, _world_group())
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


def _all_gather_dim0(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = _parts(x)
    if parts is None:
        return parallel.all_gather_dim0(x, world, _world_group())
    return torch.cat(parts, dim=0)


_LIBRARY.impl("all_reduce_sum", _all_reduce_sum, "CPU")
_LIBRARY.impl("all_gather_dim0", _all_gather_dim0, "CPU")


def rewrite_rank(module: torch.jit.ScriptModule, entries) -> int:
    """Route every collective of ``entries``' graphs through the shared slots (before their first call). Returns how
    many collectives were rewritten; refuses a graph left with one of gloo's (a collective this module does not know
    would still wait on gloo, and validation.json's ``rank_collectives`` would not say so)."""
    rewritten = 0
    for entry in entries:
        graph = getattr(module, entry).graph
        torch._C._jit_pass_inline(graph)  # the collectives live in the linear layers' methods
        ops = {node.inputsAt(1).toIValue() for node in graph.nodes() if node.kind() == "_c10d_functional::all_reduce"}
        if ops - {"sum"}:
            raise RuntimeError(f"rank graph {entry!r} all-reduces by {sorted(ops - {'sum'})}: the shared-memory route "
                               f"sums only; run it with {ENV}=gloo")
        before = _count(graph, "_c10d_functional::wait_tensor")
        for pattern, replacement in REWRITES:
            torch._C._jit_pass_custom_pattern_based_rewrite_graph(pattern, replacement, graph)
        left = _count(graph, "_c10d_functional::")
        if left:
            raise RuntimeError(f"rank graph {entry!r} keeps {left} collective op(s) the shared-memory route does not "
                               f"know; run it with {ENV}=gloo")
        rewritten += before
    return rewritten


def _count(graph, prefix: str) -> int:
    return sum(1 for node in graph.nodes() if node.kind().startswith(prefix))
