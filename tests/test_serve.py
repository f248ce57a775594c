"""``python -m pipeline serve``: a published tiny build served over HTTP, driven as its users drive it.

The official ``openai`` client for chat, completions and streaming (the greedy text equals ``generate``'s and
transformers' own); concurrent clients against the bounded queue; a client that goes away; bad requests; the
start-up refusals (a tampered build, a version that does not exist, an unsigned build, a port in use); SIGTERM.
Every server here is the real command in its own process, on a loopback port.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path

import pytest
import torch

# Every version environment runs these (the mark names no distribution: they depend on many).
pytestmark = pytest.mark.across_versions

REPO = Path(__file__).resolve().parent.parent
VARIANT = "512_fp32"
QUESTION = "What is the capital of France?"
STARTUP_S = 180
SERVED_NAME = "gemma-4-tiny"  # serve --served-model-name, beside the version


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def published(tiny_512_fp32) -> tuple[Path, Path, str]:
    """The tiny 512_fp32 build published to a local folder: ``(publish folder, checkpoint, version)``."""
    root, _ = tiny_512_fp32
    version = json.loads((root / "gemma4_tiny" / VARIANT / "publish.json").read_text())["tag"]
    return root / "published", root / "gemma4_tiny" / "weights", version


def limit_files(nofile: int) -> None:
    """``ulimit -n nofile`` (soft and hard) for a server's process."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))


@dataclass
class Reply:
    status: int
    headers: dict
    text: str

    def json(self):
        return json.loads(self.text)


def request(url: str, body=None, timeout: float = 120) -> Reply:
    """A GET (no body) or a POST of ``body`` (bytes as they are, anything else as JSON), answered or refused."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return Reply(response.status, {k.lower(): v for k, v in response.headers.items()}, response.read().decode())
    except urllib.error.HTTPError as error:
        return Reply(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read().decode())


class Server:
    """``python -m pipeline serve`` in its own process, on a free loopback port."""

    def __init__(self, published, dest: Path, *extra: str, source: list[str] | None = None, env: dict | None = None,
                 nofile: int | None = None):
        folder, weights, self.version = published
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = dest / f"serve-{self.port}.log"
        source = source or [str(folder), VARIANT, "--dest", str(dest), "--allow-unsigned"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline", "serve", *source, "--checkpoint", str(weights), "--port",
             str(self.port), *extra], cwd=REPO, stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True,
            env={**os.environ, **(env or {})}, preexec_fn=(lambda: limit_files(nofile)) if nofile else None)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if request(f"{self.url}/health", timeout=5).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"not ready after {STARTUP_S} s:\n{self.log.read_text()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def post(self, route: str, body, timeout: float = 120) -> Reply:
        return request(self.url + route, body, timeout)

    def get(self, route: str) -> Reply:
        return request(self.url + route, timeout=10)


def metric(srv: Server, name: str) -> float:
    """One sample of ``/metrics`` (the first line starting with ``name``)."""
    return next(float(line.split()[-1]) for line in srv.get("/metrics").text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def server(published, tmp_path_factory):
    srv = Server(published, tmp_path_factory.mktemp("dest"), "--served-model-name", SERVED_NAME)
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_reference(weights: Path, ids: list[int], new_tokens: int) -> str:
    """transformers' own greedy continuation of ``ids``, as text (end-of-sequence tokens dropped)."""
    import torch
    from transformers import AutoTokenizer, Gemma4ForCausalLM

    tok = AutoTokenizer.from_pretrained(weights)
    model = Gemma4ForCausalLM.from_pretrained(weights, dtype=torch.float32, attn_implementation="eager").eval()
    from pipeline.recipe.spec import load_spec

    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()
    stop = next((i for i, t in enumerate(out) if t in load_spec(weights).eos_token_ids), len(out))
    return tok.decode(out[:stop], skip_special_tokens=True)


def test_the_openai_client_gets_generates_text_and_the_references(server, client, published, tmp_path):
    folder, weights, version = published
    assert [m.id for m in client.models.list().data] == [SERVED_NAME, version]
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=version, messages=messages, max_tokens=12)
    text = chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.prompt_tokens == 26
    streamed = client.chat.completions.create(model=version, messages=messages, max_tokens=12, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # The same build through generate, and transformers' float model on the same ids: the same greedy text (fp32).
    pulled = cli("pull", str(folder), version, "--dest", str(tmp_path), "--allow-unsigned").stdout.strip()
    generated = cli("generate", pulled, "--checkpoint", str(weights), "--prompt", QUESTION, "--max-new-tokens", "12")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.rstrip("\n") == text
    from transformers import AutoTokenizer

    from .conftest import chat_ids

    assert greedy_reference(weights, chat_ids(AutoTokenizer.from_pretrained(weights), QUESTION), 12) == text
    completion = client.completions.create(model=version, prompt="The capital of France is", max_tokens=6)
    tok_ids = AutoTokenizer.from_pretrained(weights)("The capital of France is")["input_ids"]
    assert completion.choices[0].text == greedy_reference(weights, tok_ids, 6)
    streamed = client.completions.create(model=version, prompt="The capital of France is", max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
    simple = server.post("/generate", {"prompt": QUESTION, "max_tokens": 12}).json()
    assert simple["text"] == text and simple["prompt_tokens"] == 26 and simple["new_tokens"] == 12


def test_a_stop_string_ends_the_text_before_it(server, client):
    whole = client.completions.create(model=server.version, prompt="The capital of France is", max_tokens=12)
    text = whole.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(model=server.version, prompt="The capital of France is", max_tokens=12, stop=stop)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=server.version, prompt="The capital of France is", max_tokens=12,
                                         stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text[:text.index(stop)]


def prompt_logprobs(weights: Path, ids: list[int], every: bool = False) -> list[float]:
    """transformers' float model's log-probability of each token of ``ids`` after the first (``every``: of every
    token of the vocabulary after the whole of ``ids``)."""
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM.from_pretrained(weights, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    if every:
        return torch.log_softmax(logits[-1], -1).tolist()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:]).view(-1, 1)).view(-1).tolist()


