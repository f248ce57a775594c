"""The cpu backend: the recipe traced with TorchScript, one process per rank, real gloo collectives.

Trace: ``tp_degree`` processes join a gloo group; each slices its own weights from the safetensors files, builds its
``StatefulRank``, traces the variant's entry points (``prefill`` and ``decode`` of one module, so they share weights
and caches) with ``torch.jit.trace_module``, zeroes the caches and saves ``tp_<rank>.pt``. The collectives run for
real during tracing, exactly as the neuron backend's ranks compile concurrently.

Load: ``tp_degree`` fresh processes join a new gloo group and ``torch.jit.load`` their rank; the parent sends each
step's inputs to every rank and reads rank 0's outputs. This is what proves the sharding recipe token for token
before anyone pays for an inf2 instance.

Writes: ``<out_dir>/tp_<rank>.pt`` for every rank, and nothing else.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import platform
import shutil
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import torch

from pipeline.artifact.archive import VerifiedBuild, require_verified
from pipeline.backends.base import RankRunner, TraceRequest, check_request, example_inputs
from pipeline.backends.torchscript import strip_debug_records
from pipeline.core.errors import BuildError, IntegrityError, PipelineError
from pipeline.core.fsutil import reporting_full_disk, sha256_file, staged_dir
from pipeline.core.log import relay_output
from pipeline.core.log import setup as setup_logging
from pipeline.core.shape import BuildShape, rank_members
from pipeline.host.procinfo import die_with_parent, peak_rss_bytes

# Collectives in a saved rank name their process group; every process group this backend creates is the default
# (WORLD) group, which torch names "0".
GROUP_NAME = "0"


# -- tensors over pipes (by value: torch's shared-memory reduction costs more than it saves for per-token inputs) --

def pack(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    t = t.detach().contiguous()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(torch.uint8).numpy().tobytes()


def unpack(packed: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    dtype, shape, data = packed
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


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

def _trace_rank(rank: int, request: TraceRequest, out_dir: str) -> dict:
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
    module = build_rank(spec, plan, Parallel(shape.tp_degree, GROUP_NAME), shape.kv_max, shape.torch_dtype, state)
    del state
    loaded = time.monotonic()
    examples = {"prefill": example_inputs(spec, shape.bucket), "decode": example_inputs(spec, 1)}
    with torch.no_grad():
        traced = torch.jit.trace_module(module, {e: examples[e] for e in shape.entries}, check_trace=False)
        for name, buf in traced.named_buffers():
            if "_cache_" in name:
                buf.zero_()  # tracing ran the examples through the caches
    path = Path(out_dir) / f"tp_{rank}.pt"
    # Through a Python file: saving to a path aborts the whole process (C++ terminate) when a write fails, where a
    # file object raises an OSError we can explain (a full disk, ulimit -f).
    with reporting_full_disk(path, f"trace: rank {rank}"):
        with open(path, "wb") as f:
            torch.jit.save(traced, f)
            f.flush()
            os.fsync(f.fileno())
        strip_debug_records(path)  # the same bytes from any checkout, environment or host
    return {
        "rank": rank,
        "load_s": round(loaded - started, 3),
        "trace_s": round(time.monotonic() - loaded, 3),
        "peak_rss_bytes": peak_rss_bytes(),
        "file": path.name,
        "size": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def _serve_rank(rank: int, build: VerifiedBuild, conn) -> None:
    # Loading TorchScript runs code: only files verified against the manifest, unchanged since (stat check).
    build.recheck()
    module = torch.jit.load(str(build.directory / f"tp_{rank}.pt"))
    caches = [buf for name, buf in module.named_buffers() if "_cache_" in name]
    gc.freeze()  # the loaded module is permanent: the per-step garbage collections need not walk it again

    def step(entry: str, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return getattr(module, entry)(*inputs)

    def seed(values: list[torch.Tensor]) -> None:
        for buf, value in zip(caches, values, strict=True):
            buf.copy_(value)

    def reset() -> None:
        for buf in caches:
            buf.zero_()

    serve_commands(conn, rank, step, seed, reset)


def serve_commands(conn, rank: int, step, seed, reset) -> None:
    """A loaded rank's side of the runner's protocol, until it says close: ``step(entry, inputs) -> (logits,
    token)``, ``seed(caches)``, ``reset()``. Rank 0 sends its outputs back; every rank its time inside the graph."""
    conn.send(("ready", {"rank": rank, "peak_rss_bytes": peak_rss_bytes()}))
    while True:
        command, payload = conn.recv()
        if command == "step":
            entry, packed = payload
            inputs = [unpack(p) for p in packed]
            started = time.perf_counter()
            logits, token = step(entry, inputs)
            elapsed = time.perf_counter() - started
            conn.send(("ok", (pack(logits), pack(token), elapsed) if rank == 0 else elapsed))
        elif command == "seed":
            seed([unpack(p) for p in payload])
            conn.send(("ok", None))
        elif command == "reset":
            reset()
            conn.send(("ok", None))
        elif command == "stats":
            conn.send(("ok", {"peak_rss_bytes": peak_rss_bytes()}))
        elif command == "close":
            conn.send(("ok", None))
            return


def _rank_main(rank: int, tp_degree: int, init_file: str, job: tuple, conn) -> None:
    die_with_parent(parent=mp.parent_process().pid)  # never outlive a parent killed with SIGKILL
    setup_logging()
    relay_output(f"pipeline.rank{rank}")  # gloo prints its connection lines on the command's standard output
    try:
        torch.set_num_threads(_threads_per_rank(tp_degree))
        _init_group(rank, tp_degree, init_file)
        if job[0] == "trace":
            conn.send(("ok", _trace_rank(rank, job[1], job[2])))
        else:
            _serve_rank(rank, job[1], conn)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        report_failure(conn, exc)
    finally:
        if tp_degree > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def report_failure(conn, exc: BaseException) -> None:
    """Send a rank's failure to the parent, which raises it. A PipelineError already says what to do (no traceback);
    the parent may be gone (interrupted): then no report."""
    report = str(exc)
    if not isinstance(exc, PipelineError):
        report = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    with contextlib.suppress(OSError):
        conn.send(("error", report))


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
    """``tp_degree`` spawned rank processes and a pipe to each. Any rank's failure stops them all.

    ``request`` (when tracing) carries the preflight's memory figures, quoted if a rank is killed. ``target`` is each
    process's main, called as ``target(rank, tp_degree, init_file, job, conn)``.
    """

    def __init__(self, tp_degree: int, job: tuple, request: TraceRequest | None = None, target=None):
        self.tp_degree = tp_degree
        self.request = request
        self._rendezvous = tempfile.mkdtemp(prefix="gemma4-gloo-")
        ctx = spawn_context()
        self.conns, self.procs = [], []
        for rank in range(tp_degree):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target or _rank_main, name=f"rank{rank}", daemon=True,
                               args=(rank, tp_degree, os.path.join(self._rendezvous, "init"), job, child))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def receive_all(self, timeout: float | None = None) -> list:
        """One reply from every rank, in rank order; raises ``BuildError`` naming the first rank that failed."""
        replies: dict[int, object] = {}
        closed: set[int] = set()  # ranks whose pipe reached EOF: only their exit status is left to read
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(replies) < self.tp_degree:
            pending = {self.conns[r]: r for r in range(self.tp_degree) if r not in replies and r not in closed}
            sentinels = {self.procs[r].sentinel: r for r in range(self.tp_degree) if r not in replies}
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending) + list(sentinels), timeout=left)
            if not ready:
                self.terminate()
                raise BuildError(f"ranks {sorted(pending.values())} did not answer within {timeout:.0f} s")
            for obj in ready:
                if obj in pending:
                    rank = pending[obj]
                    try:
                        status, payload = obj.recv()
                    except EOFError:
                        closed.add(rank)  # the process died; its sentinel reports how
                        continue
                    if status == "error":
                        self.terminate()
                        raise BuildError(f"rank {rank} failed: {payload}")
                    replies[rank] = payload
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
        return [replies[r] for r in range(self.tp_degree)]

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


def trace_in_processes(processes: int, request: TraceRequest, out_dir: Path, members: list[str],
                       target=None) -> list[dict]:
    """Run the trace job in ``processes`` spawned processes (``target``: their main) into a staging directory,
    renamed to ``out_dir`` only once every one succeeded and exactly ``members`` were written. Returns the rank
    records, in rank order (a process may report several ranks)."""
    with staged_dir(out_dir) as tmp:
        group = RankGroup(processes, ("trace", request, str(tmp)), request, target=target)
        try:
            replies = group.receive_all()
        except BaseException:
            group.terminate()  # at once: an interrupted or failed trace must not wait for its ranks
            raise
        group.join()
        found = sorted(p.name for p in tmp.iterdir())
        if found != sorted(members):
            raise BuildError(f"trace wrote {found}, expected exactly {members}")
    return [rank for reply in replies for rank in (reply if isinstance(reply, list) else [reply])]


def trace_record(ranks: list[dict], shape: BuildShape, started: float) -> dict:
    """The part of build.json's ``trace`` every per-rank backend writes."""
    return {
        "members": [{"path": r["file"], "size": r["size"], "sha256": r["sha256"]} for r in ranks],
        "layout": "per_rank",
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "ranks": ranks,
        "wall_s": round(time.monotonic() - started, 3),
        "entries": list(shape.entries),
    }


