"""What runs a decode: ``Service``, the server's state (loading, ready, failed, closing: SIGTERM refuses new and waiting
requests with 503 while those holding cache lines finish), the decode loop in one thread of its own (the build's
``batch_size`` sequences at once: pipeline/decoding/), each request's sequences (its ``n`` choices and prompts, all
submitted at once, each in a line of its own as lines free), greedy unless it samples (on the host:
pipeline/serving/sampling.py), and a client that disconnects giving up every sequence of its request before their next
token. Apart from routes.py: how a request is decoded, not the shape of its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from fastapi import Request

from pipeline.core.errors import InputError
from pipeline.core.log import log
from pipeline.decoding.runner import RanksFailed
from pipeline.decoding.sequence import Finish as SequenceFinish
from pipeline.decoding.sequence import Sequence
from pipeline.serving.admission import Admission, Ticket
from pipeline.serving.engine import Engine, Finish, Piece
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
                 max_request_bytes: int, body_timeout_s: float, served_names: tuple[str, ...] = ()):
        self.engine = engine
        # What requests may call the build (``model``): the names given (vLLM's --served-model-name), then its
        # version, which is always accepted.
        self.names = tuple(dict.fromkeys([*served_names, engine.version]))
        self.body_timeout_s = body_timeout_s
        self.metrics = Metrics(engine.lines)
        engine.on_decode = self.metrics.occupancy.observe  # from the decode thread (Prometheus' metrics are safe)
        self.admission: Admission | None = None  # made by open()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.queue_size, self.queue_timeout_s = queue_size, queue_timeout_s
        self.max_request_bytes = max_request_bytes
        self.state = "loading"  # loading, ready, failed, closing
        self.problem = ""
        # Loads the build, then runs its decode loop: one thread for both, since a backend's rank processes end with
        # the thread that started them.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        # Prompts are tokenized here, off the event loop (so /health answers meanwhile), one at a time (so that many
        # large prompts at once cost one prompt's memory, not many).
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def open(self) -> None:
        """On the server's event loop, before the first request (asyncio's events belong to one loop)."""
        self.loop = asyncio.get_running_loop()
        self.admission = Admission(self.queue_size, self.queue_timeout_s, self.engine.lines, self.metrics.queue_depth)

    def ready(self) -> None:
        if self.state == "loading":  # not if a shutdown began meanwhile
            self.state = "ready"
            log.info("serve: %s is ready", self.engine.version)

    def decode_loop(self) -> None:
        """The decode thread's work once the build is loaded, until shutdown; a failure of the ranks ends it and the
        server stops taking requests."""
        try:
            self.engine.serve_forever()
        except RanksFailed as exc:
            self.post(self.failed, exc)

    def post(self, callback, *args) -> None:
        """Have the event loop call ``callback(*args)``, from the decode thread; nothing once the loop has closed (the
        server has stopped: nobody is left to tell)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(callback, *args)

    def shutdown(self) -> None:
        """After the server stopped: end the decode loop (its sequences are done), unload the build."""
        self.engine.stop()
        self.worker.shutdown(wait=True)
        self.tokenizing.shutdown(wait=True)
        self.engine.close()

    def close(self) -> None:
        """Refuse new and waiting requests; those holding lines finish."""
        self.state = "closing" if self.state != "failed" else self.state
        if self.admission:
            self.admission.close()

    def require_ready(self, model: str | None) -> Engine:
        if self.state == "loading":
            raise Refused(503, "the build is still loading; retry once GET /health says ready", retry_after_s=5)
        if self.state != "ready":
            raise Refused(503, f"the server is {self.state}" + (f": {self.problem}" if self.problem else ""),
                          retry_after_s=5)
        if model is not None and model not in self.names:
            served = " or ".join(repr(name) for name in self.names)
            raise Refused(404, f"model {model!r} is not served here; this server serves {served} (GET /v1/models)",
                          "model", "model_not_found")
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

    async def start(self, request: Request, choices: list[Choice], ending: Ending, arrived: float) -> Decoding:
        """Queue every choice of a request as a sequence of its own and return once the first has a cache line (a
        refusal before then keeps its HTTP status: 429 queue full, 503 waited too long or closing). A client that
        disconnects, before or after, gives up every sequence of its request before their next token."""
        decoding = Decoding(self, choices, arrived)
        return await self._admit(request, decoding, decoding.sequences(ending))

    async def score(self, request: Request, prompts: list[list[int]], top: int, arrived: float
                    ) -> list[list[TokenLogprob]]:
        """Each prompt's tokens after its first, with their log-probabilities (and the ``top`` most likely at each
        position): ``Engine.scoring``'s sequences, queued and admitted like any request's."""
        scoring = Scoring(self, [Choice(i, ids, len(ids) - 1, None) for i, ids in enumerate(prompts)], arrived, top)
        scored = scoring.sequences()  # a prompt of one token has nothing to score
        if scored:
            await self._admit(request, scoring, scored)
            async for _ in scoring.items():
                pass
        return scoring.scores

    async def _admit(self, request: Request, decoding: Decoding, sequences: list[Sequence]) -> Decoding:
        decoding.ticket = ticket = self.admission.enter()
        try:
            self.engine.submit(*sequences)
        except RanksFailed as exc:
            self.admission.leave(ticket)
            raise Refused(503, f"the server is failed: {exc}", retry_after_s=5) from None
        watcher = asyncio.ensure_future(watch_disconnect(request, decoding))
        try:
            await self.admission.wait(ticket)
        except BaseException:  # refused, or cancelled while it waited (its client went away)
            decoding.cancel()
            watcher.cancel()
            raise
        return decoding

    def failed(self, exc: BaseException) -> None:
        """A decode raised ``exc``: the server stops taking requests when the ranks failed; any other error was the
        request's own (logged with its traceback, for the operator) and the others go on."""
        if isinstance(exc, RanksFailed):
            if self.state != "failed":
                self.state, self.problem = "failed", f"{type(exc).__name__}: {exc}"
                log.error("serve: the build's ranks failed, the server stops taking requests: %s", self.problem)
        elif not isinstance(exc, InputError):
            log.error("serve: one request failed (the server goes on): %s: %s", type(exc).__name__, exc,
                      exc_info=exc)

    async def complete(self, request: Request, choices: list[Choice], ending: Ending, arrived: float
                       ) -> list[Outcome]:
        """Every choice decoded, in the choices' order."""
        decoding = await self.start(request, choices, ending, arrived)
        outs = [Outcome("", "length", len(c.ids), 0, None, 0.0) for c in choices]
        async for index, item in decoding.items():
            out = outs[index]
            out.text += item.text
            if isinstance(item, Piece):
                if item.logprob is not None:
                    out.logprobs.append(item.logprob)
                if out.ttft_s is None:
                    out.ttft_s = item.seconds
                else:
                    out.decode_s += item.seconds
            else:
                out.finish_reason, out.completion_tokens = item.reason, item.completion_tokens
        return outs