def test_token_id_prompts_and_echo_with_the_prompts_logprobs_as_lm_eval_asks(server, client, published):
    """Issue 53: a prompt as token ids is the same prompt as its text; ``echo`` gives the prompt back, and with
    ``logprobs`` each prompt token's log-probability (the first null), what lm-eval's loglikelihood tasks read
    (``max_tokens`` 1, ``logprobs`` 1, ``echo``, token ids); ``max_tokens`` 0 scores the prompt alone."""
    _, weights, _ = published
    prompt = "The capital of France is"
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    by_text = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6)
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.model == SERVED_NAME
    two = client.completions.create(model=server.version, prompt=[ids, ids[:3]], max_tokens=2)
    assert len(two.choices) == 2 and two.usage.prompt_tokens == len(ids) + 3
    scored = client.completions.create(model=server.version, prompt=[ids], max_tokens=1, logprobs=1, echo=True,
                                       temperature=0, seed=1234)
    choice = scored.choices[0]
    assert choice.text.startswith(server.post("/detokenize", {"tokens": ids}).json()["prompt"])
    logprobs = choice.logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and all(len(top) >= 1 for top in logprobs.top_logprobs[1:])
    expected = prompt_logprobs(weights, ids)
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-3)  # the fp32 build against fp32
    alone = client.completions.create(model=server.version, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-3)
    streamed = list(client.completions.create(model=server.version, prompt=prompt, max_tokens=3, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt + client.completions.create(
        model=server.version, prompt=prompt, max_tokens=3).choices[0].text


def test_load_tools_fields_fix_output_lengths_and_count_tokens_on_every_chunk(server, client, published):
    """vLLM's fields that guidellm, aiperf and the like send: ``ignore_eos`` and ``min_tokens`` (no end before that
    many tokens: end-of-sequence and stop tokens held off, stop strings not looked for), and
    ``stream_options.continuous_usage_stats`` (the usage so far on every chunk)."""
    prompt = "The capital of France is"
    greedy = client.completions.create(model=server.version, prompt=prompt, max_tokens=1)
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    first = [int(torch.tensor(prompt_logprobs(published[1], ids, every=True)).argmax())]  # transformers' greedy token
    stopped = client.completions.create(model=server.version, prompt=prompt, max_tokens=8,
                                        extra_body={"stop_token_ids": first[:1]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 1
    held = client.completions.create(model=server.version, prompt=prompt, max_tokens=8,
                                     extra_body={"stop_token_ids": first[:1], "min_tokens": 3, "ignore_eos": True})
    assert held.usage.completion_tokens >= 3 and not held.choices[0].text.startswith(greedy.choices[0].text)
    fixed = client.completions.create(model=server.version, prompt=prompt, max_tokens=40,
                                      extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 40 and fixed.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(
        model=server.version, messages=[{"role": "user", "content": QUESTION}], max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts[0] == 0 and counts[-1] == 5 and counts == sorted(counts)
    assert all(c.usage.prompt_tokens == 26 for c in chunks)


def test_tokenizer_routes_answer_as_vllms(server):
    """``/tokenize`` (a text as a completion prompt is tokenized, or messages as a chat's), ``/detokenize`` and
    ``/tokenizer_info`` (what lm-eval's remote tokenizer reads instead of fetching one from the Hub)."""
    said = server.post("/tokenize", {"prompt": "Paris", "return_token_strs": True}).json()
    assert said["count"] == len(said["tokens"]) == len(said["token_strs"]) and said["max_model_len"] == 512
    bare = server.post("/tokenize", {"prompt": "Paris", "add_special_tokens": False}).json()
    assert said["tokens"][-len(bare["tokens"]):] == bare["tokens"]  # the tokenizer's own special tokens, if any, first
    framed = server.post("/tokenize", {"prompt": "<bos>Paris", "add_special_tokens": False}).json()["tokens"]
    assert framed == [2, *bare["tokens"]]  # a special token written in the text is read as itself
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": QUESTION}]}).json()
    assert chat["count"] == 26  # as the chat request's prompt_tokens
    assert server.post("/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": "Paris"}
    info = server.get("/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == 512


@pytest.mark.parametrize("route, body, status, param, said", [
    ("/v1/chat/completions", "{not json", 400, None, "not valid JSON"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model", "model is required"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}], "tools": []}, 400,
     "tools", "unknown field 'tools'"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "hi"}]}, 404, "model",
     "model 'other' is not served here"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400,
     "n", "less than or equal to 16"),
    # What the server takes by name but cannot honour: one sentence naming the field and the alternative.
    ("/v1/completions", {"model": "VERSION", "prompt": [5, 10**6]}, 400, "prompt", "token ids [1000000] this model"),
    ("/v1/completions", {"model": "VERSION", "prompt": [[5], []]}, 400, "prompt", "prompt"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens",
     "min_tokens 4 is more than max_tokens 3"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt",
     "give prompt (a text) or messages"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens", "this model does not have"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "best_of": 3}, 400, "best_of",
     "ask for n choices with logprobs instead"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, 400, "response_format",
     "'json_object' is not supported"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "logit_bias": {"x": 5}}, 400, "logit_bias",
     "'x' is not a token id"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias",
     "'\u00b2' is not a token id"),  # str.isdigit() takes a superscript two; int() does not
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "logit_bias": {"7" * 5000: 1}}, 400, "logit_bias",
     "(5000 characters)' is not a token id"),  # int() refuses 4,300 digits and more
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "logit_bias": {"3": 101}}, 400, "logit_bias",
     "between -100 and 100"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "stop_token_ids": [10**6]}, 400, "stop_token_ids",
     "not token ids of this model"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}],
                              "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs needs logprobs: true"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "logprobs": 6}, 400, "logprobs", "less than or equal"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600},
     400, "max_tokens", "ask for at most 497"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "Paris is a city. " * 150}]},
     400, "messages", "this build's cache holds 512"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages.0.role", "messages.0.role"),
    ("/v1/completions", {"model": "VERSION", "prompt": ["a"] * 17}, 400, "prompt", "at most 16 per request"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "max_tokens": 0}, 400, "max_tokens",
     "max_tokens 0 asks for nothing unless echo is true"),
    ("/generate", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "valid integer"),
    # A boolean is no number (it was taken as one token), a string or a float no integer.
    ("/generate", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", "valid integer (got True)"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "max_tokens": True}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "max_tokens": "3"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "max_tokens": 2.5}, 400, "max_tokens", "valid integer"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": False}, 400, "max_completion_tokens", "valid integer"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}],
                              "temperature": True}, 400, "temperature", "valid number"),
    ("/v1/chat/completions", {"model": "VERSION", "messages": [{"role": "user", "content": "hi"}], "seed": True},
     400, "seed", "valid integer"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "stream": 1}, 400, "stream", "valid boolean"),
    # Longer than any prompt that could fit the cache: refused by its length, before it is tokenized.
    ("/v1/completions", {"model": "VERSION", "prompt": "Paris " * 20000}, 400, "prompt", "characters: more than"),
    # A seed past what the sampler's generator takes (it was a 500 that failed the server for every request).
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "temperature": 1, "seed": 2**64}, 400, "seed",
     "less than or equal to 9223372036854775807"),
    ("/v1/completions", {"model": "VERSION", "prompt": "a", "temperature": 1, "seed": -(2**63) - 1}, 400, "seed",
     "greater than or equal to -9223372036854775808"),
    # Nested under the size bound (it was a bare 500 from the parser's RecursionError); a repeated key; NaN.
    ("/v1/completions", '{"prompt": ' + "[" * 400_000 + "]" * 400_000 + "}", 400, None, "nests deeper than 32"),
    ("/v1/completions", '{"prompt": ' + "[" * 40 + "]" * 40 + "}", 400, None, "nests deeper than 32"),
    ("/v1/completions", '{"model": "a", "model": "b", "prompt": "x"}', 400, None, "'model' appears twice"),
    ("/v1/completions", '{"model": "a", "prompt": "x", "temperature": NaN}', 400, None, "NaN is not JSON"),
])
def test_a_bad_request_is_refused_naming_the_field_and_the_server_keeps_serving(server, route, body, status, param,
                                                                                said):
    if isinstance(body, dict) and body.get("model") == "VERSION":
        body["model"] = server.version
    response = server.post(route, body.encode() if isinstance(body, str) else body)
    error = response.json()["error"]
    assert response.status == status and error["param"] == param and said in error["message"], error
    assert server.post("/generate", {"prompt": "hi", "max_tokens": 2}).status == 200


