"""``serve``'s connections, bounded: a slow or idle client cannot hold the server's file descriptors.

uvicorn (h11) keeps a connection open for as long as its client trickles the request's headers, and has no bound on
how many are open: 1,100 connections sending a header byte a second exhausted ``ulimit -n 1024``, and ``/health``
went unanswered for the whole attack while asyncio logged "Too many open files" for every refused accept. Here:

- at most ``max_connections`` are open. A new one past the bound closes the oldest connection that has no request
  in progress (idle between requests, still sending its headers, or still sending its body), so that a client that
  sends its request at once, ``/health`` among them, gets in; when every connection has a request in progress, the
  new one is closed at once. A body still arriving counts as no request in progress: 300 connections that sent their
  headers and then a byte of body a second held every place, and ``/health`` answered 1 probe of 483
  (bench/serve_slowloris.py --body). A new connection is closed as it is accepted when it would leave fewer than
  ``FD_RESERVE`` descriptors (``Listener``);
- a request's headers must arrive within ``header_timeout_s`` of its first byte (of the connection, for the first
  request): past it the connection is closed. (A request body has its own bound, api.BODY_TIMEOUT_S.)
- the same log line is written at most once per ``QUIET_S`` (``OncePer``), with a count of those left out.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.core.log import log

FD_RESERVE = 64  # descriptors kept for the process's own files (15 once a build is loaded: rank pipes, the log)
QUIET_S = 10.0


def fd_limit() -> int:
    """This process's file-descriptor limit, raised to the hard limit first (as Go's runtime and nginx do)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


class Connections:
    """The open connections, oldest first, and the bounds they are held to."""

    def __init__(self, max_connections: int, header_timeout_s: float):
        self.max_connections, self.header_timeout_s = max_connections, header_timeout_s
        self.open: dict[BoundedH11, None] = {}  # insertion order: the oldest first
        self.evicted = self.refused = self.timed_out = 0

    def admit(self, new: BoundedH11) -> bool:
        """Make room for ``new`` (closing the oldest connection with no request in progress); False when there is
        none to close, and ``new`` must be closed instead."""
        if len(self.open) >= self.max_connections:
            # Idle or still sending headers first; only then one still sending its body (a slow upload may be honest)
            idle = next((c for c in self.open if not c.in_request), None) or next(
                (c for c in self.open if not c.busy), None)
            if idle is None:
                self.refused += 1
                return False
            self.evicted += 1
            idle.drop()
        self.open[new] = None
        return True


class Listener(socket.socket):
    """The listening socket. A connection whose descriptor lands within ``FD_RESERVE`` of the limit is closed at once,
    before asyncio sees it: besides the open connections, a burst keeps hundreds of sockets on their way in (accepted,
    not yet handed to a protocol) or out (closed, released a loop turn later), and a process out of descriptors makes
    asyncio stop accepting for a second (``/health`` included) and log each refusal. The kernel gives the lowest free
    descriptor, so a new one's number is the count of those below it in use: an exact gauge, at no cost."""

    fd_ceiling: int = 1 << 30
    refused: int = 0

    def accept(self):
        conn, address = super().accept()
        if conn.fileno() >= self.fd_ceiling:
            self.refused += 1
            conn.close()
            raise ConnectionAbortedError  # asyncio's accept loop takes it as a connection gone before it was taken
        return conn, address


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol held to ``Connections``' bounds (``bounded_protocol`` binds one)."""

    connections_bound: Connections

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.header_deadline: asyncio.TimerHandle | None = None
        self.waiting_since: object = None
        if not self.connections_bound.admit(self):
            transport.abort()
            return
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections_bound.open.pop(self, None)
        self._stop_waiting()
        if self.transport is not None:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.in_request and self.header_deadline is None:
            self._await_headers()  # the first bytes of a next request on a kept-alive connection
        super().data_received(data)
        if self.in_request:
            self._stop_waiting()

    @property
    def in_request(self) -> bool:
        """Whether a request's headers have arrived and its answer is not complete."""
        cycle = getattr(self, "cycle", None)
        return cycle is not None and not cycle.response_complete

    @property
    def busy(self) -> bool:
        """Whether a request is in progress, which keeps its connection from being closed for a new one: in a
        request whose body has arrived whole (h11 is past SEND_BODY; the body's own bound is --body-timeout)."""
        return self.in_request and self.conn.their_state is not h11.SEND_BODY

    def drop(self) -> None:
        self.connections_bound.open.pop(self, None)  # counted out now: its connection_lost comes a loop turn later
        self._stop_waiting()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def _await_headers(self) -> None:
        self.waiting_since = getattr(self, "cycle", None)
        self.header_deadline = self.loop.call_later(self.connections_bound.header_timeout_s, self._headers_late)

    def _stop_waiting(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _headers_late(self) -> None:
        self.header_deadline = None
        if not self.in_request and getattr(self, "cycle", None) is self.waiting_since:  # no request began meanwhile
            self.connections_bound.timed_out += 1
            self.drop()


def bounded_protocol(listener: Listener, max_connections: int, header_timeout_s: float) -> type[BoundedH11]:
    """A protocol class for ``uvicorn.Config(http=...)`` holding the connections ``listener`` accepts to these bounds
    and to the process's file-descriptor limit."""
    limit = fd_limit()
    listener.fd_ceiling = max(32, limit - FD_RESERVE)
    # Half the descriptors for open connections, half for those on their way in or out: a new connection evicts an
    # idle one only once it is accepted, so a full house must leave room to accept.
    most = listener.fd_ceiling // 2
    if max_connections > most:
        log.warning("serve: --max-connections %d is more than ulimit -n %d allows (half of it, less the %d descriptors "
                    "this process keeps for itself): at most %d connections (raise ulimit -n for more)",
                    max_connections, limit, FD_RESERVE, most)
    bound = Connections(min(max_connections, most), header_timeout_s)
    return type("ServeH11", (BoundedH11,), {"connections_bound": bound})


class OncePer(logging.Filter):
    """Lets each distinct message through at most once per ``seconds``; the next one that passes says how many like
    it were left out. (A refused accept is logged by asyncio once per attempt: thousands a second.)"""

    def __init__(self, seconds: float = QUIET_S):
        super().__init__()
        self.seconds = seconds
        self.last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.msg}"
        now = time.monotonic()
        passed, left_out = self.last.get(key, (-self.seconds, 0))
        if now - passed < self.seconds:
            self.last[key] = (passed, left_out + 1)
            return False
        if left_out:
            record.msg = f"{record.msg} ({left_out} more like it in the last {now - passed:.0f} s left out)"
        self.last[key] = (now, 0)
        return True


class CancelledQuietly(logging.Filter):
    """uvicorn logs the request it cancels past ``timeout_graceful_shutdown`` (serve --shutdown-grace) as "Exception
    in ASGI application" with the CancelledError's traceback: an expected end, said in one line here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            record.msg, record.args, record.exc_info = (
                "serve: a request still running at the end of --shutdown-grace was cancelled", (), None)
        return True

