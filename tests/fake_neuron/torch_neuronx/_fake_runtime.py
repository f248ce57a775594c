"""The stand-in's "device": NeuronCores a process holds, and the collectives a traced graph calls.

Registered when ``torch_neuronx`` is imported, as the real ops are (a file that calls them cannot be loaded before):

- ``neuron::fake_all_reduce(x, group, rank, world)`` and ``neuron::fake_all_gather(x, group, rank, world)`` (last
  dimension, rank order, as NxD's ``gather_from_tensor_model_parallel_region``). Three ways to run, picked per call:
  inside a ``parallel_model_trace`` rank process torch.distributed (gloo) is initialised and they are real
  collectives; while ModelBuilder traces ahead of time (``parallel_state`` in AOT mode, as the real one under
  ``mock_distributed``) they only produce the right shape; in a loaded model the ranks run as threads of one process
  (the real ``TensorParallelNeuronModel`` runs them in a thread pool) and exchange through memory. ``rank`` is a
  tensor: a constant in a per-rank graph, an input in ModelBuilder's SPMD graph (traced once for every rank, each
  call given its rank, as NxD's ``SPMDRank`` holds each rank's number as a weight of that rank).
- ``neuron::fake_claim_cores(model_id, start_rank, ranks)``: the runtime's core allocation. The real runtime gives a
  process every NeuronCore of the host unless ``NEURON_RT_VISIBLE_CORES`` names a subset, and a second process
  asking for cores in use fails (Neuron runtime configuration guide). Here a core is an ``flock`` on
  ``$FAKE_NEURON_DEVICE_DIR/ncN.lock`` held until the process exits.
- ``neuron::fake_is_initialized(model_id)``: whether this process loaded a ModelBuilder model's weights (the real
  state lives in ``torch.classes.neuron.SPMDModel`` objects, never in the saved file).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import tempfile
import threading
from pathlib import Path

import torch

_LIB = torch.library.Library("neuron", "FRAGMENT")
_LIB.define("fake_all_reduce(Tensor x, str group, Tensor rank, int world) -> Tensor")
_LIB.define("fake_all_gather(Tensor x, str group, Tensor rank, int world) -> Tensor")
_LIB.define("fake_claim_cores(str model_id, int start_rank, int ranks) -> int")
_LIB.define("fake_is_initialized(str model_id) -> bool")

EXCHANGE_TIMEOUT_S = 120.0
_aot = threading.local()


def set_aot(on: bool) -> None:
    """ModelBuilder's ahead-of-time trace: collectives produce shapes only (no peer is running)."""
    _aot.on = on


def _in_aot() -> bool:
    return getattr(_aot, "on", False)


class _Exchange:
    """The ranks of one loaded model meeting in memory, one collective at a time."""

    def __init__(self, world: int):
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=EXCHANGE_TIMEOUT_S)

    def gather(self, x: torch.Tensor, rank: int) -> list[torch.Tensor]:
        self.slots[rank] = x.detach().clone()
        self.barrier.wait()  # every rank has written
        parts = list(self.slots)
        self.barrier.wait()  # every rank has read: the slots may be reused
        return parts


_exchanges: dict[str, _Exchange] = {}
_exchanges_lock = threading.Lock()


