"""Admission to the one decode at a time (the graphs are batch 1): ``Admission`` holds the other requests in a bounded
FIFO queue, past ``queue_size`` waiting a 429 at once, past ``queue_timeout_s`` of waiting a 503, both with
``Retry-After``. Its own module: the queue's bookkeeping is subtle (the class says why) and needs nothing of the
service but the gauge it keeps current.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Gauge

from pipeline.serving.schemas import Refused


class Admission:
    """One request decodes at a time; at most ``queue_size`` wait, each at most ``queue_timeout_s`` (FIFO: asyncio's
    lock wakes its waiters in order).

    The bound is counted here, synchronously, not read from the lock: ``Lock.locked()`` is False between one
    holder's release and the next waiter's wake-up, and before a first request's acquire has run, so requests
    arriving in those moments would all pass a ``locked()`` check (CI saw five waiting behind a bound of two)."""

    def __init__(self, queue_size: int, queue_timeout_s: float, depth: Gauge):
        self.queue_size, self.queue_timeout_s, self.depth = queue_size, queue_timeout_s, depth
        self._turn = asyncio.Lock()
        self._closed = asyncio.Event()
        self.admitted = 0  # the request decoding (or about to) plus those waiting behind it

    @property
    def waiting(self) -> int:
        return max(0, self.admitted - 1)

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def enter(self) -> None:
        """Return holding the turn, or raise ``Refused`` (queue full: 429; waited too long, or closing: 503)."""
        if self.closed:
            raise Refused(503, "the server is shutting down", retry_after_s=5)
        if self.admitted > self.queue_size:  # one decoding and queue_size waiting
            raise Refused(429, f"{self.waiting} requests are already waiting (the queue holds {self.queue_size}); "
                               "retry later", retry_after_s=max(1, round(self.queue_timeout_s / 4)))
        self._count(+1)
        acquire = asyncio.ensure_future(self._turn.acquire())
        closing = asyncio.ensure_future(self._closed.wait())
        try:
            await asyncio.wait({acquire, closing}, timeout=self.queue_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the request was cancelled while it waited (its client went away)
            self._give_back(acquire)
            raise
        finally:
            closing.cancel()
        if acquire.done() and not self.closed:
            return
        self._give_back(acquire)
        if self.closed:
            raise Refused(503, "the server is shutting down", retry_after_s=5)
        raise Refused(503, f"waited {self.queue_timeout_s:g} s for the requests ahead; retry later",
                      retry_after_s=max(1, round(self.queue_timeout_s / 4)))

    def leave(self) -> None:
        self._turn.release()
        self._count(-1)

    def _count(self, step: int) -> None:
        self.admitted += step
        self.depth.set(self.waiting)

    def _give_back(self, acquire: asyncio.Future) -> None:
        """Leave the queue; if the turn was granted meanwhile, pass it on (else nobody would ever run again)."""
        self._count(-1)
        if acquire.done():
            if not acquire.cancelled() and acquire.exception() is None:
                self._turn.release()
        else:
            acquire.cancel()  # asyncio's Lock.acquire, cancelled, wakes the next waiter itself if it was chosen
