"""What a process can tell about its own memory, and how it ends with its parent."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys


def peak_rss_bytes() -> int:
    """This process's own peak resident set.

    ``VmHWM`` belongs to the current process image; ``ru_maxrss`` would carry the parent's peak across fork and
    exec (every rank and validation process here is started that way), so it is only the fallback.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; elsewhere nothing happens).

    A rank or compile process outlives a parent killed with SIGKILL otherwise, holding tens of GiB and writing into a
    staging directory nobody will rename. The signal comes when the parent *thread* that started this process exits:
    rank processes are started from the thread that waits for them. If the parent is already gone (it died before
    this call: its pid is not ``parent``, default the parent at the time of the call), ``sig`` comes at once.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
