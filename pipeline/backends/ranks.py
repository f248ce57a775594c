"""The rank runtime: rank processes, the pipes to them, and the runner that drives a loaded build through them.

The backends that run their ranks in processes of their own use it as peers, each with its own process main: the cpu
backend (one process per rank, real gloo collectives) and the xla backend (one process holding every rank). A process
main is called as ``target(rank, processes, init_file, job, conn)``; ``job`` says what to do: a ``TraceJob`` (reply:
``Traced``, the records of the ranks it traced) or a ``ServeJob``, after which the process answers the runner's
commands (``serve_commands``: ``Step``, ``Seed``, ``Reset``, ``Stats``, ``Close``) until it is told to close. Every
message is a frozen dataclass of this module, whose type says what it is; a failure is ``Failed``.

Tensors cross the pipes by value (``PackedTensor``): torch's shared-memory reduction costs more than it saves for
per-token inputs. Any process's failure stops them all, and is raised in the parent naming the rank; a process the
kernel killed (SIGKILL, the out-of-memory killer) is reported with the preflight's memory figures.

Writes nothing itself: ``trace_in_processes`` renames the staging directory its processes wrote into place.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

import torch

from pipeline.artifact.archive import VerifiedBuild
from pipeline.backends.base import RankRunner, TraceRequest, graph_inputs
from pipeline.core.build_records import Member, TraceResult
from pipeline.core.errors import BuildError, IntegrityError, PipelineError
from pipeline.core.fsutil import staged_dir
from pipeline.core.records import encode
from pipeline.core.shape import BuildShape, rank_members
from pipeline.host.procinfo import peak_rss_bytes

# -- messages over the pipes (pickled: module-level, so the rank processes import them) ----------------------------

@dataclass(frozen=True)
class PackedTensor:
    """A tensor by value: its dtype's name, its shape and its bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor) -> PackedTensor:
        t = t.detach().contiguous()
        return cls(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(torch.uint8).numpy().tobytes())

    def tensor(self) -> torch.Tensor:
        flat = (torch.frombuffer(bytearray(self.data), dtype=torch.uint8) if self.data
                else torch.empty(0, dtype=torch.uint8))
        return flat.view(getattr(torch, self.dtype)).reshape(self.shape)


@dataclass(frozen=True)
class TraceJob:
    """Trace ``request``'s ranks into ``out_dir``; the process replies ``Traced``."""

    request: TraceRequest
    out_dir: str


@dataclass(frozen=True)
class ServeJob:
    """Load ``build``'s ranks and answer the runner's commands until ``Close``."""

    build: VerifiedBuild
    shape: BuildShape
    bf16_matmul: str = "native"
    """How the ranks run bf16 matmuls of many rows (pipeline/host/bf16_matmul.py), chosen by the loading process."""
    collectives: str | None = None
    """How the rank processes exchange their collectives (the cpu backend's: pipeline/backends/cpu_collectives.py),
    chosen by the loading process; None: the backend's own."""


@dataclass(frozen=True)
class TracedRank:
    """One rank a process traced: its file and its figures, recorded in build.json's ``trace.ranks`` (a backend's
    subclass adds its own)."""

    rank: int
    file: str
    size: int
    sha256: str
    peak_rss_bytes: int
    trace_s: float


@dataclass(frozen=True)
class Traced:
    """A trace process's reply: the ranks it traced (one, or every rank of the build)."""

    ranks: tuple[TracedRank, ...]


@dataclass(frozen=True)
class Step:
    """Run the entry point ``entry`` (``prefill`` or ``decode``) on ``inputs``; replies ``Stepped``."""

    entry: str
    inputs: tuple[PackedTensor, ...]


@dataclass(frozen=True)
class Stepped:
    """A step done: the rank's time inside the graph, and (rank 0 only) the logits and the greedy token."""

    seconds: float
    logits: PackedTensor | None = None
    token: PackedTensor | None = None


@dataclass(frozen=True)
class Seed:
    """Write these host-computed caches (one sequence's) into cache line ``line`` of the rank's KV state; replies
    ``Done``."""

    caches: tuple[PackedTensor, ...]
    line: int = 0


@dataclass(frozen=True)
class Reset:
    """Zero the rank's KV state; replies ``Done``."""


@dataclass(frozen=True)
class Stats:
    """Ask for the rank's figures; replies ``RankStats``."""


@dataclass(frozen=True)
class Close:
    """Stop answering; replies ``Done``, then the process ends."""


@dataclass(frozen=True)
class Done:
    """A command carried out."""


@dataclass(frozen=True)
class RankStats:
    """A rank's figures: sent once it is loaded (ready), and for ``Stats``."""

    rank: int
    peak_rss_bytes: int


