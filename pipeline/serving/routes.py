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
from dataclasses import dataclass

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
    DetokenizeRequest,
    GenerateRequest,
    OpenAIRequest,
    OpenAIRequestT,
    Refused,
    TokenizeRequest,
    check_supported,
    parse,
    stops_of,
)
from pipeline.serving.service import (
    Choice,
    Decoding,
    Ending,
    Outcome,
    Service,
    choices_of,
    prompt_tokens,
    usage,
    usage_of,
)


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
    app.post("/tokenize")(tokenize)
    app.post("/detokenize")(detokenize)
    app.get("/tokenizer_info")(tokenizer_info)
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
    """Each name the build answers to (``serve --served-model-name``, then its version), each with the version as
    ``root`` (vLLM's field) and its cache length."""
    service = service_of(request)
    engine = service.engine
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                        "owned_by": engine.manifest.model.name, "root": engine.version,
                                        "max_model_len": engine.shape.kv_max} for name in service.names]}


async def accept(request: Request, kind: type[OpenAIRequestT]) -> tuple[OpenAIRequestT, Engine, Ending]:
    """A chat or completion request's body, checked; the engine, ready and serving its model; how its sequences
    end."""
    service = service_of(request)
    body = await parse(request, kind, service.max_request_bytes, service.body_timeout_s)
    engine = service.require_ready(body.model)
    check_supported(body)
    ending = Ending(stops_of(body.stop), body.stop_ids(engine.vocab_size), body.ignore_eos,
                    body.checked_min_tokens())
    return body, engine, ending


def sampling_of(body: OpenAIRequest, engine: Engine, ending: Ending) -> SamplingParams | None:
    """The request's sampling; ``min_tokens`` holds off the end-of-sequence tokens (unless ignored) and stop tokens."""
    ends = frozenset(ending.stop_ids) | (frozenset() if ending.ignore_eos else engine.eos_ids)
    return body.sampling(body.asked_logprobs(), engine.vocab_size, ends, ending.min_tokens)