class Decoding:
    """One request's sequences (a choice each) and what they decode, as the engine's thread hands it over."""

    def __init__(self, service: Service, choices: list[Choice], arrived: float):
        self.service, self.choices, self.arrived = service, choices, arrived
        self.ticket: Ticket | None = None  # its place in admission, once it asked for one
        self.queue: asyncio.Queue = asyncio.Queue()
        self._sequences: list[Sequence] = []
        self._started = False
        self.cancelled = False

    def sequences(self, ending: Ending) -> list[Sequence]:
        """A sequence per choice, its text handed to this request's queue, fair among requests (``group``)."""
        engine = self.service.engine
        for choice in self.choices:
            sampler = Sampler(choice.sampling, choice.ids) if choice.sampling is not None else None

            def sink(item, index=choice.index):
                if isinstance(item, Piece):
                    self.service.metrics.tokens.inc()  # what the build decoded, read by the client or not
                self.service.post(self.queue.put_nowait, (index, item))

            self._sequences.append(engine.sequence(choice.ids, choice.max_tokens, ending.stops, sink, sampler,
                                                   ending.stop_ids, group=self, on_start=self._on_start,
                                                   on_end=self._on_end, ignore_eos=ending.ignore_eos,
                                                   min_tokens=ending.min_tokens))
        return self._sequences

    def _on_start(self, _: Sequence) -> None:  # in the decode thread
        self.service.post(self._line_taken)

    def _on_end(self, seq: Sequence) -> None:  # in the decode thread
        self.service.post(self._line_freed, seq)

    def _line_taken(self) -> None:
        admission = self.service.admission
        admission.line_taken()
        self.service.metrics.slots_in_use.set(admission.held)
        if not self._started:
            self._started = True
            admission.started(self.ticket)

    def _line_freed(self, seq: Sequence) -> None:
        if seq.admitted is None:
            return  # it never took a line
        admission = self.service.admission
        admission.line_freed()
        self.service.metrics.slots_in_use.set(admission.held)

    def cancel(self) -> None:
        """Give up every sequence: each ends before its next call into the build (those waiting at once)."""
        if not self.cancelled:
            self.cancelled = True
            for seq in self._sequences:
                seq.cancel()
            self.service.engine.wake()

    async def items(self) -> AsyncIterator[tuple[int, Piece | Finish]]:
        """``(choice index, item)`` as they come, each choice's pieces then its ``Finish``, until every choice is
        done. A choice's failure is a 500 for the request (the other choices are given up); only the ranks' failing
        (``RanksFailed``) fails the server for every request."""
        metrics, first = self.service.metrics, set()
        left = len(self.choices)
        try:
            while left:
                index, item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.service.failed(item)
                    raise Refused(500, f"decoding failed: {type(item).__name__}: {item}")
                if isinstance(item, Piece):
                    if index not in first:
                        metrics.ttft.observe(time.perf_counter() - self.arrived)
                        first.add(index)
                    else:
                        metrics.token_latency.observe(item.seconds)
                else:
                    left -= 1
                yield index, item
        finally:
            self.cancel()  # the answer is complete, or its reader went away: nothing more is decoded for it