@dataclass(frozen=True)
class Failed:
    """A process's failure, as the parent raises it."""

    report: str


# -- a rank process's side ------------------------------------------------------------------------------------------

def serve_commands(conn, rank: int, step, seed, reset) -> None:
    """A loaded rank's side of the runner's protocol, until it says ``Close``: ``step(entry, inputs) -> (logits,
    token)``, ``seed(caches, line)``, ``reset()``. Rank 0 sends its outputs back; every rank its time inside the
    graph."""
    conn.send(RankStats(rank, peak_rss_bytes()))
    while True:
        command = conn.recv()
        if isinstance(command, Step):
            inputs = [p.tensor() for p in command.inputs]
            started = time.perf_counter()
            logits, token = step(command.entry, inputs)
            elapsed = time.perf_counter() - started
            conn.send(Stepped(elapsed, PackedTensor.of(logits), PackedTensor.of(token)) if rank == 0 else
                      Stepped(elapsed))
        elif isinstance(command, Seed):
            seed([p.tensor() for p in command.caches], command.line)
            conn.send(Done())
        elif isinstance(command, Reset):
            reset()
            conn.send(Done())
        elif isinstance(command, Stats):
            conn.send(RankStats(rank, peak_rss_bytes()))
        elif isinstance(command, Close):
            conn.send(Done())
            return
        else:
            raise TypeError(f"rank {rank} was sent {command!r}, which is not a command of the rank runtime")


def report_failure(conn, exc: BaseException) -> None:
    """Send a rank's failure to the parent, which raises it. A PipelineError already says what to do (no traceback);
    the parent may be gone (interrupted): then no report."""
    report = str(exc)
    if not isinstance(exc, PipelineError):
        report = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with contextlib.suppress(OSError):
        conn.send(Failed(report))


# -- the parent's side ----------------------------------------------------------------------------------------------

def spawn_context():
    """multiprocessing's spawn context, made safe inside a launcher's worker (e.g. Hydra's joblib launcher).

    A spawned child re-applies its parent's *default* start method; a worker of joblib's loky backend has ``loky``
    as its default, which a fresh interpreter does not know. Resetting this process's default to ``spawn`` touches
    only this worker.
    """
    if mp.get_start_method(allow_none=True) not in mp.get_all_start_methods():
        mp.set_start_method("spawn", force=True)
    return mp.get_context("spawn")


