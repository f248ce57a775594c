"""The HTTP routes of ``serve``: OpenAI-compatible chat and completions, the seed's ``/generate``, health, metrics.

Every request body is read up to ``max_request_bytes`` and no further (past it: 413, before the rest is read),
parsed within bounds (pipeline/core/jsonio.py: nested past 32 levels, a repeated key or ``NaN``: 400) and
checked against the models below before any work (an unknown field, a wrong type, strictly: ``true`` is no number; a
negative ``max_tokens``: a 400 in OpenAI's error shape naming the field), and uvicorn serves them (cli/serve.py). A
prompt is tokenized in a thread of its own, off the event loop, after a length check that refuses, untokenized, a
prompt too long for any tokenization to fit the cache.

One request decodes at a time (the graphs are batch 1). ``Admission`` holds the others in a bounded FIFO queue: past
``queue_size`` waiting, a request gets 429 at once; past ``queue_timeout_s`` of waiting, 503; both with
``Retry-After``. A stream sends one event per token (its text empty while held back: an incomplete character, or
the start of a stop string), so a client can time every token. Decoding runs in one worker thread; a client that
disconnects sets the request's cancel event, and the worker stops before its next token. ``Service.close``
(SIGTERM) refuses new and waiting requests with 503 while the running one finishes.

Decoding is greedy unless a request samples: ``temperature``, ``top_p``, ``seed``, the penalties and log-probabilities
and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``logit_bias`` are applied on the host to each step's logits
(pipeline/serving/sampling.py; the graphs are the same, validation stays greedy). ``n`` choices and a list of prompts
are decoded one after another, each its own turn in the queue (the graphs are batch 1). What the server takes by name
but cannot honour (``echo``, ``best_of`` above 1, ``suffix``, a non-text ``response_format``) is refused in one
sentence naming the field and the alternative (docs/serving.md lists every field against vLLM's server).

``/metrics`` is Prometheus' text format: requests by route and status, time to first token and per-token latency
histograms, tokens generated, and the queue's depth.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.core import jsonio
from pipeline.core.errors import InputError
from pipeline.core.log import log
from pipeline.serving.engine import Engine, Finish, Piece, RanksFailed
from pipeline.serving.sampling import MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN, Sampler, SamplingParams, TokenLogprob
from pipeline.validation.generation import new_tokens_problem

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
GENERATE_DEFAULT_MAX_TOKENS = 64  # the generate command's default
MAX_STOPS = 4  # OpenAI's limit on stop sequences
MAX_N = 16  # choices per request (decoded one after another: the graphs are batch 1)
MAX_PROMPTS = 16  # prompts in one completions request (likewise)


# -- request bodies -------------------------------------------------------------------------------------------------

class Body(BaseModel):
    # An unknown field is refused by name, never ignored; strict: a boolean is no number (``max_tokens: true`` is a
    # 400, not one token), a string no number, a float no integer; an integer stands for a float, as in JSON.
    model_config = ConfigDict(extra="forbid", strict=True)


BodyT = TypeVar("BodyT", bound=Body)


class Sampling(Body):
    """The sampling fields of OpenAI's requests, and vLLM's (pipeline/serving/sampling.py says what each does)."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    # vLLM's extra sampling fields (its OpenAI server takes them beside OpenAI's)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    stop_token_ids: list[int] | None = None

    def sampling(self, top_logprobs: int | None, vocab_size: int) -> SamplingParams | None:
        """The request's sampling; None for plain greedy decoding (the build's own argmax, as validation ran it:
        a seed alone changes nothing, greedy text is the same for any seed)."""
        params = SamplingParams(temperature=self.temperature or 0.0,
                                top_p=self.top_p if self.top_p is not None else 1.0, seed=self.seed,
                                presence_penalty=self.presence_penalty or 0.0,
                                frequency_penalty=self.frequency_penalty or 0.0, top_logprobs=top_logprobs,
                                top_k=max(0, self.top_k or 0), min_p=self.min_p or 0.0,
                                repetition_penalty=self.repetition_penalty or 1.0,
                                logit_bias=self.biases(vocab_size))
        plain = params.greedy and not params.changes_logits
        return None if plain and top_logprobs is None else params

    def biases(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias): OpenAI's keys are token ids as strings, its values -100 to 100."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise Refused(400, f"logit_bias key {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                              "logit_bias")
            if not -100 <= bias <= 100:
                raise Refused(400, f"logit_bias[{key!r}] is {bias}: a bias is between -100 and 100", "logit_bias")
            out.append((int(key), float(bias)))
        return tuple(sorted(out))

    def stop_ids(self, vocab_size: int) -> tuple[int, ...]:
        bad = [t for t in self.stop_token_ids or () if not 0 <= t < vocab_size]
        if bad:
            raise Refused(400, f"stop_token_ids {bad[:5]} are not token ids of this model (0 to {vocab_size - 1})",
                          "stop_token_ids")
        return tuple(self.stop_token_ids or ())


