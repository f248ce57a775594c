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


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (``cpu.max``: a container
    given 4 CPUs of a 32-CPU host sees 32 in its mask but runs at 4's speed)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/self/cgroup") as f:
            group = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if group is not None:
            with open(os.path.join(cgroup_root, group.lstrip("/"), "cpu.max")) as f:
                quota, period = f.read().split()
            if quota != "max":
                count = min(count, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, count)


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
