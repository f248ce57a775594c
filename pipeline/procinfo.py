"""What a process can tell about its own memory."""

from __future__ import annotations

import resource


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