# -- the backend --------------------------------------------------------------------------------------------------

class CpuBackend:
    name = "cpu"

    def members(self, shape: BuildShape) -> list[str]:
        return rank_members(shape.tp_degree)

    def compiler_id(self, toolchain: dict) -> str:
        version = str(toolchain.get("packages", {}).get("torch", {}).get("version") or torch.__version__)
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

    def trace(self, request: TraceRequest, out_dir: Path) -> dict:
        check_request(request)
        started = time.monotonic()
        ranks = trace_in_processes(request.shape.tp_degree, request, Path(out_dir), self.members(request.shape))
        return trace_record(ranks, request.shape, started) | {"group_name": GROUP_NAME, **self.compiler_info()}

    def load(self, build: VerifiedBuild, shape: BuildShape) -> CpuRunner:
        return CpuRunner(require_verified(build), shape)


class CpuRunner(RankRunner):
    """Rank processes driven over pipes. ``target`` and ``job`` are another backend's process main and its job (the
    xla backend's one process speaks the same commands)."""

    def __init__(self, build: VerifiedBuild, shape: BuildShape, target=None, job: tuple | None = None):
        self.shape = shape
        started = time.monotonic()
        if sorted(m["path"] for m in build.members) != sorted(rank_members(shape.tp_degree)):
            raise IntegrityError(f"{build.directory} holds {[m['path'] for m in build.members]}, a tp_degree "
                                 f"{shape.tp_degree} build needs {rank_members(shape.tp_degree)}")
        self.group = RankGroup(shape.tp_degree, job or ("serve", build), target=target)
        self.ready = self.group.receive_all(timeout=600)
        self.load_s = time.monotonic() - started
        self.compute_s: list[float] = []  # rank 0's time inside the graph, per call

    def _step(self, entry: str, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.group.send_all(("step", (entry, [pack(t) for t in inputs])))
        replies = self.group.receive_all()
        logits, token, elapsed = replies[0]
        self.compute_s.append(elapsed)
        return unpack(logits), unpack(token)

    def prefill(self, embeds, per_layer_tokens, positions, last_index):
        if "prefill" not in self.shape.entries:
            raise RuntimeError("this build decodes only (prefill=host): seed the KV with seed_kv instead")
        return self._step("prefill", embeds, per_layer_tokens, positions, last_index)

    def decode(self, embeds, per_layer_tokens, positions, last_index):
        return self._step("decode", embeds, per_layer_tokens, positions, last_index)

    def seed_kv(self, per_rank: list[list[torch.Tensor]]) -> None:
        for conn, caches in zip(self.group.conns, per_rank, strict=True):
            conn.send(("seed", [pack(t) for t in caches]))
        self.group.receive_all()

    def reset(self) -> None:
        self.group.send_all(("reset", None))
        self.group.receive_all()

    def peak_rss_bytes(self) -> list[int]:
        self.group.send_all(("stats", None))
        return [r["peak_rss_bytes"] for r in self.group.receive_all()]

    def close(self) -> None:
        try:
            self.group.send_all(("close", None))
            self.group.receive_all(timeout=30)
        except (BuildError, OSError):
            pass
        self.group.join()

    def __enter__(self) -> CpuRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