def _exchange(group: str, world: int) -> _Exchange:
    with _exchanges_lock:
        if group not in _exchanges:
            _exchanges[group] = _Exchange(world)
        return _exchanges[group]


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _all_reduce(x: torch.Tensor, group: str, rank: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return x.clone()
    if _in_aot():
        return x.clone()
    if _dist_ready():
        import torch.distributed as dist

        out = x.clone()
        dist.all_reduce(out)
        return out
    parts = _exchange(group, world).gather(x, int(rank))
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _all_gather(x: torch.Tensor, group: str, rank: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return x.clone()
    if _in_aot():
        return torch.cat([x] * world, dim=-1)
    if _dist_ready():
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)
    return torch.cat(_exchange(group, world).gather(x, int(rank)), dim=-1)


# -- NeuronCores ---------------------------------------------------------------------------------------------------

_held: dict[int, int] = {}  # core -> fd holding its flock, for the life of the process
_initialized: set[str] = set()


def device_dir() -> Path:
    return Path(os.environ.get("FAKE_NEURON_DEVICE_DIR") or Path(tempfile.gettempdir()) / "fake-neuron-device")


def host_cores() -> int:
    return int(os.environ.get("FAKE_NEURON_CORES", "2"))


def visible_cores() -> list[int]:
    spec = os.environ.get("NEURON_RT_VISIBLE_CORES")
    if not spec:
        return list(range(host_cores()))  # the real runtime takes every core when none are named
    cores: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


def claim_cores(ranks: int, start_rank: int = 0) -> list[int]:
    """Hold this process's cores (once per process, as the runtime initialises once); refuse cores in use."""
    cores = visible_cores()
    if any(c >= host_cores() for c in cores):
        raise RuntimeError(f"NRT: NEURON_RT_VISIBLE_CORES={os.environ.get('NEURON_RT_VISIBLE_CORES')} names cores "
                           f"this instance does not have ({host_cores()} NeuronCores)")
    if len(cores) - start_rank < ranks:
        raise RuntimeError(f"NRT: {ranks} ranks from rank {start_rank} need more NeuronCores than the "
                           f"{len(cores)} visible to this process")
    device_dir().mkdir(parents=True, exist_ok=True)
    for core in cores:
        if core in _held:
            continue
        fd = os.open(device_dir() / f"nc{core}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"NRT: nrt_init: NeuronCore {core} is in use by another process; requested "
                               f"cores {cores} (set NEURON_RT_VISIBLE_CORES to use others)") from None
        _held[core] = fd
    return cores


def _claim_op(model_id: str, start_rank: int, ranks: int) -> int:
    claim_cores(ranks, start_rank)
    _initialized.add(model_id)
    return ranks


def _is_initialized(model_id: str) -> bool:
    return model_id in _initialized


_LIB.impl("fake_all_reduce", _all_reduce, "CompositeExplicitAutograd")
_LIB.impl("fake_all_gather", _all_gather, "CompositeExplicitAutograd")
_LIB.impl("fake_claim_cores", _claim_op, "CompositeExplicitAutograd")
_LIB.impl("fake_is_initialized", _is_initialized, "CompositeExplicitAutograd")


# -- the compiler process -------------------------------------------------------------------------------------------

LOG_FILE_DEFAULT_NAME = "log-neuron-cc.txt"  # neuronx-cc's --logfile default, relative to its working directory


def compile_graph(hlo: Path, neff: Path, flags, target: str = "inf2") -> list[str]:
    """What a neuronx-cc run does to its surroundings, for both trace paths; returns its command line.

    - It runs in the caller's working directory (libneuronxla and torch-neuronx pass no cwd: the only public copy of
      torch-neuronx's trace, 1.x, runs ``subprocess.run(command)``), which must still exist: a process whose working
      directory was deleted cannot resolve it (``os.getcwd()`` raises FileNotFoundError), and relative writes fail.
    - Its command is ``neuronx-cc compile <hlo> --framework XLA --target <target> --output <neff>`` then the given
      flags (the 1.x copy; NxD v2.28.0 model_builder.py passes ``platform_target`` apart from the flags, so the
      target is added below NxD), split like a shell (``shlex.split``) when it is one string.
    - The first line of its log is that command; the log goes to ``--logfile`` if given, else to
      ``log-neuron-cc.txt`` in the working directory. How a real log starts is not public (neuronx-cc is closed
      source; its docs say only that it logs there, compiler/neuronx-cc/api-reference-guide ``--logfile``): the line
      is this stand-in's guess, and ``FAKE_NEURON_LOG_HEAD=opaque`` writes a log without a command line, the case
      the pipeline must also get right (it reads the flags from ModelBuilder, not from the log).
    """
    import datetime

    cwd = os.getcwd()
    args = shlex.split(flags) if isinstance(flags, str) else list(flags or [])
    command = ["/opt/aws_neuronx_venv/bin/neuronx-cc", "compile", str(hlo), "--framework", "XLA", "--target", target,
               "--output", str(neff), *args]
    logfile = next((a.split("=", 1)[1] for a in args if a.startswith("--logfile=")), None)
    if logfile is None and "--logfile" in args:
        logfile = args[args.index("--logfile") + 1]
    log = Path(logfile) if logfile else Path(cwd) / LOG_FILE_DEFAULT_NAME
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        if os.environ.get("FAKE_NEURON_LOG_HEAD") == "opaque":
            out.write(f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}.000 INFO {os.getpid()} [Compiler]: compiling "
                      f"{Path(hlo).name}\n")
        else:
            out.write(f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S}.000 INFO {os.getpid()} [root]: "
                      f"{shlex.join(command)}\n")
    return command


DEFAULT_CACHE = "/var/tmp/neuron-compile-cache"  # the Neuron docs' default (neuron-caching.rst), without the variable


def compile_cached(graph: str, hlo: Path, neff: Path, flags: str) -> list[str] | None:
    """libneuronxla's ``neuron_xla_compile(..., use_cache=True)`` as ModelBuilder calls it for every bucket (NxD
    v2.28.0 model_builder.py ~603-624, hard-coded on): the entry is keyed on the graph and its flags with spaces
    removed (``get_hash_module``, ~93-101: the flags hold the absolute ``--logfile``, so a hit needs the same work
    folder path) under ``$NEURON_COMPILE_CACHE_URL``. On a hit the compiler does not run and writes no log (the Neuron
    docs' caching page: "Using a cached neff ... Exiting with a successfully compiled graph"); returns None then, else
    the command ``compile_graph`` ran. The entry holds ``compile_flags.json`` (a JSON list) and ``model.done``, as
    the cache's layout does."""
    key = hashlib.sha256((graph + flags.replace(" ", "")).encode()).hexdigest()[:20]
    entry = Path(os.environ.get("NEURON_COMPILE_CACHE_URL", DEFAULT_CACHE)) / "neuronxcc-fake" / f"MODULE_{key}"
    command = None
    if not (entry / "model.done").is_file():
        command = compile_graph(hlo, neff, flags)
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "compile_flags.json").write_text(json.dumps(shlex.split(flags)))
        (entry / "model.done").write_text("")
    # ModelBuilder writes the NEFF bytes it got back, compiled or cached, into the bucket's folder (v2.28.0
    # model_builder.py ~747-750, write_neff_to_file)
    Path(neff).parent.mkdir(parents=True, exist_ok=True)
    Path(neff).write_bytes(graph.encode())
    return command