# -- oversized requests ---------------------------------------------------------------------------------------------

def raw_request(port: int, head: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head.encode())
    return sock


def status_of(sock: socket.socket) -> tuple[int, str]:
    """The status and body of the answer on ``sock`` (read up to the end of its JSON)."""
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")


def test_an_oversized_body_is_refused_before_it_is_read(server, client):
    from openai import APIStatusError

    route = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    # A declared 10 MB: answered 413 with no byte of the body sent.
    declared = raw_request(server.port, route + f"Content-Length: {10 * 2**20}\r\n\r\n")
    status, body = status_of(declared)
    assert status == 413 and "serve --max-request-bytes" in body and "10485760 bytes" in body, body
    declared.close()
    # Chunked, with no length: answered 413 once it has grown past the bound, while the client is still sending.
    chunked = raw_request(server.port, route + "Transfer-Encoding: chunked\r\n\r\n")
    piece = b'{"prompt": "' + b"x" * 65536
    for _ in range(20):
        chunked.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    status, body = status_of(chunked)
    assert status == 413 and "at least" in body, body
    chunked.close()
    with pytest.raises(APIStatusError) as refused:  # the official client, 2 MB
        client.completions.create(model=server.version, prompt="Paris " * (2 * 2**20 // 6), max_tokens=2)
    assert refused.value.status_code == 413 and "--max-request-bytes" in str(refused.value)
    assert server.post("/generate", {"prompt": "hi", "max_tokens": 2}).status == 200


def test_health_answers_while_a_body_is_still_arriving(server):
    slow = raw_request(server.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                    "Content-Length: 400000\r\n\r\n")
    slow.sendall(b'{"prompt": "' + b"x" * 200000)  # half of it; the rest comes later, or never
    assert server.get("/health").status == 200
    slow.sendall(b"x" * (400000 - 200000 - 14) + b'", "a": 1}')
    status, body = status_of(slow)
    assert status == 400, body
    slow.close()


def test_slow_clients_cannot_hold_the_server(published, tmp_path):
    """Slowloris with ``ulimit -n 256``: 400 connections that never finish their headers. /health and a request are
    answered meanwhile (before, the server ran out of descriptors: /health went unanswered and each refused accept
    was logged); a connection whose headers are late is closed."""
    srv = Server(published, tmp_path, "--header-timeout", "2", nofile=256)
    slow: list[socket.socket] = []
    try:
        srv.wait_ready()
        for _ in range(400):
            try:
                slow.append(raw_request(srv.port, "GET /health HTTP/1.1\r\nHost: x\r\n"))
            except OSError:  # the backlog is full while the server closes the oldest: as a real attacker meets it
                pass
        for sock in slow:
            with contextlib.suppress(OSError):
                sock.sendall(b"X-a: b\r\n")
        assert request(f"{srv.url}/health", timeout=10).status == 200
        assert srv.post("/generate", {"prompt": "hi", "max_tokens": 2}).status == 200
        late = raw_request(srv.port, "GET /health HTTP/1.1\r\nHost: x\r\n")
        late.settimeout(10)
        started = time.monotonic()
        assert late.recv(1) == b""  # closed by the server, its headers 2 s late
        assert 1.5 < time.monotonic() - started < 8
        late.close()
    finally:
        for sock in slow:
            sock.close()
        assert srv.stop() == 0
    said = srv.log.read_text()
    assert "Too many open files" not in said and "at most 96 connections" in said, said[-3000:]


def test_clients_trickling_bodies_cannot_hold_the_server(published, tmp_path):
    """Every place but one held by connections that sent a POST's headers and then trickle its body: /health is
    answered (the oldest trickler is closed for it: a body still arriving is no request in progress), a decoding
    request's connection is never the one closed, and a closed trickler is no traceback in the log. Before, a trickler
    counted as busy: 300 held /health off (bench/serve_slowloris.py --body)."""
    srv = Server(published, tmp_path, "--max-connections", "8")
    tricklers: list[socket.socket] = []
    try:
        srv.wait_ready()
        body = json.dumps({"model": srv.version, "prompt": QUESTION, "max_tokens": 60, "stream": True})
        decoding = HTTPConnection("127.0.0.1", srv.port, timeout=60)
        decoding.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = decoding.getresponse()
        assert response.status == 200
        for _ in range(7):
            tricklers.append(raw_request(srv.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                                   "application/json\r\nContent-Length: 1000\r\n\r\n{"))
        time.sleep(0.5)
        for _ in range(3):
            for sock in tricklers:
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")
            assert request(f"{srv.url}/health", timeout=10).status == 200
        streamed = response.read().decode()
        assert streamed.rstrip().endswith("data: [DONE]")  # its connection was kept
        closed = 0
        for sock in tricklers:
            sock.settimeout(5)
            try:
                closed += sock.recv(1) == b""
            except (TimeoutError, ConnectionResetError):
                closed += isinstance(sys.exc_info()[1], ConnectionResetError)
        assert closed >= 1
    finally:
        for sock in tricklers:
            sock.close()
        assert srv.stop() == 0
    assert "Traceback" not in srv.log.read_text()


def test_a_full_house_closes_an_idle_connection_before_an_upload_and_never_a_request_in_progress():
    """The eviction order: idle or still sending headers first, then still sending its body (an honest upload may be
    slow), never a request whose body is in."""
    from pipeline.serving.connections import Connections

    class Conn:
        def __init__(self, in_request: bool, busy: bool):
            self.in_request, self.busy, self.dropped = in_request, busy, False

        def drop(self):
            self.dropped = True
            bound.open.pop(self)

    bound = Connections(3, 10.0)
    decoding, uploading, idle = Conn(True, True), Conn(True, False), Conn(False, False)
    for conn in (decoding, uploading, idle):
        assert bound.admit(conn)
    assert bound.admit(Conn(False, False)) and idle.dropped and not uploading.dropped  # the older upload is kept
    newest = next(reversed(bound.open))
    newest.in_request = newest.busy = True
    assert bound.admit(Conn(False, False)) and uploading.dropped and not decoding.dropped
    for conn in bound.open:
        conn.in_request = conn.busy = True
    assert not bound.admit(Conn(False, False))  # every one has a request in progress: the new one is refused
    assert bound.refused == 1 and bound.evicted == 2


def test_a_repeated_log_line_is_written_once_per_ten_seconds_with_a_count(monkeypatch):
    import logging

    from pipeline.serving import connections

    clock = [100.0]
    monkeypatch.setattr(connections.time, "monotonic", lambda: clock[0])
    once = connections.OncePer()
    record = lambda: logging.LogRecord("asyncio", logging.ERROR, "x", 1, "socket.accept() out of system resource",  # noqa: E731
                                       None, None)
    passed = []
    for step in range(2001):  # 20 s of a refusal every 10 ms
        clock[0] = 100.0 + step * 0.01
        r = record()
        if once.filter(r):
            passed.append(r.getMessage())
    assert len(passed) == 3 and passed[0] == "socket.accept() out of system resource"
    assert passed[1].endswith("(999 more like it in the last 10 s left out)")


async def asgi(app, method: str, path: str, body: bytes = b"") -> int:
    """One request to an ASGI ``app``, as uvicorn would hand it over: the answer's status."""
    import asyncio

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    delivered, status = False, {}

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # the client stays connected

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status["code"] = message["status"]

    await app(scope, receive, send)
    return status["code"]


def test_tokenizing_a_prompt_does_not_hold_up_health():
    """In one process: a prompt whose tokenizer is held on an event; /health must answer while it is held (it
    waited for the tokenizer when prompts were tokenized on the event loop)."""
    import asyncio

    from pipeline.serving.routes import create_app
    from pipeline.serving.service import Service

    held, release, outcome = threading.Event(), threading.Event(), {}

    class Engine:
        version, max_prompt_chars, vocab_size = "v", 10_000, 512
        manifest = type("M", (), {"model": type("Model", (), {"name": "tiny"})()})()
        shape = type("S", (), {"kv_max": 512})()

        def text_ids(self, prompt):
            held.set()
            # Released by the test once /health answered; never, if tokenizing held up the event loop.
            outcome["released"] = release.wait(10)
            return [1] * 600  # too many for the cache: refused once tokenized, nothing decodes

        lines = 1

        def room(self, n):
            return 512 - n

        def stop(self):
            pass

        def close(self):
            pass

    async def scenario() -> tuple[int, int]:
        service = Service(Engine(), queue_size=2, queue_timeout_s=30, max_request_bytes=2**20, body_timeout_s=30)
        service.open()
        service.ready()
        app = create_app(service)
        completion = asyncio.ensure_future(asgi(app, "POST", "/v1/completions", b'{"model": "v", "prompt": "hi"}'))
        while not held.is_set():
            await asyncio.sleep(0.01)
        health = await asyncio.wait_for(asgi(app, "GET", "/health"), timeout=20)
        release.set()
        answered = await completion
        service.shutdown()
        return health, answered

    try:
        assert asyncio.run(scenario()) == (200, 400)
        assert outcome["released"], "/health answered only after the tokenizer gave up waiting"
    finally:
        release.set()


def test_a_requests_own_failure_is_its_answer_and_only_the_ranks_failing_stops_the_server():
    """In one process, the real decode loop over a build whose calls fail on demand: a host-side error of one
    request's sequence (its prompt's host prefill, its sampler) is a 500 for that request and the next is served (any
    decode error failed the server for everyone, once); the ranks' failing stops the server."""
    import asyncio

    from pipeline.core.shape import BuildShape
    from pipeline.decoding.engine import BatchEngine
    from pipeline.decoding.runner import RanksFailed
    from pipeline.serving.engine import Engine
    from pipeline.serving.routes import create_app
    from pipeline.serving.service import Service

    failures: list[BaseException] = []

    class Runner:  # the BatchRunner's calls, the first of which raises what the test queued
        lines = 1

        def prefill(self, seq):
            if failures:
                raise failures.pop(0)
            return torch.zeros(8), torch.tensor(7)

        def decode(self, seqs):
            raise AssertionError("max_tokens 1: never called")

    class Tokenizer:
        def decode(self, tokens, skip_special_tokens=False):
            return "x" * len(tokens)

    engine = Engine.__new__(Engine)  # the real engine's request side, over the runner above
    engine.version, engine.max_prompt_chars, engine.vocab_size, engine.eos_ids = "v", 10_000, 512, frozenset()
    engine.manifest = type("M", (), {"model": type("Model", (), {"name": "tiny"})()})()
    engine.shape, engine.tokenizer, engine._tokenizer_lock = BuildShape(512, 64, "fp32", "device", 2), Tokenizer(), \
        threading.Lock()
    engine.text_ids, engine.close = lambda prompt: [1, 2, 3], lambda: None
    body = b'{"model": "v", "prompt": "hi", "max_tokens": 1}'

    async def scenario() -> list[int]:
        service = Service(engine, queue_size=2, queue_timeout_s=30, max_request_bytes=2**20, body_timeout_s=30)
        engine.batch = BatchEngine(Runner(), on_decode=engine.on_decode)
        service.open()
        service.ready()
        service.worker.submit(service.decode_loop)
        app = create_app(service)
        statuses = []
        failures[:] = [RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")]
        statuses.append(await asgi(app, "POST", "/v1/completions", body))
        statuses += [await asgi(app, "GET", "/health"), await asgi(app, "POST", "/v1/completions", body)]
        failures[:] = [RanksFailed("the build's ranks failed in prefill: EOFError: rank 1 exited")]
        statuses.append(await asgi(app, "POST", "/v1/completions", body))
        await asyncio.sleep(0.1)  # the decode loop's failure reaches the event loop
        statuses += [await asgi(app, "GET", "/health"), await asgi(app, "POST", "/v1/completions", body)]
        service.shutdown()
        return statuses

    assert asyncio.run(scenario()) == [500, 200, 200, 500, 503, 503]


# -- sampling ------------------------------------------------------------------------------------------------------

def test_sampling_is_reproducible_by_seed_and_greedy_at_temperature_zero(server, client):
    asked = {"model": server.version, "prompt": "The capital of France is", "max_tokens": 12}
    greedy = client.completions.create(**asked).choices[0].text
    assert client.completions.create(**asked, temperature=0, seed=3).choices[0].text == greedy
    first = client.completions.create(**asked, temperature=1.5, seed=7).choices[0].text
    assert client.completions.create(**asked, temperature=1.5, seed=7).choices[0].text == first  # the same text
    drawn = {client.completions.create(**asked, temperature=1.5, seed=seed).choices[0].text for seed in range(6)}
    assert drawn - {greedy}  # it does sample
    # top_p so small that only the most likely token is left at each step: the greedy text again
    assert client.completions.create(**asked, temperature=1.5, top_p=1e-6, seed=9).choices[0].text == greedy
    # Below vLLM's 1e-5, a temperature is greedy (1e-308 overflowed the logits to inf: a 500 that failed the server)
    for tiny in (1e-308, 9e-6):
        assert client.completions.create(**asked, temperature=tiny, seed=2**63 - 1).choices[0].text == greedy
    streamed = client.completions.create(**asked, temperature=1.5, seed=7, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == first


def test_logprobs_come_from_each_steps_logits(server, client):
    chat = client.chat.completions.create(model=server.version, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=6, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) in (chat.usage.completion_tokens, chat.usage.completion_tokens - 1)  # the EOS is not shown
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        assert entry.logprob == tops[0] and entry.token == entry.top_logprobs[0].token  # greedy: the most likely
        assert entry.bytes == list(entry.token.encode())
    completion = client.completions.create(model=server.version, prompt="The capital of France is", max_tokens=5,
                                           logprobs=2, temperature=1.0, seed=1)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) <= 2 and lp <= max(top.values()) for top, lp in zip(logprobs.top_logprobs,
                                                                            logprobs.token_logprobs))
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    streamed = client.chat.completions.create(model=server.version, messages=[{"role": "user", "content": QUESTION}],
                                              max_tokens=6, logprobs=True, stream=True)
    per_token = [c.choices[0].logprobs.content[0].logprob for c in streamed
                 if c.choices and c.choices[0].logprobs and c.choices[0].logprobs.content]
    assert per_token == [e.logprob for e in content]


def test_penalties_lower_what_was_generated():
    """The host-side choice (pipeline/serving/sampling.py), on logits where one token leads by 1.0."""
    from pipeline.serving.sampling import Sampler, SamplingParams, nucleus

    logits = torch.zeros(8)
    logits[5], logits[2] = 1.0, 0.5
    plain = Sampler(SamplingParams())
    assert [plain.choose(logits) for _ in range(3)] == [5, 5, 5]
    penalized = Sampler(SamplingParams(frequency_penalty=2.0))
    assert [penalized.choose(logits) for _ in range(2)] == [5, 2]  # 5 drops to -1.0 after its first use
    presence = Sampler(SamplingParams(presence_penalty=0.6))  # once per token seen, however often
    assert [presence.choose(logits) for _ in range(4)] == [5, 2, 5, 5]  # 0.4 < 0.5; then 2 at -0.1
    kept = nucleus(torch.tensor([0.5, 0.3, 0.15, 0.05]), 0.7)
    assert kept.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    seeded = [Sampler(SamplingParams(temperature=1.0, seed=11)).choose(torch.zeros(50)) for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_n_choices_and_a_list_of_prompts_are_decoded_one_after_another(server, client):
    asked = {"model": server.version, "max_tokens": 8, "temperature": 1.5}
    one = client.completions.create(prompt="The capital of France is", seed=7, **asked)
    two = client.completions.create(prompt="The capital of France is", seed=7, n=2, **asked)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == one.choices[0].text  # choice j samples with seed + j: reproducible, and distinct
    assert two.choices[1].text == client.completions.create(prompt="The capital of France is", seed=8,
                                                            **asked).choices[0].text
    assert two.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    prompts = ["The capital of France is", "A lighthouse keeper"]
    both = client.completions.create(model=server.version, prompt=prompts, max_tokens=6)
    alone = [client.completions.create(model=server.version, prompt=p, max_tokens=6) for p in prompts]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=server.version, messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=6, temperature=1.5, seed=3, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    whole = client.chat.completions.create(model=server.version, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=6, temperature=1.5, seed=3, n=2)
    assert streamed == {c.index: c.message.content for c in whole.choices}


def test_vllms_sampling_fields_through_the_openai_client(server, client):
    asked = {"model": server.version, "prompt": "The capital of France is", "max_tokens": 6}
    greedy = client.completions.create(**asked).choices[0].text
    # top_k 1 and min_p 1 leave only the most likely token: the greedy text at any temperature
    assert client.completions.create(**asked, temperature=1.5, seed=4, extra_body={"top_k": 1}).choices[0].text \
        == greedy
    assert client.completions.create(**asked, temperature=1.5, seed=4, extra_body={"min_p": 1.0}).choices[0].text \
        == greedy
    forced = client.completions.create(**asked, logit_bias={"300": 100}, logprobs=0)
    assert set(forced.choices[0].logprobs.tokens) == {forced.choices[0].logprobs.tokens[0]}  # token 300, always
    stopped = client.completions.create(**asked, logit_bias={"300": 100}, extra_body={"stop_token_ids": [300]})
    assert stopped.choices[0].text == "" and stopped.choices[0].finish_reason == "stop"
    repeated = client.completions.create(**asked, extra_body={"repetition_penalty": 1.3})
    assert repeated.choices[0].finish_reason in ("length", "stop")
    # In range (above 0), and a prompt token's positive logit divided by it overflows: a 200, never nan's 500
    tiny = client.completions.create(**asked, temperature=1, seed=5, extra_body={"repetition_penalty": 1e-300})
    assert tiny.choices[0].finish_reason in ("length", "stop")


def test_top_k_min_p_repetition_and_logit_bias_on_the_logits():
    """The host-side choice (pipeline/serving/sampling.py), in vLLM's order."""
    from pipeline.serving.sampling import Sampler, SamplingParams, min_p, top_k

    assert top_k(torch.tensor([0.1, 0.5, 0.3, 0.1]), 2).tolist() == pytest.approx([0, 0.625, 0.375, 0])
    assert min_p(torch.tensor([0.1, 0.5, 0.3, 0.1]), 0.5).tolist() == pytest.approx([0, 0.625, 0.375, 0])
    logits = torch.tensor([0.0, 2.0, 1.9, -1.0])
    biased = Sampler(SamplingParams(logit_bias=((3, 5.0),)))
    assert biased.choose(logits) == 3
    # repetition_penalty 2 halves a positive logit of a token in the prompt: 2.0 -> 1.0, below 1.9
    assert Sampler(SamplingParams(repetition_penalty=2.0), prompt_ids=[1]).choose(logits) == 2
    assert Sampler(SamplingParams(repetition_penalty=2.0)).choose(logits) == 1  # nothing seen yet
    negative = Sampler(SamplingParams(repetition_penalty=2.0, logit_bias=((3, 2.5),)), prompt_ids=[3])
    assert negative.choose(logits) == 1  # -1.0 + 2.5 = 1.5, halved (positive): 0.75
    # A penalty tending to 0 sends a seen token's positive logit to inf: that token takes all the probability
    overflow = Sampler(SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=1), prompt_ids=[2])
    assert [overflow.choose(logits) for _ in range(5)] == [2] * 5


def test_health_and_metrics(server):
    health = server.get("/health")
    assert health.json() == {"status": "ready", "version": server.version}
    server.post("/generate", {"prompt": "hi", "max_tokens": 3})
    text = server.get("/metrics").text
    for series in ('serve_requests_total{route="/generate",status="200"}', "serve_time_to_first_token_seconds_count",
                   "serve_token_latency_seconds_bucket", "serve_tokens_generated_total", "serve_queue_depth"):
        assert series in text


def test_concurrent_clients_are_answered_or_refused_never_lost_or_mixed_up(published, tmp_path):
    """Eight clients at once against one decode and a queue of two: each gets its own prompt's greedy answer, or a
    429/503 with Retry-After; the queue never holds more than two."""
    srv = Server(published, tmp_path, "--queue-size", "2", "--queue-timeout", "60")
    try:
        srv.wait_ready()
        prompts = [f"Question {i}: {QUESTION}" for i in range(8)]
        answers: dict[int, Reply] = {}
        depth_seen: list[float] = []

        def ask(i: int) -> None:
            answers[i] = srv.post("/generate", {"prompt": prompts[i], "max_tokens": 48})

        def watch_depth(stop: threading.Event) -> None:
            while not stop.is_set():
                for line in srv.get("/metrics").text.splitlines():
                    if line.startswith("serve_queue_depth "):
                        depth_seen.append(float(line.split()[1]))
                time.sleep(0.05)

        stop = threading.Event()
        watcher = threading.Thread(target=watch_depth, args=(stop,))
        watcher.start()
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        stop.set()
        watcher.join()
        assert sorted(answers) == list(range(8))
        served = {i: r.json()["text"] for i, r in answers.items() if r.status == 200}
        refused = [r for r in answers.values() if r.status != 200]
        assert all(r.status in (429, 503) and int(r.headers["retry-after"]) >= 1 for r in refused)
        assert refused and len(served) >= 3 and max(depth_seen) <= 2
        for i, text in served.items():  # each its own prompt's answer, asked again alone
            assert srv.post("/generate", {"prompt": prompts[i], "max_tokens": 48}).json()["text"] == text
    finally:
        assert srv.stop() == 0


def test_the_queue_bound_holds_for_requests_arriving_together_and_while_lines_change_hands():
    """Admission alone, on one event loop, with a queue of two and two lines: six requests arriving in one tick (two
    may wait beyond the two free lines: four taken, two refused); then, with both lines in use, the bound is the queue
    alone; a line freed lets one more in. The counts are kept synchronously (CI once let five wait behind a bound of
    two when it was read from a lock's state)."""
    import asyncio

    from prometheus_client import CollectorRegistry, Gauge

    from pipeline.serving.admission import Admission
    from pipeline.serving.schemas import Refused

    async def scenario() -> tuple[list, list, list, int]:
        admission = Admission(queue_size=2, queue_timeout_s=30, lines=2,
                              depth=Gauge("d", "", registry=CollectorRegistry()))

        def enter():
            try:
                return admission.enter()
            except Refused as exc:
                return exc

        together = [enter() for _ in range(6)]
        tickets = [t for t in together if not isinstance(t, Refused)]
        waits = [asyncio.ensure_future(admission.wait(t)) for t in tickets]
        for ticket in tickets[:2]:  # the engine gives two of them a line each
            admission.line_taken()
            admission.started(ticket)
        await asyncio.sleep(0.01)
        full = [enter()]  # two wait, no line free: refused
        admission.line_freed()  # one finished: its line is free, one more may wait for it
        full += [enter(), enter()]
        for ticket in tickets[2:] + [full[1]]:
            admission.line_taken()
            admission.started(ticket)
        await asyncio.gather(*waits, admission.wait(full[1]))
        return together, full, list(admission.waiting), admission.held

    together, full, waiting, held = asyncio.run(scenario())
    assert [isinstance(t, Refused) for t in together] == [False] * 4 + [True] * 2
    assert all(t.status == 429 for t in together[4:])
    assert isinstance(full[0], Refused) and not isinstance(full[1], Refused) and isinstance(full[2], Refused)
    assert waiting == [] and held == 4


def test_a_request_that_took_a_line_no_longer_counts_as_waiting_before_its_handler_resumes():
    """One line and a queue of two: the engine gives the first request the line and the handler that awaits it has not
    resumed yet (it runs on a later tick); two more arrive in that tick. Both may wait: the first holds the line and
    waits no longer. CI once refused the third, counting the first both in the line and in the queue."""
    import asyncio

    from prometheus_client import CollectorRegistry, Gauge

    from pipeline.serving.admission import Admission
    from pipeline.serving.schemas import Refused

    async def scenario() -> list:
        admission = Admission(queue_size=2, queue_timeout_s=30, lines=1,
                              depth=Gauge("d", "", registry=CollectorRegistry()))
        first = admission.enter()
        waiter = asyncio.ensure_future(admission.wait(first))
        await asyncio.sleep(0)  # the handler awaits its line
        admission.line_taken()
        admission.started(first)
        arrivals = []
        for _ in range(3):  # same tick: the first's handler has not resumed
            try:
                arrivals.append(admission.enter())
            except Refused as exc:
                arrivals.append(exc)
        await waiter
        return arrivals + [len(admission.waiting)]

    *arrivals, waiting = asyncio.run(scenario())
    assert [isinstance(a, Refused) for a in arrivals] == [False, False, True]
    assert waiting == 2


def test_a_client_that_disconnects_stops_its_decode(server):
    def generated() -> float:
        return metric(server, "serve_tokens_generated_total ")

    before = generated()
    body = {"model": server.version, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 480,
            "stream": True}
    connection = HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(6):
        response.readline()
    # A second client gives up while it waits in the queue: its turn, if granted meanwhile, must pass on.
    queued = HTTPConnection("127.0.0.1", server.port, timeout=60)
    queued.request("POST", "/generate", json.dumps({"prompt": "hi", "max_tokens": 400}),
                   {"Content-Type": "application/json"})
    time.sleep(0.5)
    queued.close()
    connection.close()
    # Both connections are closed: the next request is served as soon as the decodes stop, long before 480 tokens.
    assert server.post("/generate", {"prompt": "hi", "max_tokens": 2}, timeout=60).status == 200
    assert generated() - before < 200


def test_clients_that_abandon_big_non_streamed_requests_leave_no_work_behind(server):
    """Non-streamed requests of 16 prompts x n=16 (256 sequences each), their clients gone 0.3 s later: every
    sequence ends before its next token, and a short request is answered at once. Before, the server decoded for
    nobody for minutes (bench/serve_abandoned.py: 297 tokens in the 20 s after, 4-token requests 3.6x slower)."""
    def generated() -> float:
        return metric(server, "serve_tokens_generated_total ")

    body = json.dumps({"model": server.version, "prompt": [f"Tell me about {i}." for i in range(16)], "n": 16,
                       "max_tokens": 200})
    for _ in range(3):
        gone = HTTPConnection("127.0.0.1", server.port, timeout=60)
        gone.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        time.sleep(0.3)
        gone.close()
    time.sleep(1.0)
    before = generated()
    started = time.monotonic()
    assert server.post("/generate", {"prompt": "hi", "max_tokens": 4}, timeout=30).status == 200
    assert time.monotonic() - started < 10
    time.sleep(2.0)
    assert generated() - before == 4  # the short request's own tokens, none for the clients that left


def test_sigterm_finishes_the_running_request_and_refuses_the_waiting_one(published, tmp_path):
    srv = Server(published, tmp_path)
    srv.wait_ready()
    answers: dict[str, Reply] = {}

    def ask(name: str) -> None:
        answers[name] = srv.post("/generate", {"prompt": QUESTION, "max_tokens": 480})

    def until(name: str, above: float) -> None:
        # by what the server reports, not by sleeping: a fast CPU decoded a whole sleep's worth of tokens (the
        # tiny model at ~180 tokens/s finished "running" before the signal, and "waiting" ran in its place)
        deadline = time.monotonic() + 60
        while metric(srv, name + " ") <= above:
            assert time.monotonic() < deadline, f"{name} never rose above {above}"
            time.sleep(0.02)

    before = metric(srv, "serve_tokens_generated_total ")
    running = threading.Thread(target=ask, args=("running",))
    running.start()
    until("serve_tokens_generated_total", before)  # decoding
    waiting = threading.Thread(target=ask, args=("waiting",))
    waiting.start()
    until("serve_queue_depth", 0)  # queued behind it (batch 1: one cache line)
    srv.proc.send_signal(signal.SIGTERM)
    running.join(timeout=120)
    waiting.join(timeout=120)
    assert srv.proc.wait(timeout=60) == 0, srv.log.read_text()
    assert answers["running"].status == 200 and answers["running"].json()["new_tokens"] == 480
    assert answers["waiting"].status == 503 and "shutting down" in answers["waiting"].json()["error"]["message"]
    with pytest.raises(ConnectionRefusedError):
        HTTPConnection("127.0.0.1", srv.port, timeout=5).request("GET", "/health")


@pytest.mark.slow  # `make test-slow`: a server of its own, beside the SIGTERM test above that make test runs
def test_sigterm_closes_a_stream_its_client_stopped_reading_after_the_grace(published, tmp_path):
    """A client that stops reading a long stream kept a SIGTERM'd server up forever (no graceful-shutdown bound):
    past --shutdown-grace its request is cancelled and the server exits 0."""
    srv = Server(published, tmp_path, "--shutdown-grace", "2")
    srv.wait_ready()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", srv.port))
    body = json.dumps({"model": srv.version, "prompt": QUESTION, "max_tokens": 480, "n": 16, "stream": True}).encode()
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(2.0)  # decoding, its answer unread
    srv.proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        assert srv.proc.wait(timeout=60) == 0, srv.log.read_text()
    finally:
        stalled.close()
    assert time.monotonic() - started < 30  # the grace (2 s), then the decode thread's last step and the ranks' exit
    assert "Traceback" not in srv.log.read_text()


def test_start_up_refusals(published, tmp_path):
    folder, weights, version = published
    base = ["serve", "--checkpoint", str(weights), "--dest", str(tmp_path), "--port", str(free_port())]
    missing = cli(*base, str(folder), "999_fp32", "--allow-unsigned", timeout=120)
    assert missing.returncode == 1 and f"its versions are ['{version}']" in missing.stderr
    unsigned = cli(*base, str(folder), VARIANT, timeout=120)
    assert unsigned.returncode == 1 and "--allow-unsigned" in unsigned.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        busy = cli("serve", str(folder), VARIANT, "--checkpoint", str(weights), "--port", port, "--allow-unsigned",
                   timeout=120)
    assert busy.returncode == 1 and f"--port {port}: 127.0.0.1:{port} is in use" in busy.stderr
    pulled = Path(cli("pull", str(folder), version, "--dest", str(tmp_path), "--allow-unsigned").stdout.strip())
    (pulled / "tp_1.pt").write_bytes(b"tampered")
    tampered = cli(*base, str(pulled), timeout=120)
    assert tampered.returncode == 1 and "rank file" in tampered.stderr and "listening" not in tampered.stderr
    for refused in (missing, unsigned, busy, tampered):
        assert "Traceback" not in refused.stderr


def test_the_host_keeps_only_the_embedding_tables(published, tmp_path):
    """A device-prefill build: the serving host holds the two embedding tables (mapped, read by row), no decoder
    layer; the sizes it logs are the tables' bytes in the checkpoint."""
    from safetensors import safe_open

    from pipeline.recipe.host import EMBEDDING_TABLES
    from pipeline.serving.engine import Engine

    folder, weights, version = published
    pulled = Path(cli("pull", str(folder), version, "--dest", str(tmp_path), "--allow-unsigned").stdout.strip())
    engine = Engine(pulled, weights)
    engine.verify()
    engine.load()
    try:
        with safe_open(weights / "model.safetensors", framework="pt") as f:
            tables = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()
                         if k.endswith(EMBEDDING_TABLES))
        assert engine.host_bytes == {"embedding_tables_mapped": tables}
        assert engine.batch.runner.host_prefill is None
    finally:
        engine.close()


@pytest.mark.parametrize("variant", ["512_fp32", "256_bf16_host"])
def test_a_neuron_build_serves_on_the_stand_in_sdk(neuron_checked, variant, tmp_path):
    """The neuron backend's own loader behind the server (the stand-in SDK, tp_degree 2, a NeuronCore lease): a
    device-prefill and a host-prefill build answer as generate does; the host-prefill one says what its float model
    holds on the host."""
    from openai import OpenAI

    from pipeline.artifact.archive import extract_verified
    from pipeline.artifact.manifest import Manifest

    from . import fake_sdk

    out, root = neuron_checked
    assert out.returncode == 0, out.stderr[-3000:]
    dist = root / "gemma4_tiny" / variant / "dist"
    manifest = Manifest.read(dist / "manifest.json")
    pulled = tmp_path / manifest.archive.root
    extract_verified(dist / manifest.archive.name, manifest, pulled)
    manifest.write(pulled.with_name(pulled.name + ".manifest.json"))
    weights = root / "gemma4_tiny" / "weights"
    env = fake_sdk.env(fake_sdk.install(tmp_path / "sdk"))
    srv = Server((None, weights, manifest.version), tmp_path, source=[str(pulled)], env=env)
    try:
        srv.wait_ready()
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=manifest.version, max_tokens=8,
                                              messages=[{"role": "user", "content": QUESTION}])
        text = chat.choices[0].message.content
    finally:
        assert srv.stop() == 0, srv.log.read_text()
    generated = subprocess.run([sys.executable, "-m", "pipeline", "generate", str(pulled), "--checkpoint",
                                str(weights), "--prompt", QUESTION, "--max-new-tokens", "8"], cwd=REPO,
                               capture_output=True, text=True, env={**os.environ, **env}, timeout=600)
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert generated.stdout.rstrip("\n") == text
    said = srv.log.read_text()
    assert ("host prefill model" in said) == (variant == "256_bf16_host"), said
    assert "embedding tables mapped" in said