def include_usage(body: OpenAIRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def continuous_usage(body: OpenAIRequest) -> bool:
    return bool(body.stream_options and body.stream_options.continuous_usage_stats)


async def chat(request: Request):
    arrived = time.perf_counter()
    service = service_of(request)
    body, engine, ending = await accept(request, ChatRequest)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise Refused(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    messages = [m.as_template_input() for m in body.messages]
    ids = await service.ids([m["content"] for m in messages], lambda: engine.chat_ids(messages), "messages")
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = service.prepare(ids, body.max_tokens or body.max_completion_tokens, "messages", max_field)
    choices = choices_of([(ids, max_tokens)], body.n or 1, sampling_of(body, engine, ending))
    reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": reply_id, "created": created, "model": body.model}
    if not body.stream:
        outs = await service.complete(request, choices, ending, arrived)
        return {**head, "object": "chat.completion", "choices": [{
            "index": c.index, "message": {"role": "assistant", "content": out.text},
            "logprobs": chat_logprobs(engine, out.logprobs, c.sampling), "finish_reason": out.finish_reason}
            for c, out in zip(choices, outs, strict=True)], "usage": usage_of(choices, outs)}
    decoding = await service.start(request, choices, ending, arrived)  # here: a refusal keeps its status
    return streaming(chat_events(decoding, head, engine, include_usage(body), continuous_usage(body)))


async def chat_events(decoding: Decoding, head: dict, engine: Engine, with_usage: bool, continuous: bool
                      ) -> AsyncIterator[str]:
    """A chat stream: each choice's assistant role, then one event per token of whichever choice decoded it (the
    choices decode side by side), each choice's finish, the usage if asked (``continuous``: on every event too, the
    choice's tokens so far: vLLM's ``continuous_usage_stats``), and [DONE]."""
    counted = Counted(decoding.choices, continuous)

    def chunk(choice: Choice, delta: dict, finish: str | None, logprob: TokenLogprob | None = None) -> str:
        logprobs = chat_logprobs(engine, [logprob], choice.sampling) if logprob else None
        return sse({**head, "object": "chat.completion.chunk",
                    "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}], **counted.usage(choice)})

    for choice in decoding.choices:
        yield chunk(choice, {"role": "assistant", "content": ""}, None)
    completed = [0]
    async for choice, item in stream_items(decoding, completed):
        if isinstance(item, str):
            yield item  # an error after the stream began
        elif isinstance(item, Piece):  # one event per token, its text possibly held back
            counted.token(choice)
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
    body, engine, ending = await accept(request, CompletionRequest)
    given = body.prompts()
    if len(given) > MAX_PROMPTS:
        raise Refused(400, f"{len(given)} prompts: at most {MAX_PROMPTS} per request (each a sequence of its own)",
                      "prompt")
    prompts, texts = [], []
    for i, prompt in enumerate(given):
        what = "prompt" if len(given) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            ids = await service.ids([prompt], lambda text=prompt: engine.text_ids(text), what)
        else:
            ids = token_ids(prompt, engine.vocab_size, what)
        texts.append(prompt if isinstance(prompt, str) else engine.text(ids))
        budget = service.prepare(ids, body.max_tokens or None, what)  # the prompt must fit, echoed alone too
        prompts.append((ids, budget if body.max_tokens != 0 else 0))
    choices = choices_of(prompts, body.n or 1, sampling_of(body, engine, ending))
    scored = await echoes(request, body, prompts, texts, arrived)
    echoed = [scored[c.index // (body.n or 1)] for c in choices] if scored else None  # each choice's prompt
    reply_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": reply_id, "object": "text_completion", "created": created, "model": body.model}
    if not body.stream:
        outs = await completed(request, choices, ending, arrived)
        return {**head, "choices": [completion_choice(engine, c, out, echoed[c.index] if echoed else None)
                                    for c, out in zip(choices, outs, strict=True)], "usage": usage_of(choices, outs)}
    decoding = None
    if body.max_tokens != 0:
        decoding = await service.start(request, choices, ending, arrived)  # here: a refusal keeps its status
    return streaming(completion_events(decoding, choices, head, engine, echoed, include_usage(body),
                                       continuous_usage(body)))


def token_ids(prompt: list[int], vocab_size: int, what: str) -> list[int]:
    """A prompt given as token ids, each one of the model's."""
    bad = [t for t in prompt if t >= vocab_size]
    if bad:
        raise Refused(400, f"the {what} holds token ids {bad[:5]} this model does not have (0 to {vocab_size - 1})",
                      what)
    return list(prompt)


@dataclass(frozen=True)
class Echo:
    """A prompt as ``echo`` gives it back: its text, and (when logprobs were asked) each token's entry, the first
    without a log-probability (nothing comes before it), as OpenAI's and vLLM's."""

    text: str
    tokens: list[int]
    scores: list[TokenLogprob] | None


async def echoes(request: Request, body: CompletionRequest, prompts: list[tuple[list[int], int]], texts: list[str],
                 arrived: float) -> list[Echo] | None:
    """Each prompt's ``Echo`` (None without ``echo``), its tokens scored when logprobs were asked
    (``Service.score``: a decode step per prompt token)."""
    if not body.echo:
        return None
    scores: list[list[TokenLogprob] | None] = [None] * len(prompts)
    if body.logprobs is not None:
        scores = await service_of(request).score(request, [ids for ids, _ in prompts], body.logprobs, arrived)
    return [Echo(text, ids, got) for (ids, _), text, got in zip(prompts, texts, scores, strict=True)]


async def completed(request: Request, choices: list[Choice], ending: Ending, arrived: float) -> list[Outcome]:
    """Every choice decoded; none when nothing past the prompt was asked for (``max_tokens`` 0, with echo)."""
    if all(c.max_tokens == 0 for c in choices):
        return [Outcome("", "length", len(c.ids), 0, None, 0.0) for c in choices]
    return await service_of(request).complete(request, choices, ending, arrived)


def completion_choice(engine: Engine, choice: Choice, out: Outcome, echo: Echo | None) -> dict:
    text = (echo.text if echo else "") + out.text
    logprobs = completion_logprobs(engine, out.logprobs, choice.sampling, len(echo.text) if echo else 0)
    if echo is not None and logprobs is not None:
        logprobs = joined(echo_logprobs(engine, echo, choice.sampling), logprobs)
    return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}


def echo_logprobs(engine: Engine, echo: Echo, sampling: SamplingParams) -> dict:
    """OpenAI's completions ``logprobs`` of an echoed prompt: each token, the first with none."""
    entries = completion_logprobs(engine, echo.scores or [], sampling)
    first = engine.token_text(echo.tokens[0])
    offsets = [0, *(len(first) + at for at in entries["text_offset"])]
    tops = None if entries["top_logprobs"] is None else [None, *entries["top_logprobs"]]
    return {"tokens": [first, *entries["tokens"]], "token_logprobs": [None, *entries["token_logprobs"]],
            "top_logprobs": tops, "text_offset": offsets}


def joined(first: dict, then: dict) -> dict:
    tops = None if first["top_logprobs"] is None else first["top_logprobs"] + then["top_logprobs"]
    return {"tokens": first["tokens"] + then["tokens"],
            "token_logprobs": first["token_logprobs"] + then["token_logprobs"], "top_logprobs": tops,
            "text_offset": first["text_offset"] + then["text_offset"]}


class Counted:
    """Each choice's tokens so far, for vLLM's ``continuous_usage_stats`` (the usage on every event)."""

    def __init__(self, choices: list[Choice], on: bool):
        self.on = on
        self.tokens = {c.index: 0 for c in choices}

    def token(self, choice: Choice) -> None:
        self.tokens[choice.index] += 1

    def usage(self, choice: Choice) -> dict:
        return {"usage": usage(len(choice.ids), self.tokens[choice.index])} if self.on else {}


async def completion_events(decoding: Decoding | None, choices: list[Choice], head: dict, engine: Engine,
                            echoed: list[Echo] | None, with_usage: bool, continuous: bool) -> AsyncIterator[str]:
    """A completion stream: each choice's echoed prompt first when asked, then one event per token of whichever
    choice decoded it, the last of each choice with its finish, the usage if asked (``continuous``: on every event
    too), and [DONE]. ``decoding`` None: nothing past the prompts was asked for (``max_tokens`` 0)."""
    offsets = [0] * len(choices)  # characters streamed per choice: each event's logprobs carry text_offset
    counted = Counted(choices, continuous)

    def chunk(choice: Choice, text: str, finish: str | None, logprob: TokenLogprob | None = None) -> str:
        logprobs = completion_logprobs(engine, [logprob], choice.sampling, offsets[choice.index]) if logprob else None
        offsets[choice.index] += len(text)
        return sse({**head, "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish}], **counted.usage(choice)})

    if echoed is not None:
        for choice in choices:
            echo = echoed[choice.index]
            logprobs = echo_logprobs(engine, echo, choice.sampling) if echo.scores is not None else None
            offsets[choice.index] = len(echo.text)
            yield sse({**head, "choices": [{"index": choice.index, "text": echo.text, "logprobs": logprobs,
                                            "finish_reason": None}], **counted.usage(choice)})
    completed = [0]
    if decoding is None:
        for choice in choices:
            yield chunk(choice, "", "length")
    else:
        async for choice, item in stream_items(decoding, completed):
            if isinstance(item, str):
                yield item
            elif isinstance(item, Piece):  # one event per token, its text possibly held back
                counted.token(choice)
                yield chunk(choice, item.text, None, item.logprob)
            else:
                yield chunk(choice, item.text, item.reason)
    if with_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens(choices), completed[0])})
    yield sse("[DONE]")


async def generate(request: Request) -> dict:
    arrived = time.perf_counter()
    service = service_of(request)
    body = await parse(request, GenerateRequest, service.max_request_bytes, service.body_timeout_s)
    engine = service.require_ready(None)
    messages = [{"role": "user", "content": body.prompt}]
    ids = await service.ids([body.prompt], lambda: engine.chat_ids(messages), "prompt")
    max_tokens = service.prepare(ids, body.max_tokens, "prompt")
    (out,) = await service.complete(request, choices_of([(ids, max_tokens)], 1, None), Ending(), arrived)
    steps = out.completion_tokens - 1
    return {"text": out.text, "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
            "new_tokens": out.completion_tokens,
            "ttft_ms": round(out.ttft_s * 1e3, 1) if out.ttft_s is not None else None,
            "tokens_per_s": round(steps / out.decode_s, 1) if steps > 0 and out.decode_s else None}


async def tokenize(request: Request) -> dict:
    """vLLM's ``/tokenize``: a text's token ids (as a completion prompt is tokenized) or chat messages' (as a chat
    request's), their count, and the build's cache length."""
    service = service_of(request)
    body = await parse(request, TokenizeRequest, service.max_request_bytes, service.body_timeout_s)
    engine = service.require_ready(body.model)
    given = body.text_or_messages()
    if isinstance(given, str):
        ids = await service.ids([given], lambda: engine.text_ids(given, body.add_special_tokens), "prompt")
    else:
        ids = await service.ids([m["content"] for m in given], lambda: engine.chat_ids(given), "messages")
    strs = [engine.token_text(t) for t in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.shape.kv_max, "tokens": ids, "token_strs": strs}


async def detokenize(request: Request) -> dict:
    """vLLM's ``/detokenize``: token ids' text."""
    service = service_of(request)
    body = await parse(request, DetokenizeRequest, service.max_request_bytes, service.body_timeout_s)
    engine = service.require_ready(body.model)
    return {"prompt": engine.text(token_ids(body.tokens, engine.vocab_size, "tokens"))}


async def tokenizer_info(request: Request) -> dict:
    return service_of(request).require_ready(None).tokenizer_info()


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