class Scoring(Decoding):
    """One request's prompts scored (``Engine.scoring``): ``scores[i]`` holds prompt ``i``'s entries once done."""

    def __init__(self, service: Service, choices: list[Choice], arrived: float, top: int):
        super().__init__(service, choices, arrived)
        self.top = top
        self.scores: list[list[TokenLogprob]] = [[] for _ in choices]

    def sequences(self) -> list[Sequence]:
        self.choices = [choice for choice in self.choices if len(choice.ids) > 1]
        for choice in self.choices:
            def ended(seq: Sequence, index=choice.index) -> None:
                self._on_end(seq)
                failed = seq.finish in (SequenceFinish.error, SequenceFinish.failed)
                item = seq.error if failed else Finish(str(seq.finish), "", len(seq.tokens))
                self.service.post(self.queue.put_nowait, (index, item))

            self._sequences.append(self.service.engine.scoring(choice.ids, self.top, self.scores[choice.index],
                                                               group=self, on_start=self._on_start, on_end=ended))
        return self._sequences


async def watch_disconnect(request: Request, decoding: Decoding) -> None:
    """Give up the request's sequences when its client disconnects."""
    while not decoding.cancelled:
        if await request.is_disconnected():
            decoding.cancel()
            return
        await asyncio.sleep(0.05)


# -- a reply's choices ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ending:
    """What ends a request's sequences besides their budget: stop strings, stop tokens, end-of-sequence tokens
    unless ``ignore_eos``, none of them before ``min_tokens`` tokens."""

    stops: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(frozen=True)
class Choice:
    """One choice of a reply: its index, its prompt's ids and token budget, its sampling. ``n`` choices and a list
    of prompts are a sequence each, all queued at once and decoded side by side as cache lines free (fairly among
    requests: pipeline/decoding/scheduler.py), choice ``prompt * n + j`` as OpenAI orders them; with a seed, choice
    ``j`` samples with ``seed + j`` so that the choices differ and each is reproducible."""

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


def prompt_tokens(choices: list[Choice]) -> int:
    """Each prompt's tokens once, however many choices it has."""
    return sum({id(c.ids): len(c.ids) for c in choices}.values())


def usage_of(choices: list[Choice], outs: list[Outcome]) -> dict:
    return usage(prompt_tokens(choices), sum(o.completion_tokens for o in outs))


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