class RankGroup:
    """``processes`` spawned processes running ``target`` and a pipe to each. Any process's failure stops them all.

    ``request`` (when tracing) carries the preflight's memory figures, quoted if a process is killed.
    """

    def __init__(self, processes: int, job: TraceJob | ServeJob, target, request: TraceRequest | None = None):
        self.processes = processes
        self.request = request
        self._rendezvous = tempfile.mkdtemp(prefix="gemma4-gloo-")
        ctx = spawn_context()
        self.conns, self.procs = [], []
        for rank in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, name=f"rank{rank}", daemon=True,
                               args=(rank, processes, os.path.join(self._rendezvous, "init"), job, child))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def receive_all(self, timeout: float | None = None) -> list:
        """One reply from every process, in rank order; raises ``BuildError`` naming the first rank that failed."""
        replies: dict[int, object] = {}
        closed: set[int] = set()  # ranks whose pipe reached EOF: only their exit status is left to read
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.processes:
            pending = {self.conns[r]: r for r in range(self.processes) if r not in replies and r not in closed}
            sentinels = {self.procs[r].sentinel: r for r in range(self.processes) if r not in replies}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending) + list(sentinels), timeout=left)
            if not ready:
                self.terminate()
                raise BuildError(f"ranks {sorted(pending.values())} did not answer within {timeout:.0f} s")
            for obj in ready:
                if obj in pending:
                    rank = pending[obj]
                    try:
                        reply = obj.recv()
                    except EOFError:
                        closed.add(rank)  # the process died; its sentinel reports how
                        continue
                    if isinstance(reply, Failed):
                        self.terminate()
                        raise BuildError(f"rank {rank} failed: {reply.report}")
                    replies[rank] = reply
                elif obj in sentinels:
                    rank = sentinels[obj]
                    # A dead rank's last message may still be in its pipe: read that first. (poll() is also true
                    # at EOF, hence the closed set: without it, a killed rank would be polled forever.)
                    if rank in replies or (rank not in closed and self.conns[rank].poll()):
                        continue
                    self.procs[rank].join(timeout=5)  # reap it, so the exit code is known
                    code = self.procs[rank].exitcode
                    self.terminate()
                    raise BuildError(describe_exit(rank, code, self.request))
        return [replies[r] for r in range(self.processes)]

    def send_all(self, message) -> None:
        for conn in self.conns:
            conn.send(message)

    def terminate(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def join(self) -> None:
        for proc in self.procs:
            proc.join(timeout=30)
        self.terminate()


def describe_exit(rank: int, code: int | None, request: TraceRequest | None = None) -> str:
    if code == -9:
        from pipeline.host.preflight import oom_message

        return oom_message(f"rank {rank}", request.host if request else None, request.need if request else None)
    return f"rank {rank} exited unexpectedly with code {code}"


# -- tracing in processes -------------------------------------------------------------------------------------------

def trace_in_processes(processes: int, request: TraceRequest, out_dir: Path, members: list[str],
                       target) -> list[TracedRank]:
    """Run the trace job in ``processes`` spawned processes (``target``: their main) into a staging directory,
    renamed to ``out_dir`` only once every one succeeded and exactly ``members`` were written. Returns the rank
    records, in rank order (a process may report several ranks)."""
    with staged_dir(out_dir) as tmp:
        group = RankGroup(processes, TraceJob(request, str(tmp)), target, request)
        try:
            replies = group.receive_all()
        except BaseException:
            group.terminate()  # at once: an interrupted or failed trace must not wait for its ranks
            raise
        group.join()
        found = sorted(p.name for p in tmp.iterdir())
        if found != sorted(members):
            raise BuildError(f"trace wrote {found}, expected exactly {members}")
    return [rank for reply in replies for rank in reply.ranks]


def trace_result(ranks: list[TracedRank], shape: BuildShape, started: float, account: dict) -> TraceResult:
    """What a backend whose processes each wrote ``tp_<rank>.pt`` traced: its rank records and its own ``account``
    (its compiler and versions)."""
    return TraceResult(
        members=tuple(Member(r.file, r.size, r.sha256) for r in ranks),
        layout="per_rank",
        peak_rss_bytes=max(r.peak_rss_bytes for r in ranks),
        details={"ranks": [encode(r) for r in ranks], "wall_s": round(time.monotonic() - started, 3),
                 "entries": list(shape.entries), **account},
    )


# -- a loaded build -------------------------------------------------------------------------------------------------

class ProcessRunner(RankRunner):
    """A loaded build whose ranks run in processes of their own (``target``: their main, given a ``ServeJob``), one
    per rank, driven over pipes."""

    def __init__(self, build: VerifiedBuild, shape: BuildShape, target, bf16_matmul: str = "native",
                 collectives: str | None = None):
        self.shape = shape
        started = time.monotonic()
        if sorted(m.path for m in build.members) != sorted(rank_members(shape.tp_degree)):
            raise IntegrityError(f"{build.directory} holds {[m.path for m in build.members]}, a tp_degree "
                                 f"{shape.tp_degree} build needs {rank_members(shape.tp_degree)}")
        self.bf16_matmul = bf16_matmul  # what the ranks do with it is their target's (the cpu backend's rewrites)
        self.collectives = collectives
        self.group = RankGroup(shape.tp_degree, ServeJob(build, shape, self.bf16_matmul, collectives), target)
        self.ready = self.group.receive_all(timeout=600)
        self.load_s = time.monotonic() - started
        self.compute_s: list[float] = []  # rank 0's time inside the graph, per call

    def _step(self, entry: str, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.group.send_all(Step(entry, tuple(PackedTensor.of(t) for t in inputs)))
        first = self.group.receive_all()[0]
        self.compute_s.append(first.seconds)
        return first.logits.tensor(), first.token.tensor()

    def prefill(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None):
        if "prefill" not in self.shape.entries:
            raise RuntimeError("this build decodes only (prefill=host): seed the KV with seed_kv instead")
        entry = self.shape.prefill_entry(embeds.shape[1])  # the graph of the call's bucket
        return self._step(entry, *graph_inputs(self.shape, embeds, per_layer_tokens, positions, last_index, seq_ids))

    def decode(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None):
        return self._step("decode", *graph_inputs(self.shape, embeds, per_layer_tokens, positions, last_index,
                                                  seq_ids))

    def seed_kv(self, per_rank: list[list[torch.Tensor]], line: int = 0) -> None:
        for conn, caches in zip(self.group.conns, per_rank, strict=True):
            conn.send(Seed(tuple(PackedTensor.of(t) for t in caches), line))
        self.group.receive_all()

    def reset(self) -> None:
        self.group.send_all(Reset())
        self.group.receive_all()

    def peak_rss_bytes(self) -> list[int]:
        self.group.send_all(Stats())
        return [r.peak_rss_bytes for r in self.group.receive_all()]

    def close(self) -> None:
        try:
            self.group.send_all(Close())
            self.group.receive_all(timeout=30)
        except (BuildError, OSError):
            pass
        self.group.join()

    def __enter__(self) -> ProcessRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
