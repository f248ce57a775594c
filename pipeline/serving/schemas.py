"""What a request to ``serve`` may say: the request bodies and their limits, checked before any work (an unknown field
or a wrong type, strictly: ``true`` is no number, is a 400 in OpenAI's shape naming the field; docs/serving.md lists
each against vLLM's), ``Refused``, and reading a body within bounds (past ``max_request_bytes``: 413 before the rest is
read; nested past 32 levels, a repeated key or ``NaN``: 400, pipeline/core/jsonio.py). Its own module: what a client
may send, in one place, apart from how it is served.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from pipeline.core import jsonio
from pipeline.serving.sampling import MAX_TOP_LOGPROBS, SEED_MAX, SEED_MIN, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
GENERATE_DEFAULT_MAX_TOKENS = 64  # the generate command's default
MAX_STOPS = 4  # OpenAI's limit on stop sequences
MAX_N = 16  # choices per request (each a sequence of its own, decoded side by side as the build's lines free)
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

    def sampling(self, top_logprobs: int | None, vocab_size: int, ends: frozenset[int] = frozenset(),
                 min_tokens: int = 0) -> SamplingParams | None:
        """The request's sampling; None for plain greedy decoding (the build's own argmax, as validation ran it:
        a seed alone changes nothing, greedy text is the same for any seed). ``ends``: the tokens ``min_tokens``
        holds off (end-of-sequence and stop tokens)."""
        params = SamplingParams(temperature=self.temperature or 0.0,
                                top_p=self.top_p if self.top_p is not None else 1.0, seed=self.seed,
                                presence_penalty=self.presence_penalty or 0.0,
                                frequency_penalty=self.frequency_penalty or 0.0, top_logprobs=top_logprobs,
                                top_k=max(0, self.top_k or 0), min_p=self.min_p or 0.0,
                                repetition_penalty=self.repetition_penalty or 1.0,
                                logit_bias=self.biases(vocab_size), min_tokens=min_tokens,
                                held_off=tuple(sorted(ends)) if min_tokens else ())
        plain = params.greedy and not params.changes_logits
        return None if plain and top_logprobs is None else params

    def biases(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias): OpenAI's keys are token ids as strings, its values -100 to 100."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            # ASCII digits only: str.isdigit() also takes '²' and '٣', which int() refuses or reads as another id; and
            # no longer than the largest id (int() refuses 4,300 digits and more: a 500)
            if not (key.isascii() and key.isdigit()) or len(key) > len(str(vocab_size)) or int(key) >= vocab_size:
                shown = key if len(key) <= 24 else f"{key[:20]}... ({len(key)} characters)"
                raise Refused(400, f"logit_bias key {shown!r} is not a token id of this model (0 to "
                                   f"{vocab_size - 1})", "logit_bias")
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
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk (load tools count tokens by it)


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
    # vLLM's, which benchmarks send to fix output lengths: decode past end-of-sequence tokens; and no end (an
    # end-of-sequence token, a stop token or a stop string) before min_tokens tokens
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)

    def token_budget(self) -> int | None:
        """The most new tokens the request asks for (None: what the cache holds); each kind says."""
        raise NotImplementedError

    def checked_min_tokens(self) -> int:
        budget = self.token_budget()
        if budget is not None and self.min_tokens > budget:
            raise Refused(400, f"min_tokens {self.min_tokens} is more than max_tokens {budget}", "min_tokens")
        return self.min_tokens

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

    def token_budget(self) -> int | None:
        return self.max_tokens or self.max_completion_tokens

    def asked_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise Refused(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(OpenAIRequest):
    # A text, several, a prompt as token ids, or several such (OpenAI's four forms; vLLM takes them too): read by
    # prompts(), which names what is wrong in one sentence (pydantic's union errors name its own types)
    prompt: str | list
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=0)  # 0 with echo: the prompt scored, no more
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's limit for completions
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def token_budget(self) -> int | None:
        return self.max_tokens

    def asked_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or token ids."""
        given = self.prompt
        if isinstance(given, list) and given and all(isinstance(t, int) for t in given):
            if not all(token_id(t) for t in given):
                raise Refused(400, "prompt holds a token id below 0 (or a boolean): token ids are whole numbers "
                                   "from 0", "prompt")
            return [given]
        many = given if isinstance(given, list) else [given]
        for i, one in enumerate(many):
            what = f"prompt.{i}" if isinstance(given, list) else "prompt"
            if not isinstance(one, (str, list)) or not one or (isinstance(one, list)
                                                               and not all(token_id(t) for t in one)):
                raise Refused(400, f"{what} is {json_kind(one)}: a prompt is a text, token ids (whole numbers from "
                                   "0), or a list of either; none may be empty", "prompt")
        if not many:
            raise Refused(400, "prompt is an empty list: give at least one prompt", "prompt")
        return list(many)

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", ("max_tokens 0 asks for nothing unless echo is true (the prompt and, with logprobs, "
                                  "its tokens' log-probabilities); ask for at least 1")
        if self.best_of not in (None, 1):
            return "best_of", (f"best_of {self.best_of} is not supported: choosing among drafts needs their "
                               "log-probabilities summed server-side; ask for n choices with logprobs instead")
        if self.suffix:
            return "suffix", "suffix is not supported: Gemma-4 has no fill-in-the-middle format; omit it"
        return super().unsupported()


def token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def json_kind(value) -> str:
    if isinstance(value, (str, list)) and not value:
        return "empty"
    return {str: "a text", list: "a list of other things", bool: "a boolean", int: "a number"}.get(
        type(value), f"a JSON {type(value).__name__}")


class GenerateRequest(Body):
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(GENERATE_DEFAULT_MAX_TOKENS, ge=1)


class TokenizeRequest(Body):
    """vLLM's ``/tokenize``: a text (``add_special_tokens``: the tokenizer's BOS, as a completion prompt gets) or chat
    messages (the chat template, with the generation prompt, as a chat request gets)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def text_or_messages(self) -> str | list[dict]:
        if (self.prompt is None) == (self.messages is None):
            raise Refused(400, "give prompt (a text) or messages (a chat), one of them", "prompt")
        return self.prompt if self.prompt is not None else [m.as_template_input() for m in self.messages]


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


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
    except ClientDisconnect:  # closed mid-body (or evicted: connections.py): nobody reads the answer, no traceback
        raise Refused(400, "the client closed its connection before its request body arrived") from None
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


# -- fields checked beyond their types ------------------------------------------------------------------------------

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
