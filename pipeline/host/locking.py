"""Locks that let several runs share one ``artifacts_dir``: a second run of a stage waits for the first, then finds
its outputs fresh (by fingerprint) and skips.

One lock per unit of output: ``toolchain``, ``<model>`` (the model and reference stages), ``<model>-<variant>``
(trace, package, validate and publish of one variant). They are ``flock`` locks (``filelock``): the kernel releases
a lock when its holder dies, however it dies, so a killed run never leaves a lock that blocks the next one; the lock
file it leaves behind is reused. While a run holds a lock, ``<lock>.owner`` names it (pid, host, command), so a
waiting run can say what it waits for; an ``.owner`` still naming someone when the lock is free was left by a killed
run, and the run that takes the lock says it reclaimed it.

Writes ``<artifacts_dir>/.locks/<name>.lock`` and ``.owner``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from pipeline.core.errors import PipelineError
from pipeline.core.log import log

LOCK_DIR = ".locks"
REPORT_AFTER_S = 1.0


def lock_path(root: Path, name: str) -> Path:
    return Path(root) / LOCK_DIR / f"{name}.lock"


def recorded_owner(path: Path) -> str:
    """What lock ``path``'s ``.owner`` file says ("" when empty or missing)."""
    try:
        return path.with_suffix(".owner").read_text().strip()
    except OSError:
        return ""


def owner_of(path: Path) -> str:
    return recorded_owner(path) or "another run"


@contextlib.contextmanager
def held(root: Path, name: str, timeout_s: float | None = None) -> Iterator[None]:
    """Hold lock ``name`` under ``root`` for the block; wait for it (forever, or ``timeout_s``) if another run has it.

    Raises ``PipelineError`` naming the holder when ``timeout_s`` passes first.
    """
    path = lock_path(root, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    started = time.monotonic()
    try:
        lock.acquire(timeout=REPORT_AFTER_S if timeout_s is None else min(REPORT_AFTER_S, timeout_s))
    except Timeout:
        log.info("waiting for %s, held by %s", name, owner_of(path))
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - started))
        try:
            lock.acquire(timeout=-1 if left is None else left)
        except Timeout:
            raise PipelineError(f"{name} is held by {owner_of(path)} for more than {timeout_s:.0f} s: wait for that "
                                "run to finish (or stop it); a killed run releases its locks by itself") from None
        log.info("got %s after %.1f s", name, time.monotonic() - started)
    left_by = recorded_owner(path)
    if left_by:
        # A holder clears .owner when it lets go; one that did not was killed. The kernel released its flock.
        log.warning("reclaimed lock %s from a run that ended without releasing it (%s)", name, left_by)
    owner = path.with_suffix(".owner")
    try:
        owner.write_text(f"pid {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)}\n")
        yield
    finally:
        with contextlib.suppress(OSError):
            owner.write_text("")
        lock.release()

