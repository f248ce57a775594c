"""NeuronCores for one neuron process at a time: which cores a compile, a validation or a ``generate`` may use.

Two facts make concurrent neuron work on one host fail unless it is coordinated:

- The Neuron runtime gives *every* NeuronCore of the host to the first process that initialises it, unless
  ``NEURON_RT_VISIBLE_CORES`` names a subset (Neuron runtime configuration guide); a second process then fails to
  allocate cores. ModelBuilder loads the weights onto the cores at the end of its trace, ``parallel_model_trace``'s
  rank processes initialise the runtime, and every load does.
- ``parallel_model_trace`` makes its ranks rendezvous on a fixed port: it sets ``MASTER_PORT=2022`` itself
  (neuronx-distributed v2.28.0 ``trace/trace.py``, ``parallel_model_trace``), so two host-prefill compiles on one host
  cannot run at once whatever their cores.

So every neuron process of this pipeline takes a **lease** first: ``tp_degree`` cores, each an ``flock`` on a file in
a host-wide directory (``GEMMA4_NEURON_LOCK_DIR``, default ``/tmp/gemma4-neuron-cores``: host-wide because two
checkouts on one host share its cores), held until the work ends; the kernel releases them when the holder dies,
however it dies. The process that does the work gets ``NEURON_RT_VISIBLE_CORES`` for exactly its cores. Cores are
chosen by ``backend.visible_cores`` (``"2-3"`` or ``"2,3"``) or, when unset, the first ``tp_degree`` contiguous free
ones. A host-prefill compile also holds the port lease, waiting for another one to finish.

A range the host does not have, or cores another lease holds, is refused before any work, naming the holder.

The folder is every user's (sticky, as /tmp): another user may have made any name in it, a link among them. So lease
and owner files are opened without following a link, and an owner file is written only when it is a regular file of
this user's with one name (a link or another user's file is left alone: the owner line is only a courtesy), its
command line escaped as the log escapes it (a byte of argv that is not UTF-8 cannot be written as it is).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.errors import ConfigError, PreflightError
from pipeline.core.log import log
from pipeline.core.names import escaped
from pipeline.core.units import format_cores, parse_cores, visible_cores_problems
from pipeline.host.locking import own_regular_file

LOCK_DIR_ENV = "GEMMA4_NEURON_LOCK_DIR"
DEFAULT_LOCK_DIR = "/tmp/gemma4-neuron-cores"
VISIBLE_CORES_ENV = "NEURON_RT_VISIBLE_CORES"
OWNER_BYTES = 4096  # what is read of an owner file, at most
TRACE_PORT = 2022  # parallel_model_trace's MASTER_PORT (neuronx-distributed v2.28.0 trace/trace.py)


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)


def _owner_file(lock: Path) -> Path:
    return lock.with_suffix(".owner")


def _describe_owner(lock: Path) -> str:
    try:
        fd = os.open(_owner_file(lock), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return "another process"
    try:
        said = os.read(fd, OWNER_BYTES).decode(errors="replace").strip() if stat.S_ISREG(os.fstat(fd).st_mode) else ""
    finally:
        os.close(fd)
    return escaped(said) or "another process"


def _open(path: Path) -> int:
    try:
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                path.parent.chmod(0o1777)  # host-wide: every user's runs lease from it, as /tmp is shared
        # an flock needs no write access; a link another user planted is not followed (ELOOP: refused below)
        return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except PermissionError:
        raise PreflightError(f"cannot use the NeuronCore lease {path}: another user made it; point "
                             f"{LOCK_DIR_ENV} at a directory every user of this host can write") from None
    except OSError as exc:  # a link (ELOOP) or a folder (EISDIR) another user made there, or the folder unusable
        why = "it is a symbolic link (another user's?)" if exc.errno == errno.ELOOP else exc.strerror
        raise PreflightError(f"cannot use the NeuronCore lease {path}: {why}; remove it, or point {LOCK_DIR_ENV} at "
                             "another directory") from None


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None when another process holds it."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _write_owner(lock: Path, text: str) -> None:
    """``text`` into ``lock``'s owner file when that is this user's own regular file (made if missing)."""
    with contextlib.suppress(OSError):
        fd = os.open(_owner_file(lock), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            if own_regular_file(os.fstat(fd)):
                os.ftruncate(fd, 0)
                os.write(fd, text.encode())
        finally:
            os.close(fd)


def _claim(path: Path, what: str) -> None:
    _write_owner(path, escaped(f"{what} (pid {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)})") + "\n")


def _release(path: Path, fd: int) -> None:
    _write_owner(path, "")
    os.close(fd)  # closing the descriptor drops the flock


@dataclass
class Lease:
    """Cores (and, for a host-prefill compile, the rendezvous port) held by this process until ``release``."""

    cores: list[int]
    held: list[tuple[Path, int]] = field(default_factory=list)

    @property
    def visible_cores(self) -> str:
        return format_cores(self.cores)

    def env(self) -> dict[str, str]:
        """What the process that uses the cores must have in its environment."""
        return {VISIBLE_CORES_ENV: self.visible_cores}

    def release(self) -> None:
        while self.held:
            _release(*self.held.pop())


def _core_lock(core: int) -> Path:
    return lock_dir() / f"nc{core}.lock"


def _take(cores: list[int], what: str) -> Lease | int:
    """A lease on exactly ``cores``, or the first of them another process holds."""
    lease = Lease(cores)
    for core in cores:
        fd = _try_lock(_core_lock(core))
        if fd is None:
            lease.release()
            return core
        lease.held.append((_core_lock(core), fd))
    for path, _fd in lease.held:
        _claim(path, what)
    return lease


def acquire(tp_degree: int, host_cores: int, spec: str | None, what: str,
            fix: str = "give this run other cores with backend.visible_cores=A-B") -> Lease:
    """Lease ``tp_degree`` cores (``spec`` or the first contiguous free ones) or refuse, naming who holds them."""
    problems = visible_cores_problems(spec, tp_degree, host_cores)
    if problems:
        raise ConfigError(problems)
    if tp_degree > host_cores:
        raise PreflightError(f"{what} needs {tp_degree} NeuronCores; this host has {host_cores} (neuron-ls): use an "
                             "instance with more NeuronCores, or a variant with a smaller tp_degree")
    candidates = [parse_cores(spec)] if spec else [list(range(s, s + tp_degree))
                                                   for s in range(0, host_cores - tp_degree + 1, tp_degree)]
    taken = []
    for cores in candidates:
        lease = _take(cores, what)
        if isinstance(lease, Lease):
            log.info("%s: NeuronCores %s (%s=%s)", what, lease.visible_cores, VISIBLE_CORES_ENV, lease.visible_cores)
            return lease
        taken.append(lease)
    holders = sorted({f"core {c}: {_describe_owner(_core_lock(c))}" for c in taken})
    asked = f"NeuronCores {spec}" if spec else f"{tp_degree} free NeuronCores of {host_cores}"
    raise PreflightError(f"{what} needs {asked}, but they are taken by: {'; '.join(holders)}. Wait for that work to "
                         f"finish, or {fix} (the scheduler shares cores out by itself)")


@contextlib.contextmanager
def leased(tp_degree: int, host_cores: int, spec: str | None, what: str) -> Iterator[Lease]:
    lease = acquire(tp_degree, host_cores, spec, what)
    try:
        yield lease
    finally:
        lease.release()


@contextlib.contextmanager
def trace_port(what: str) -> Iterator[None]:
    """Hold the host's ``parallel_model_trace`` rendezvous port; waits (saying for whom) while another compile has
    it, since the port cannot be chosen."""
    path = lock_dir() / f"port{TRACE_PORT}.lock"
    fd = _try_lock(path)
    if fd is None:
        log.info("%s: waiting for port %d, held by %s (parallel_model_trace always rendezvous on it)", what,
                 TRACE_PORT, _describe_owner(path))
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:  # interrupted while waiting
            os.close(fd)
            raise
    _claim(path, what)
    try:
        yield
    finally:
        _release(path, fd)
