"""The HTTP routes of ``serve`` (uvicorn serves them: cli/serve.py): OpenAI-compatible chat and completions, the seed's
``/generate``, ``/v1/models``, health and metrics, and the shape of each answer. A stream sends one event per token (its
text empty while held back: an incomplete character, or the start of a stop string), so a client can time every token.
Its own module: each route and its reply read in one place, on top of schemas, metrics and service.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pipeline.core.errors import InputError
from pipeline.serving.engine import Engine, Finish, Piece
from pipeline.serving.metrics import CountRequests
from pipeline.serving.sampling import SamplingParams, TokenLogprob
from pipeline.serving.schemas import (
    MAX_PROMPTS,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    OpenAIRequest,
    OpenAIRequestT,
    Refused,
    check_supported,
    parse,
    stops_of,
)
from pipeline.serving.service import Choice, Decoding, Service, choices_of, prompt_tokens, usage, usage_of


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
        outs = await service.complete(request, choices, stops, arrived, stop_ids)
        return {**head, "object": "chat.completion", "choices": [{
            "index": c.index, "message": {"role": "assistant", "content": out.text},
            "logprobs": chat_logprobs(engine, out.logprobs, c.sampling), "finish_reason": out.finish_reason}
            for c, out in zip(choices, outs, strict=True)], "usage": usage_of(choices, outs)}
    decoding = await service.start(request, choices, stops, arrived, stop_ids)  # here: a refusal keeps its status
    return streaming(chat_events(decoding, head, engine, include_usage(body)))


async def chat_events(decoding: Decoding, head: dict, engine: Engine, with_usage: bool) -> AsyncIterator[str]:
    """A chat stream: each choice's assistant role, then one event per token of whichever choice decoded it (the
    choices decode side by side), each choice's finish, the usage if asked, and [DONE]."""

    def chunk(choice: Choice, delta: dict, finish: str | None, logprob: TokenLogprob | None = None) -> str:
        logprobs = chat_logprobs(engine, [logprob], choice.sampling) if logprob else None
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}]})

    for choice in decoding.choices:
        yield chunk(choice, {"role": "assistant", "content": ""}, None)
    completed = [0]
    async for choice, item in stream_items(decoding, completed):
        if isinstance(item, str):
            yield item  # an error after the stream began
        elif isinstance(item, Piece):  # one event per token, its text possibly held back
            yield chunk(choice, {"content": item.text}, None, item.logprob)
        else:
            if item.text:
                yield chunk(choice, {"content": item.text}, None)
            yield chunk(choice, {}, item.reason)
    if with_usage:
        yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                   "usage": usage(prompt_tokens(decoding.choices), completed[0])})
    yield sse("[DONE]")


async def completions(request: Request):
    arrived = time.perf_counter()
    service = service_of(request)
    body, engine, stops = await accept(request, CompletionRequest)
    texts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    if len(texts) > MAX_PROMPTS:
        raise Refused(400, f"{len(texts)} prompts: at most {MAX_PROMPTS} per request (each a sequence of its own)",
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
        outs = await service.complete(request, choices, stops, arrived, stop_ids)
        return {**head, "choices": [{"index": c.index, "text": out.text,
                                     "logprobs": completion_logprobs(engine, out.logprobs, c.sampling),
                                     "finish_reason": out.finish_reason}
                                    for c, out in zip(choices, outs, strict=True)],
                "usage": usage_of(choices, outs)}
    decoding = await service.start(request, choices, stops, arrived, stop_ids)  # here: a refusal keeps its status
    return streaming(completion_events(decoding, head, engine, include_usage(body)))


async def completion_events(decoding: Decoding, head: dict, engine: Engine, with_usage: bool) -> AsyncIterator[str]:
    """A completion stream: one event per token of whichever choice decoded it, the last of each choice with its
    finish, the usage if asked, and [DONE]."""
    offsets = [0] * len(decoding.choices)  # characters streamed per choice: each event's logprobs carry text_offset

    def chunk(choice: Choice, text: str, finish: str | None, logprob: TokenLogprob | None = None) -> str:
        logprobs = completion_logprobs(engine, [logprob], choice.sampling, offsets[choice.index]) if logprob else None
        offsets[choice.index] += len(text)
        return sse({**head, "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish}]})

    completed = [0]
    async for choice, item in stream_items(decoding, completed):
        if isinstance(item, str):
            yield item
        elif isinstance(item, Piece):  # one event per token, its text possibly held back
            yield chunk(choice, item.text, None, item.logprob)
        else:
            yield chunk(choice, item.text, item.reason)
    if with_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens(decoding.choices), completed[0])})
    yield sse("[DONE]")


async def generate(request: Request) -> dict:
    arrived = time.perf_counter()
    service = service_of(request)
    body = await parse(request, GenerateRequest, service.max_request_bytes, service.body_timeout_s)
    engine = service.require_ready(None)
    messages = [{"role": "user", "content": body.prompt}]
    ids = await service.ids([body.prompt], lambda: engine.chat_ids(messages), "prompt")
    max_tokens = service.prepare(ids, body.max_tokens, "prompt")
    (out,) = await service.complete(request, choices_of([(ids, max_tokens)], 1, None), (), arrived)
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


# -- streams --------------------------------------------------------------------------------------------------------

def sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


async def stream_items(decoding: Decoding, completed: list[int]) -> AsyncIterator[tuple[Choice, Piece | Finish | str]]:
    """The decode's items with their choice (``completed[0]`` counts the tokens of the finished ones); an error once
    the stream has begun becomes one SSE event in OpenAI's error shape, and ends it."""
    try:
        async for index, item in decoding.items():
            if isinstance(item, Finish):
                completed[0] += item.completion_tokens
            yield decoding.choices[index], item
    except Refused as exc:
        yield decoding.choices[0], sse({"error": {"message": exc.message, "type": "server_error", "param": exc.param,
                                                  "code": exc.code}})


def streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