# -- a batched build: continuous batching ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batched_server(tiny_batched, tmp_path_factory):
    """``serve`` on the tiny 512_fp32 at batch 4 (four cache lines), a queue of eight."""
    from .conftest import BATCHED

    root, _ = tiny_batched
    version = json.loads((root / "gemma4_tiny" / BATCHED / "publish.json").read_text())["tag"]
    published = (root / "published", root / "gemma4_tiny" / "weights", version)
    dest = tmp_path_factory.mktemp("dest")
    srv = Server(published, dest, source=[str(root / "published"), BATCHED, "--dest", str(dest), "--allow-unsigned"])
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def test_eight_clients_at_once_each_get_what_they_get_alone(batched_server):
    """Eight clients at once against four lines, through the openai client: greedy chats of different lengths,
    seeded samples, a stream, ``n`` choices and a list of prompts. Every answer is byte-identical to the same request
    sent alone; the four lines were all in use and decode steps held several sequences; /health kept answering."""
    from openai import OpenAI

    srv = batched_server
    client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    topics = ["the sea", "a lighthouse", "mountains", "the capital of France"]

    def ask(i: int) -> object:
        if i < 3:
            return client.chat.completions.create(
                model=srv.version, messages=[{"role": "user", "content": f"Tell me about {topics[i]}."}],
                max_tokens=24 + 8 * i).choices[0].message.content
        if i < 5:
            return client.completions.create(model=srv.version, prompt=f"Once upon a time, {topics[i - 3]}",
                                             max_tokens=20, temperature=1.2, seed=40 + i).choices[0].text
        if i == 5:
            return "".join(chunk.choices[0].text for chunk in client.completions.create(
                model=srv.version, prompt="A lighthouse keeper", max_tokens=28, stream=True) if chunk.choices)
        if i == 6:
            reply = client.completions.create(model=srv.version, prompt="The sea", max_tokens=16, temperature=1.0,
                                              seed=5, n=3)
            return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
        reply = client.completions.create(model=srv.version, prompt=["North", "South"], max_tokens=12)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    seen = {"lines": 0.0, "health_ms": 0.0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            assert srv.get("/health").status == 200
            seen["health_ms"] = max(seen["health_ms"], 1e3 * (time.perf_counter() - started))
            seen["lines"] = max(seen["lines"], metric(srv, "serve_batch_slots_in_use "))
            time.sleep(0.02)

    answers: dict[int, object] = {}
    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, ask(i))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    watcher.join()
    assert sorted(answers) == list(range(8))
    for i in range(8):  # the same request again, alone
        assert ask(i) == answers[i], i
    assert seen["lines"] == 4 and metric(srv, "serve_batch_slots ") == 4
    occupancy = {line.split('le="')[1].split('"')[0]: float(line.split()[-1])
                 for line in srv.get("/metrics").text.splitlines() if line.startswith("serve_batch_occupancy_bucket")}
    assert occupancy["3.0"] < occupancy["4.0"]  # some decode steps held all four sequences
    assert seen["health_ms"] < 1000