class StreamOptions(Body):
    include_usage: bool = False


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class OpenAIRequest(Sampling):
    """What chat and completion requests share."""

    model: str
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None  # refused unless plain text: see unsupported()

    def unsupported(self) -> tuple[str, str] | None:
        """``(field, sentence)`` for a field this server takes by name but cannot honour."""
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", (f"response_format {self.response_format.get('type')!r} is not supported: "
                                       "this server decodes free text (no structured or JSON-constrained output); "
                                       "omit it, or ask for JSON in the prompt")
        return None


OpenAIRequestT = TypeVar("OpenAIRequestT", bound=OpenAIRequest)


class ChatRequest(OpenAIRequest):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def asked_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise Refused(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's limit for completions
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def asked_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", ("echo is not supported: the reply holds the completion only (the prompt is yours "
                            "already); omit echo")
        if self.best_of not in (None, 1):
            return "best_of", (f"best_of {self.best_of} is not supported: choosing among drafts needs their "
                               "log-probabilities summed server-side; ask for n choices with logprobs instead")
        if self.suffix:
            return "suffix", "suffix is not supported: Gemma-4 has no fill-in-the-middle format; omit it"
        return super().unsupported()


class GenerateRequest(Body):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(GENERATE_DEFAULT_MAX_TOKENS, ge=1)


# -- errors ---------------------------------------------------------------------------------------------------------

class Refused(Exception):
    """A request answered with an error: OpenAI's shape, ``param`` naming the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after_s = (status, message, param, code,
                                                                                retry_after_s)

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}.get(self.status, "server_error")
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}},
                            status_code=self.status, headers=headers)


async def parse(request: Request, model: type[BodyT], max_bytes: int, timeout_s: float) -> BodyT:
    """The request's JSON body as ``model``, or a 400 naming what is wrong. The body is read as JSON whatever its
    Content-Type says (curl's ``-d`` sends form encoding), and never past ``max_bytes``: a larger declared
    Content-Length is a 413 before a byte of it is read, and a body that grows past it (chunked, or longer than
    declared) a 413 as soon as it does; one still arriving after ``timeout_s`` a 408."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large(int(declared), max_bytes)
    try:
        chunks = await asyncio.wait_for(body_chunks(request, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise Refused(408, f"the request body took more than {timeout_s:g} s to arrive (serve --body-timeout)",
                      code="request_timeout") from None
    try:
        data = jsonio.loads(b"".join(chunks))
    except jsonio.JSONRefused as exc:
        raise Refused(400, f"the request body cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise Refused(400, f"the request body is a JSON {type(data).__name__}; it must be an object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise describe_validation(exc) from None


async def body_chunks(request: Request, max_bytes: int) -> list[bytes]:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(size, max_bytes, "at least ")
        chunks.append(chunk)
    return chunks


def too_large(size: int, max_bytes: int, at_least: str = "") -> Refused:
    return Refused(413, f"the request body is {at_least}{size} bytes; this server takes at most {max_bytes} "
                        "(serve --max-request-bytes): shorten the prompt, or start the server with a larger bound",
                   code="request_too_large")


def describe_validation(exc: ValidationError) -> Refused:
    """Pydantic's first complaint as one sentence naming the field (``messages.0.role``), as a 400."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return Refused(400, f"unknown field {where!r}: this server does not support it; remove it", where)
    if first.get("type") == "missing":
        return Refused(400, f"{where} is required", where)
    return Refused(400, f"{where}: {first['msg']} (got {first.get('input')!r})", where or None)


# -- one request at a time ------------------------------------------------------------------------------------------

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


# -- the service ----------------------------------------------------------------------------------------------------

class Metrics:
    def __init__(self) -> None:
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
        self.queue_depth = Gauge("serve_queue_depth", "Requests waiting for their turn", registry=self.registry)


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


def stops_of(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > MAX_STOPS:
        raise Refused(400, f"{len(stops)} stop sequences: at most {MAX_STOPS}", "stop")
    if any(not s for s in stops):
        raise Refused(400, "an empty stop sequence: every stop sequence needs at least one character", "stop")
    return stops


def check_supported(body: OpenAIRequest) -> None:
    problem = body.unsupported()
    if problem:
        raise Refused(400, problem[1], problem[0])


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


async def one_after_another(service: Service, request: Request, choices: list[Choice], first: Decoding,
                            stops: tuple[str, ...], stop_ids: tuple[int, ...], events,
                            usage_event) -> AsyncIterator[str]:
    """A stream of every choice's events, one choice after another (``first`` already started, so that a refusal
    of the request keeps its HTTP status), then the usage (``usage_event``, None: not asked) and [DONE]."""
    completed = [0]
    decoding = first
    for k, choice in enumerate(choices):
        if k:
            try:
                decoding = await service.start(request, choice.ids, choice.max_tokens, stops, time.perf_counter(),
                                               choice.sampling, stop_ids)
            except Refused as exc:
                yield sse({"error": {"message": exc.message, "type": "server_error", "param": exc.param,
                                     "code": exc.code}})
                break
        async for event in events(decoding, choice, completed):
            yield event
    if usage_event is not None:
        yield usage_event(usage(prompt_tokens(choices), completed[0]))
    yield sse("[DONE]")


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


# -- the app --------------------------------------------------------------------------------------------------------

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


def create_app(service: Service) -> FastAPI:
    """The app serving ``service``: its error handlers, the request counter and the routes below, which find the
    service as ``request.app.state.service``."""
    app = FastAPI(title="gemma4-neuron-pipeline serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_exception_handler(Refused, refused)
    app.add_exception_handler(InputError, input_error)
    app.add_middleware(CountRequests, counter=service.metrics.requests)
    app.get("/health")(health)
    app.get("/metrics")(metrics)
    app.get("/v1/models")(models)
    app.post("/v1/chat/completions")(chat)
    app.post("/v1/completions")(completions)
    app.post("/generate")(generate)
    return app


async def refused(_: Request, exc: Refused) -> JSONResponse:
    return exc.response()


async def input_error(_: Request, exc: InputError) -> JSONResponse:
    return Refused(400, str(exc)).response()


def service_of(request: Request) -> Service:
    return request.app.state.service


async def health(request: Request) -> JSONResponse:
    service = service_of(request)
    body = {"status": service.state, "version": service.engine.version}
    if service.problem:
        body["error"] = service.problem
    return JSONResponse(body, status_code=200 if service.state == "ready" else 503)


async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(generate_latest(service_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict:
    engine = service_of(request).engine
    manifest = engine.manifest
    return {"object": "list", "data": [{"id": engine.version, "object": "model",
                                        "created": 0, "owned_by": manifest.model.name}]}


async def accept(request: Request, kind: type[OpenAIRequestT]) -> tuple[OpenAIRequestT, Engine, tuple[str, ...]]:
    """A chat or completion request's body, checked; the engine, ready and serving its model; its stops."""
    service = service_of(request)
    body = await parse(request, kind, service.max_request_bytes, service.body_timeout_s)
    engine = service.require_ready(body.model)
    check_supported(body)
    return body, engine, stops_of(body.stop)


def include_usage(body: OpenAIRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def chat(request: Request):
    arrived = time.perf_counter()
    service = service_of(request)
    body, engine, stops = await accept(request, ChatRequest)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise Refused(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    messages = [m.as_template_input() for m in body.messages]
    ids = await service.ids([m["content"] for m in messages], lambda: engine.chat_ids(messages), "messages")
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = service.prepare(ids, body.max_tokens or body.max_completion_tokens, "messages", max_field)
    sampling = body.sampling(body.asked_logprobs(), engine.vocab_size)
    stop_ids = body.stop_ids(engine.vocab_size)
    choices = choices_of([(ids, max_tokens)], body.n or 1, sampling)
    reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": reply_id, "created": created, "model": engine.version}
    if not body.stream:
        outs = await complete_all(service, request, choices, stops, arrived, stop_ids)
        return {**head, "object": "chat.completion", "choices": [{
            "index": c.index, "message": {"role": "assistant", "content": out.text},
            "logprobs": chat_logprobs(engine, out.logprobs, c.sampling), "finish_reason": out.finish_reason}
            for c, out in zip(choices, outs, strict=True)], "usage": usage_of(choices, outs)}
    first = choices[0]  # started here: a refusal keeps its status
    decoding = await service.start(request, first.ids, first.max_tokens, stops, arrived, first.sampling, stop_ids)

    def events(decoding: Decoding, choice: Choice, completed: list[int]) -> AsyncIterator[str]:
        return chat_events(decoding, head, engine, choice, completed)

    def usage_event(figures: dict) -> str:
        return sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": figures})

    return streaming(one_after_another(service, request, choices, decoding, stops, stop_ids, events,
                                       usage_event if include_usage(body) else None))


async def chat_events(decoding: Decoding, head: dict, engine: Engine, choice: Choice,
                      completed: list[int]) -> AsyncIterator[str]:
    """One choice of a chat stream: the assistant's role, one event per token, the finish."""

    def chunk(delta: dict, finish: str | None, logprob: TokenLogprob | None = None) -> str:
        logprobs = chat_logprobs(engine, [logprob], choice.sampling) if logprob else None
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""}, None)
    async for item in stream_items(decoding):
        if isinstance(item, str):
            yield item  # an error after the stream began
        elif isinstance(item, Piece):  # one event per token, its text possibly held back
            yield chunk({"content": item.text}, None, item.logprob)
        else:
            if item.text:
                yield chunk({"content": item.text}, None)
            yield chunk({}, item.reason)
            completed[0] += item.completion_tokens


async def completions(request: Request):
    arrived = time.perf_counter()
    service = service_of(request)
    body, engine, stops = await accept(request, CompletionRequest)
    texts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    if len(texts) > MAX_PROMPTS:
        raise Refused(400, f"{len(texts)} prompts: at most {MAX_PROMPTS} per request (each decoded in turn)",
                      "prompt")
    prompts = []
    for i, text in enumerate(texts):
        what = "prompt" if len(texts) == 1 else f"prompt.{i}"
        ids = await service.ids([text], lambda text=text: engine.text_ids(text), what)
        prompts.append((ids, service.prepare(ids, body.max_tokens, what)))
    sampling = body.sampling(body.asked_logprobs(), engine.vocab_size)
    stop_ids = body.stop_ids(engine.vocab_size)
    choices = choices_of(prompts, body.n or 1, sampling)
    reply_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": reply_id, "object": "text_completion", "created": created, "model": engine.version}
    if not body.stream:
        outs = await complete_all(service, request, choices, stops, arrived, stop_ids)
        return {**head, "choices": [{"index": c.index, "text": out.text,
                                     "logprobs": completion_logprobs(engine, out.logprobs, c.sampling),
                                     "finish_reason": out.finish_reason}
                                    for c, out in zip(choices, outs, strict=True)],
                "usage": usage_of(choices, outs)}
    first = choices[0]  # started here: a refusal keeps its status
    decoding = await service.start(request, first.ids, first.max_tokens, stops, arrived, first.sampling, stop_ids)

    def events(decoding: Decoding, choice: Choice, completed: list[int]) -> AsyncIterator[str]:
        return completion_events(decoding, head, engine, choice, completed)

    def usage_event(figures: dict) -> str:
        return sse({**head, "choices": [], "usage": figures})

    return streaming(one_after_another(service, request, choices, decoding, stops, stop_ids, events,
                                       usage_event if include_usage(body) else None))


async def completion_events(decoding: Decoding, head: dict, engine: Engine, choice: Choice,
                            completed: list[int]) -> AsyncIterator[str]:
    """One choice of a completion stream: one event per token, the last with the finish."""
    offset = [0]  # characters streamed so far: each event's logprobs carry their text_offset

    def chunk(text: str, finish: str | None, logprob: TokenLogprob | None = None) -> str:
        logprobs = completion_logprobs(engine, [logprob], choice.sampling, offset[0]) if logprob else None
        offset[0] += len(text)
        return sse({**head, "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish}]})

    async for item in stream_items(decoding):
        if isinstance(item, str):
            yield item
        elif isinstance(item, Piece):  # one event per token, its text possibly held back
            yield chunk(item.text, None, item.logprob)
        else:
            yield chunk(item.text, item.reason)
            completed[0] += item.completion_tokens


async def generate(request: Request) -> dict:
    arrived = time.perf_counter()
    service = service_of(request)
    body = await parse(request, GenerateRequest, service.max_request_bytes, service.body_timeout_s)
    engine = service.require_ready(None)
    messages = [{"role": "user", "content": body.prompt}]
    ids = await service.ids([body.prompt], lambda: engine.chat_ids(messages), "prompt")
    max_tokens = service.prepare(ids, body.max_tokens, "prompt")
    out = await service.complete(request, ids, max_tokens, (), arrived)
    steps = out.completion_tokens - 1
    return {"text": out.text, "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
            "new_tokens": out.completion_tokens,
            "ttft_ms": round(out.ttft_s * 1e3, 1) if out.ttft_s is not None else None,
            "tokens_per_s": round(steps / out.decode_s, 1) if steps > 0 and out.decode_s else None}


def chat_logprobs(engine: Engine, entries: list[TokenLogprob], sampling: SamplingParams | None) -> dict | None:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` (None: not asked)."""
    if sampling is None or sampling.top_logprobs is None:
        return None

    def one(token: int, logprob: float) -> dict:
        text = engine.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(engine: Engine, entries: list[TokenLogprob], sampling: SamplingParams | None,
                        start: int = 0) -> dict | None:
    """OpenAI's completions ``logprobs``: ``{tokens, token_logprobs, top_logprobs, text_offset}`` (None: not asked;
    ``text_offset`` counts characters of the completion from ``start``)."""
    if sampling is None or sampling.top_logprobs is None:
        return None
    tokens = [engine.token_text(e.token) for e in entries]
    offsets, at = [], start
    for text in tokens:
        offsets.append(at)
        at += len(text)
    tops = None
    if sampling.top_logprobs:
        tops = []
        for e in entries:  # keyed by text, as OpenAI's are: of two tokens spelt alike, the likelier is kept
            top: dict[str, float] = {}
            for t, lp in e.top:
                top.setdefault(engine.token_text(t), lp)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


async def stream_items(decoding: Decoding) -> AsyncIterator[Piece | Finish | str]:
    """The decode's items; an error once the stream has begun becomes one SSE event in OpenAI's error shape."""
    try:
        async for item in decoding.items():
            yield item
    except Refused as exc:
        yield sse({"error": {"message": exc.message, "type": "server_error", "param": exc.param, "code": exc.code}})


def streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
