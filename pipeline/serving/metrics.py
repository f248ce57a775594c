"""``/metrics`` in Prometheus' text format: requests by route and status (counted by ``CountRequests``, an ASGI
middleware), time to first token and per-token latency histograms, tokens generated, the queue's depth, the cache lines
(sequences decoded at once) and how many are in use, and each decode step's occupancy. Its own module so that every
metric the server exports is named in one place.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self, lines: int = 1) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("serve_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.ttft = Histogram("serve_time_to_first_token_seconds",
                              "From a generation request's arrival to its first token (queue wait included)",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                              registry=self.registry)
        self.token_latency = Histogram("serve_token_latency_seconds", "Each decode step after the first token",
                                       buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1),
                                       registry=self.registry)
        self.tokens = Counter("serve_tokens_generated", "Tokens generated", registry=self.registry)
        self.queue_depth = Gauge("serve_queue_depth", "Requests waiting for a cache line", registry=self.registry)
        self.slots = Gauge("serve_batch_slots", "Sequences the build decodes at once (its batch_size)",
                           registry=self.registry)
        self.slots.set(lines)
        self.slots_in_use = Gauge("serve_batch_slots_in_use", "Cache lines holding a sequence (prefilling or "
                                  "decoding)", registry=self.registry)
        self.occupancy = Histogram("serve_batch_occupancy", "Sequences in each decode step",
                                   buckets=tuple(range(1, lines + 1)), registry=self.registry)


class CountRequests:
    """ASGI middleware: counts each answered request by route and status. A plain ASGI one, not Starlette's
    ``BaseHTTPMiddleware``, which hands the route a wrapped ``receive`` on which a client's disconnect never shows
    (a queued request whose client left would then decode in full)."""

    def __init__(self, app, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}  # what the server answers for an exception that escapes the app

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")  # set by the router; None for a path no route matches
            self.counter.labels(route.path if route else "unknown", str(status["code"])).inc()