def test_a_client_that_leaves_frees_its_lines_for_the_sequences_waiting(batched_server):
    """Two streamed clients of three choices each: the first takes three lines, the second the fourth (its other
    two choices wait); the first leaves, and its lines go to the second's waiting choices; the second leaves, and
    every line is free again."""
    srv = batched_server
    body = {"model": srv.version, "prompt": "The sea", "max_tokens": 480, "n": 3, "stream": True}
    leaving = HTTPConnection("127.0.0.1", srv.port, timeout=60)
    leaving.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert leaving.getresponse().status == 200
    staying = HTTPConnection("127.0.0.1", srv.port, timeout=60)
    staying.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = staying.getresponse()
    assert response.status == 200
    deadline = time.monotonic() + 60
    while metric(srv, "serve_batch_slots_in_use ") < 4 and time.monotonic() < deadline:
        response.readline()  # the second client's choices take the lines the first left free (one of its three waits)
    assert metric(srv, "serve_batch_slots_in_use ") == 4
    generated = metric(srv, "serve_tokens_generated_total ")
    leaving.close()  # its three choices end before their next token; the staying client's other two take two lines
    deadline = time.monotonic() + 30
    while metric(srv, "serve_batch_slots_in_use ") != 3 and time.monotonic() < deadline:
        response.readline()
    assert metric(srv, "serve_batch_slots_in_use ") == 3
    # a few steps of at most four sequences, not the hundreds of tokens the three left had to go
    assert metric(srv, "serve_tokens_generated_total ") - generated < 100
    staying.close()
    deadline = time.monotonic() + 30
    while metric(srv, "serve_batch_slots_in_use ") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(srv, "serve_batch_slots_in_use ") == 0
