"""Admission to the build's cache lines: how many requests may wait for one, and for how long. A request waits until
its first sequence takes a line (the decode engine's scheduler decides which, between decode steps:
pipeline/decoding/scheduler.py). At most ``queue_size`` requests wait beyond the lines free (past it: 429 at once),
each at most ``queue_timeout_s`` (past it: 503, its sequences given up); both with ``Retry-After``. Its own module:
the counts are kept here, on the event loop, from what the engine's thread reports (``line_taken``, ``line_freed``,
``started``), and need nothing of the service but the gauge they keep current.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Gauge

from pipeline.serving.schemas import Refused


class Ticket:
    """One request's place: waiting until ``started`` is set (its first sequence took a line)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()


class Admission:
    """The requests waiting for a line, and the lines in use, for a build of ``lines`` lines.

    A request is taken while fewer than ``queue_size`` plus the free lines are waiting: with every line in use, exactly
    ``queue_size`` may wait; with lines free, as many more as there are free lines, since those are about to start.
    The counts change synchronously on the event loop, so requests arriving together cannot all pass one check (CI
    once saw five waiting behind a bound of two, when a check read a lock's state instead of a count)."""

    def __init__(self, queue_size: int, queue_timeout_s: float, lines: int, depth: Gauge):
        self.queue_size, self.queue_timeout_s, self.lines, self.depth = queue_size, queue_timeout_s, lines, depth
        self.waiting: set[Ticket] = set()
        self.held = 0  # lines in use (prefilling or decoding)
        self._closed = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """Refuse new requests, and the waiting ones (503); those holding lines finish."""
        self._closed.set()

    def enter(self) -> Ticket:
        """A place in the queue, or ``Refused`` (429: the queue is full; 503: closing)."""
        if self.closed:
            raise Refused(503, "the server is shutting down", retry_after_s=5)
        free = max(0, self.lines - self.held)
        if len(self.waiting) >= self.queue_size + free:
            raise Refused(429, f"{len(self.waiting)} requests are already waiting for one of the {self.lines} "
                               f"sequences decoded at once (the queue holds {self.queue_size}); retry later",
                          retry_after_s=self._retry_after())
        ticket = Ticket()
        self.waiting.add(ticket)
        self._gauge()
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Return once ``ticket``'s request has a line; ``Refused`` (503) if it waited ``queue_timeout_s`` or the server
        began closing first. The ticket leaves the queue either way (and when the request is cancelled meanwhile)."""
        started = asyncio.ensure_future(ticket.started.wait())
        closing = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait({started, closing}, timeout=self.queue_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
            closing.cancel()
            self.leave(ticket)
        if ticket.started.is_set():
            return
        if self.closed:
            raise Refused(503, "the server is shutting down", retry_after_s=5)
        raise Refused(503, f"waited {self.queue_timeout_s:g} s for one of the {self.lines} sequences decoded at once; "
                           "retry later", retry_after_s=self._retry_after())

    def leave(self, ticket: Ticket) -> None:
        self.waiting.discard(ticket)
        self._gauge()

    # -- what the engine's thread reports (through the event loop) ---------------------------------------------------

    def started(self, ticket: Ticket) -> None:
        """``ticket``'s request took a line: it waits no longer, from now, not from when its handler next runs (until
        then it would count both in a line and in the queue, and refuse an arrival the bound lets in)."""
        ticket.started.set()
        self.leave(ticket)

    def line_taken(self) -> None:
        self.held += 1

    def line_freed(self) -> None:
        self.held = max(0, self.held - 1)

    def _gauge(self) -> None:
        self.depth.set(len(self.waiting))

    def _retry_after(self) -> int:
        return max(1, round(self.queue_timeout_s / 4))
