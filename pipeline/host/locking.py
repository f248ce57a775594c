"""Locks that let several runs share one ``artifacts_dir``: a second run of a stage waits for the first, then finds
its outputs fresh (by fingerprint) and skips.

One lock per unit of output: ``toolchain``, ``<model>`` (the model and reference stages), ``<model>-<variant>``
(trace, package, validate and publish of one variant). They are ``flock`` locks: the kernel releases a lock when its
holder dies, however it dies, so a killed run never leaves a lock that blocks the next one; the lock file it leaves
behind is reused. While a run holds a lock, ``<lock>.owner`` names it (pid, host, command, escaped as a log line is),
so a waiting run can say what it waits for; an ``.owner`` still naming someone when the lock is free was left by a
killed run, and the run that takes the lock says it reclaimed it.

A lock's folder may be a shared one (``pull --dest /workspace``), so nothing here writes where another user points
it. The rule for a folder is the pull record's (pipeline/artifact/pulled.py, ``writable_by_others``): owned by this
user and writable by no one else but the user's private group. The folder holding the locks (``artifacts_dir``,
``--dest``) may also be sticky and owned by this user or root, as /tmp is: others may add names there but cannot
rename or remove this user's. Another is refused, naming the folder, before anything is made in it. The lock folder
itself must keep to the rule, and each lock and owner file is opened without following a link and used only when it
is a regular file of this user's with one name (not a link, a device, another user's file or a hard link to a file
elsewhere).

Writes ``<artifacts_dir>/.locks/<name>.lock`` and ``.owner``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.artifact.pulled import writable_by_others
from pipeline.core.errors import PipelineError
from pipeline.core.log import log
from pipeline.core.names import escaped

LOCK_DIR = ".locks"
REPORT_AFTER_S = 1.0
POLL_S = 0.05
OWNER_BYTES = 4096  # an owner line is a pid, a host and a command: what is read of one, at most


def changeable_by_others(path: Path, sticky_ok: bool = False) -> str | None:
    """Why another user could change what is in the folder or file ``path`` (None: no one but this user could).

    The pull record's rule; with ``sticky_ok``, a sticky folder of this user's or root's passes too."""
    if writable_by_others([path]) is None:
        return None
    st = path.stat()
    if sticky_ok and st.st_mode & stat.S_ISVTX and st.st_uid in (os.geteuid(), 0):
        return None
    return f"can be changed by another user (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"


def refuse_if_shared(path: Path, fix: str, sticky_ok: bool = False, error: type[PipelineError] = PipelineError) -> None:
    """Raise ``error`` naming ``path`` and ``fix`` when another user could change ``path``."""
    problem = changeable_by_others(path, sticky_ok)
    if problem:
        raise error(f"{path} {problem}: {fix}")


def lock_folder(root: Path) -> int:
    """A descriptor of ``root/.locks``, made if missing, once both folders are found to keep to the rule."""
    root.mkdir(mode=0o755, parents=True, exist_ok=True)  # the rule's mode whatever the umask (002 would break it)
    refuse_if_shared(root, "another user could plant links there that this run would write through. Use a folder "
                     f"only you can write (chmod go-w {root}, or one of your own), or make it sticky as /tmp is "
                     f"(chmod +t {root})", sticky_ok=True)
    folder = root / LOCK_DIR
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o755)  # whatever the umask: only this user may add files to it
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise PipelineError(f"{folder} is not a lock folder ({why}): remove it (a run makes it again)") from None
    try:
        refuse_if_shared(folder, f"remove it (a run makes it again, yours alone), or chmod go-w {folder}")
    except PipelineError:
        os.close(fd)
        raise
    return fd


def own_regular_file(st: os.stat_result) -> bool:
    """Whether an opened file is one this user may write without writing elsewhere: a regular file of this user's
    with one name (not a device, another user's file, or a hard link to a file somewhere else)."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1


def own_file(folder: int, name: str, where: Path, create: bool = True) -> int | None:
    """A descriptor of the file ``name`` in the lock folder ``folder`` (``where``), opened for reading and writing
    without following a link, and made if missing (None when it is missing and not ``create``)."""
    path = where / name
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(name, flags, 0o644, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise PipelineError(f"{path} cannot be used as a lock file ({why}): remove it (a run makes it again)") \
            from None
    # Checked on the descriptor, not the name: what is written is this file, whatever the name points at by now.
    st = os.fstat(fd)
    if own_regular_file(st):
        return fd
    os.close(fd)
    raise PipelineError(f"{path} cannot be used as a lock file (not a regular file of this user's with one name: "
                        f"owner uid {st.st_uid}, {st.st_nlink} names): remove it (a run makes it again)")


def take(fd: int, timeout_s: float | None) -> bool:
    """Whether the ``flock`` on ``fd`` was taken within ``timeout_s`` (None: as long as it takes)."""
    if timeout_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def recorded(fd: int) -> str:
    """What an owner file says ("" when empty)."""
    return os.pread(fd, OWNER_BYTES, 0).decode(errors="replace").strip()


def holder(folder: int, where: Path, name: str) -> str:
    """Who holds lock ``name``, as its owner file says."""
    fd = own_file(folder, f"{name}.owner", where, create=False)
    if fd is None:
        return "another run"
    try:
        return recorded(fd) or "another run"
    finally:
        os.close(fd)


def owner_line() -> str:
    # argv holds what the shell passed: a byte that is not UTF-8 is a lone surrogate (PEP 383), which no file can
    # hold. Escaped as the log escapes it, so any command line can be named.
    return f"pid {os.getpid()} on {socket.gethostname()}: {escaped(' '.join(sys.argv))}\n"


def claim(owner: int, name: str) -> None:
    """Write this run into the owner file ``owner`` of lock ``name``, just taken."""
    left_by = recorded(owner)
    if left_by:
        # A holder clears .owner when it lets go; one that did not was killed. The kernel released its flock.
        log.warning("reclaimed lock %s from a run that ended without releasing it (%s)", name, left_by)
    os.ftruncate(owner, 0)
    os.pwrite(owner, owner_line().encode(), 0)


def release(owner: int) -> None:
    with contextlib.suppress(OSError):
        os.ftruncate(owner, 0)


@contextlib.contextmanager
def held(root: Path, name: str, timeout_s: float | None = None) -> Iterator[None]:
    """Hold lock ``name`` under ``root`` for the block; wait for it (forever, or ``timeout_s``) if another run has it.

    Raises ``PipelineError`` naming the holder when ``timeout_s`` passes first, and naming the folder or file when
    ``root``, its lock folder or a lock's files are not this user's alone (the module's rule).
    """
    root = Path(root)
    where = root / LOCK_DIR
    with contextlib.ExitStack() as stack:
        folder = lock_folder(root)
        stack.callback(os.close, folder)
        lock = own_file(folder, f"{name}.lock", where)
        stack.callback(os.close, lock)  # closing it drops the flock
        started = time.monotonic()
        if not take(lock, REPORT_AFTER_S if timeout_s is None else min(REPORT_AFTER_S, timeout_s)):
            log.info("waiting for %s, held by %s", name, holder(folder, where, name))
            left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - started))
            if not take(lock, left):
                raise PipelineError(f"{name} is held by {holder(folder, where, name)} for more than {timeout_s:.0f} "
                                    "s: wait for that run to finish (or stop it); a killed run releases its locks by "
                                    "itself")
            log.info("got %s after %.1f s", name, time.monotonic() - started)
        owner = own_file(folder, f"{name}.owner", where)
        stack.callback(os.close, owner)
        claim(owner, name)
        stack.callback(release, owner)
        yield
