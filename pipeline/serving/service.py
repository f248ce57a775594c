"""What runs a decode: ``Service``, the server's state (loading, ready, failed, closing: SIGTERM refuses new and waiting
requests with 503 while the running one finishes), one request decoding at a time in one worker thread (a client that
disconnects stops it before its next token), greedy unless it samples (on the host: pipeline/serving/sampling.py), and a
reply's ``n`` choices and prompts decoded one after another, each its own turn in the queue. Apart from routes.py: how
a request is decoded, not the shape of its answer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from fastapi import Request

from pipeline.core.errors import InputError
from pipeline.core.log import log
from pipeline.serving.admission import Admission
from pipeline.serving.engine import Engine, Finish, Piece, RanksFailed
from pipeline.serving.metrics import Metrics
from pipeline.serving.sampling import SEED_MAX, Sampler, SamplingParams, TokenLogprob
from pipeline.serving.schemas import Refused
from pipeline.validation.generation import new_tokens_problem


@dataclass
class Outcome:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    decode_s: float
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Service:
    """The app's state: the engine (``None`` until loaded), its readiness, the queue and the metrics."""

    def __init__(self, engine: Engine, queue_size: int, queue_timeout_s: float,
                 max_request_bytes: int, body_timeout_s: float):
        self.engine = engine
        self.body_timeout_s = body_timeout_s
        self.metrics = Metrics()
        self.admission: Admission | None = None  # made by open()
        self.queue_size, self.queue_timeout_s = queue_size, queue_timeout_s
        self.max_request_bytes = max_request_bytes
        self.state = "loading"  # loading, ready, failed, closing
        self.problem = ""
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        # Prompts are tokenized here, off the event loop (so /health answers meanwhile), one at a time (so that many
        # large prompts at once cost one prompt's memory, not many).
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def open(self) -> None:
        """On the server's event loop, before the first request (asyncio's lock and event belong to one loop)."""
        self.admission = Admission(self.queue_size, self.queue_timeout_s, self.metrics.queue_depth)

    def ready(self) -> None:
        if self.state == "loading":  # not if a shutdown began meanwhile
            self.state = "ready"
            log.info("serve: %s is ready", self.engine.version)

    def shutdown(self) -> None:
        """After the server stopped: wait for the worker (the running request's last token), unload the build."""
        self.worker.shutdown(wait=True)
        self.tokenizing.shutdown(wait=True)
        self.engine.close()

    def close(self) -> None:
        """Refuse new and waiting requests; the running one finishes."""
        self.state = "closing" if self.state != "failed" else self.state
        if self.admission:
            self.admission.close()

    def require_ready(self, model: str | None) -> Engine:
        if self.state == "loading":
            raise Refused(503, "the build is still loading; retry once GET /health says ready", retry_after_s=5)
        if self.state != "ready":
            raise Refused(503, f"the server is {self.state}" + (f": {self.problem}" if self.problem else ""),
                          retry_after_s=5)
        if model is not None and model != self.engine.version:
            raise Refused(404, f"model {model!r} is not served here; this server serves {self.engine.version!r} "
                               "(GET /v1/models)", "model", "model_not_found")
        return self.engine

    async def ids(self, texts: list[str], make: Callable[[], list[int]], what: str) -> list[int]:
        """The token ids ``make()`` computes from ``texts``, in the tokenizing thread. A text too long to fit the
        build's cache whatever it tokenizes to is refused first, without tokenizing it (``Engine.max_prompt_chars``);
        a chat template's own refusal (roles out of order...) is a 400 naming ``what``."""
        chars = sum(len(t) for t in texts)
        if chars > self.engine.max_prompt_chars:
            raise Refused(400, f"the {what} is {chars} characters: more than this build's cache of "
                               f"{self.engine.shape.kv_max} tokens (variant.kv_max) can hold (at most "
                               f"{self.engine.max_prompt_chars} characters could fit): shorten it", what)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenizing, make)
        except Exception as exc:  # noqa: BLE001 - the tokenizer's or the chat template's refusal of this input
            raise Refused(400, f"the {what} cannot be tokenized: {exc}", what) from None

    def prepare(self, ids: list[int], max_tokens: int | None, what: str, max_field: str = "max_tokens") -> int:
        """The number of new tokens to decode for a prompt of ``ids``; refuses one the cache cannot hold (the rule
        ``generate`` follows too: validation/generation.py ``new_tokens_problem``)."""
        problem = new_tokens_problem(len(ids), max_tokens, self.engine.shape.kv_max, max_field)
        if problem:
            raise Refused(400, problem, what if self.engine.room(len(ids)) < 1 else max_field)
        return max_tokens if max_tokens is not None else self.engine.room(len(ids))

    async def start(self, request: Request, ids: list[int], max_tokens: int, stops: tuple[str, ...],
                    arrived: float, sampling: SamplingParams | None = None,
                    stop_ids: tuple[int, ...] = ()) -> Decoding:
        """Wait for the turn, then start decoding in the worker thread. The turn is released when the worker is
        done, whether or not anyone reads its pieces (a client gone before its stream began included): the worker
        stops at its next token once the client disconnects."""
        await self.admission.enter()
        loop = asyncio.get_running_loop()
        decoding = Decoding(self, arrived)

        def produce() -> None:
            try:
                sampler = Sampler(sampling, ids) if sampling is not None else None
                for item in self.engine.decode(ids, max_tokens, stops, decoding.cancel, sampler, stop_ids):
                    if isinstance(item, Piece):
                        self.metrics.tokens.inc()  # what the build decoded, read by the client or not
                    loop.call_soon_threadsafe(decoding.pieces.put_nowait, item)
            except BaseException as exc:  # noqa: BLE001 - handed to the request, which answers 500
                loop.call_soon_threadsafe(decoding.pieces.put_nowait, exc)

        try:
            job = loop.run_in_executor(self.worker, produce)
        except BaseException:
            self.admission.leave()
            raise

        def done(_) -> None:
            decoding.cancel.set()  # ends the disconnect watcher
            self.admission.leave()

        job.add_done_callback(done)
        asyncio.ensure_future(watch_disconnect(request, decoding.cancel))
        return decoding

    def failed(self, exc: BaseException) -> None:
        """A decode raised ``exc``: the server stops taking requests when the ranks failed; any other error was the
        request's own (logged with its traceback, for the operator) and the next request is served."""
        if isinstance(exc, RanksFailed):
            self.state, self.problem = "failed", f"{type(exc).__name__}: {exc}"
            log.error("serve: the build's ranks failed, the server stops taking requests: %s", self.problem)
        elif not isinstance(exc, InputError):
            log.error("serve: one request failed (the server goes on): %s: %s", type(exc).__name__, exc,
                      exc_info=exc)

    async def complete(self, request: Request, ids: list[int], max_tokens: int, stops: tuple[str, ...],
                       arrived: float, sampling: SamplingParams | None = None,
                       stop_ids: tuple[int, ...] = ()) -> Outcome:
        decoding = await self.start(request, ids, max_tokens, stops, arrived, sampling, stop_ids)
        text, reason, count, ttft, decode_s, logprobs = [], "length", 0, None, 0.0, []
        async for item in decoding.items():
            if isinstance(item, Piece):
                text.append(item.text)
                if item.logprob is not None:
                    logprobs.append(item.logprob)
                if ttft is None:
                    ttft = item.seconds
                else:
                    decode_s += item.seconds
            else:
                text.append(item.text)
                reason, count = item.reason, item.completion_tokens
        return Outcome("".join(text), reason, len(ids), count, ttft, decode_s, logprobs)


class Decoding:
    """One request's decode: the pieces the worker thread hands over, and the event that stops it."""

    def __init__(self, service: Service, arrived: float):
        self.service, self.arrived = service, arrived
        self.pieces: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()

    async def items(self) -> AsyncIterator[Piece | Finish]:
        """The pieces as they come, then the ``Finish``. A failure of the worker is a 500 for this request; only the
        ranks' failing (``RanksFailed``) fails the server for every request."""
        metrics, first = self.service.metrics, True
        try:
            while True:
                item = await self.pieces.get()
                if isinstance(item, BaseException):
                    self.service.failed(item)
                    raise Refused(500, f"decoding failed: {type(item).__name__}: {item}")
                if isinstance(item, Piece):
                    if first:
                        metrics.ttft.observe(time.perf_counter() - self.arrived)
                        first = False
                    else:
                        metrics.token_latency.observe(item.seconds)
                yield item
                if isinstance(item, Finish):
                    return
        finally:
            self.cancel.set()  # the answer is complete, or its reader went away: the worker stops


async def watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client disconnects."""
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(0.05)


# -- a reply's choices ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Choice:
    """One choice of a reply: its index, its prompt's ids and token budget, its sampling. ``n`` choices and a list
    of prompts are decoded one after another (the graphs are batch 1), choice ``prompt * n + j`` as OpenAI orders
    them; with a seed, choice ``j`` samples with ``seed + j`` so that the choices differ and each is reproducible."""

    index: int
    ids: list[int]
    max_tokens: int
    sampling: SamplingParams | None


def choices_of(prompts: list[tuple[list[int], int]], n: int, sampling: SamplingParams | None) -> list[Choice]:
    def nth(j: int) -> SamplingParams | None:
        if sampling is None or sampling.seed is None or j == 0:
            return sampling
        seed = sampling.seed + j
        return replace(sampling, seed=seed if seed <= SEED_MAX else sampling.seed - j)

    return [Choice(p * n + j, ids, max_tokens, nth(j)) for p, (ids, max_tokens) in enumerate(prompts)
            for j in range(n)]


async def complete_all(service: Service, request: Request, choices: list[Choice], stops: tuple[str, ...],
                       arrived: float, stop_ids: tuple[int, ...]) -> list[Outcome]:
    outs = []
    for choice in choices:
        outs.append(await service.complete(request, choice.ids, choice.max_tokens, stops, arrived, choice.sampling,
                                           stop_ids))
    return outs


def prompt_tokens(choices: list[Choice]) -> int:
    """Each prompt's tokens once, however many choices it has."""
    return sum({id(c.ids): len(c.ids) for c in choices}.values())


def usage_of(choices: list[Choice], outs: list[Outcome]) -> dict:
    return usage(prompt_tokens(choices), sum(o.completion_tokens for o in outs))


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
