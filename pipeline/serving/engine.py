"""The decode engine behind ``serve``: one verified build, loaded once, decoding one request at a time.

``Engine.load`` does what ``generate`` does (verify the rank files against the manifest, by pull's record where
they are unchanged since it hashed them, load them with the backend that built them, open the checkpoint for the
host's embedding lookups), then decodes a warm-up token so that the first request does not pay for the graphs' first
run. The host keeps only what it computes: the token and per-layer embedding tables stay in their safetensors files,
memory-mapped, and only the rows of the tokens it embeds are read (``recipe/host.HostEmbeddings``); no decoder layer
and no float copy of a table is on the host. A host-prefill build
is the exception: the prompt runs through the prefill model on the host (``HostPrefill``), which holds every decoder
layer at the build's dtype; ``host_bytes`` says how much, and ``serve`` logs it.

Requests arrive as token ids (``chat_ids`` and ``text_ids`` make them) and leave as a stream of ``Piece``s: the text
each token adds, found by decoding everything generated so far (a token may end in the middle of a character), held
back while it could be the start of a stop string. ``decode`` runs in one worker thread; ``cancel`` stops it between
two tokens.

What fails is told apart: an exception raised by the build's ranks (``RanksFailed``: a rank process died, the
runtime raised) leaves nothing to serve with, and the server stops taking requests; anything else a decode raises
(the sampler, the tokenizer, the host's own prefill) is that one request's error, and the next request is served.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifact.manifest import Manifest, manifest_of
from pipeline.artifact.pulled import reverified
from pipeline.backends import get_backend
from pipeline.core.errors import InputError
from pipeline.core.log import log
from pipeline.core.shape import BuildShape
from pipeline.decoding.runner import DECODE_THREADS
from pipeline.serving.sampling import Sampler, TokenLogprob
from pipeline.validation.generation import Generator
from pipeline.validation.prompts import messages_ids

WARMUP_CONTENT = "Hi"  # the warm-up request: a prefill and one decode step, so both graphs have run once


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it completes (empty while held back)."""

    token: int
    text: str
    seconds: float  # the prefill's time for the first token, the decode step's after
    logprob: TokenLogprob | None = None  # when the request asked for log-probabilities


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop" (an end-of-sequence token or a stop string), "length" (max_tokens reached), "cancelled"
    text: str  # what was held back and is now released (the stop string itself never is)
    completion_tokens: int


def text_prefix_of(checkpoint: Path) -> str:
    """Where the decoder's tensors live: the multimodal release nests them under ``model.language_model.``."""
    model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type")
    return "model.language_model." if model_type == "gemma4" else "model."


def require_tokenizer(checkpoint: Path) -> None:
    """The checkpoint's tokenizer, or a refusal naming what is missing (transformers would otherwise fall back to a
    sentencepiece conversion and fail with its own traceback)."""
    if not (checkpoint / "config.json").is_file():
        raise InputError(f"--checkpoint {checkpoint} has no config.json: point it at the base model's checkpoint "
                         "folder")
    if not (checkpoint / "tokenizer.json").is_file() and not (checkpoint / "tokenizer.model").is_file():
        raise InputError(f"--checkpoint {checkpoint} has no tokenizer (tokenizer.json or tokenizer.model): download "
                         "the base model's tokenizer files into it (the model stage's weights/ folder has them)")


def max_prompt_chars(tokenizer, kv_max: int) -> int:
    """The most characters a prompt could have and still fit ``kv_max`` tokens: each token stands for at most as many
    characters as its vocabulary entry's spelling (``▁the`` for " the"; a byte-fallback ``<0x41>`` for one), so a
    longer text cannot tokenize into ``kv_max`` tokens. Twice that, in case a tokenizer's normalizer folds several
    characters into one. Lets ``serve`` refuse an oversized prompt without tokenizing it."""
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return 2 * longest * kv_max


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` must wait: an incomplete character (the tokenizer shows it as
    U+FFFD until its last byte arrives), or a tail that could be the start of a stop string."""
    if text.endswith("\ufffd"):
        return len(text) - len(text.rstrip("\ufffd"))
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class Engine:
    """A loaded build. ``load`` and ``close`` bracket its life; ``decode`` is called from one thread at a time."""

    def __init__(self, rank_dir: Path, checkpoint: Path, text_prefix: str | None = None,
                 decode_threads: int = DECODE_THREADS):
        self.rank_dir = rank_dir
        self.checkpoint = checkpoint
        self.text_prefix = text_prefix
        self.decode_threads = decode_threads
        self.manifest = Manifest.read(manifest_of(rank_dir))
        self.version: str = self.manifest.version
        self.shape: BuildShape = self.manifest.shape
        self._stack = contextlib.ExitStack()
        self.tokenizer = None
        self.generator: Generator | None = None
        self.host_bytes: dict[str, int] = {}
        self.max_prompt_chars = 0  # set by load
        self.vocab_size = 0  # set by load
        # The tokenizer is used from two threads (the server's tokenizing thread, the decode thread); transformers
        # reconfigures the Rust tokenizer on each call (truncation, padding), which another thread's call at the same
        # moment meets as "Already borrowed" (huggingface/tokenizers#537): one at a time.
        self._tokenizer_lock = threading.Lock()

    def verify(self, full: bool = False) -> str:
        """The rank files against the manifest, and the checkpoint's tokenizer: before any load. A pulled version's
        files are checked by their record when unchanged since pull hashed them (pipeline/artifact/pulled.py), else
        (or with ``full``) hashed; returns which."""
        self.build, how = reverified(self.rank_dir, self.manifest, full)
        require_tokenizer(self.checkpoint)
        return how

    def load(self) -> None:
        from transformers import AutoTokenizer

        from pipeline.recipe.checkpoint import Checkpoint
        from pipeline.recipe.host import EMBEDDING_TABLES, HostEmbeddings, HostPrefill
        from pipeline.recipe.spec import load_spec

        self.tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.shape.kv_max)
        spec = load_spec(self.checkpoint)
        self.vocab_size = spec.vocab_size  # what logit_bias and stop_token_ids may name
        ckpt = self._stack.enter_context(
            Checkpoint(self.checkpoint, self.text_prefix or text_prefix_of(self.checkpoint)))
        ckpt.verify(spec)
        self.host_bytes = {"embedding_tables_mapped": sum(ckpt.stored_bytes(name, spec) for name in EMBEDDING_TABLES)}
        host = None
        if self.shape.prefill == "host":
            host = HostPrefill(ckpt, spec, self.shape.kv_max, self.shape.torch_dtype)
            self.host_bytes["host_prefill_model"] = sum(
                t.numel() * t.element_size() for t in host.model.state_dict().values())
        runner = self._stack.enter_context(get_backend(self.manifest.backend).load(self.build, self.shape))
        self.generator = Generator(runner, HostEmbeddings(ckpt, spec), spec.eos_token_ids, spec.pad_token_id, host,
                                   decode_threads=self.decode_threads)
        started = time.perf_counter()
        for _ in self.decode(self.chat_ids([{"role": "user", "content": WARMUP_CONTENT}]), 2, (), threading.Event()):
            pass
        log.info("serve: %s loaded; warm-up (a prefill and a decode step) took %.0f ms", self.version,
                 (time.perf_counter() - started) * 1e3)

    def close(self) -> None:
        self._stack.close()

    # -- requests -------------------------------------------------------------------------------------------------

    def chat_ids(self, messages: list[dict]) -> list[int]:
        with self._tokenizer_lock:
            return messages_ids(self.tokenizer, messages)

    def text_ids(self, prompt: str) -> list[int]:
        """A raw completion prompt: the tokenizer's own special tokens (BOS), no chat template."""
        with self._tokenizer_lock:
            return list(self.tokenizer(prompt)["input_ids"])

    def room(self, prompt_tokens: int) -> int:
        """How many new tokens the build's cache holds after a prompt of this length."""
        return self.shape.kv_max - prompt_tokens

    def token_text(self, token: int) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode([token])

    def decode(self, ids: list[int], max_tokens: int, stops: tuple[str, ...], cancel: threading.Event,
               sampler: Sampler | None = None, stop_ids: tuple[int, ...] = ()) -> Iterator[Piece | Finish]:
        """Decode (greedy, or ``sampler``'s choices): a ``Piece`` per token, then one ``Finish``. Stops at an
        end-of-sequence token or one of ``stop_ids`` (not shown), at a stop string (cut before it), after
        ``max_tokens``, or at the first step after ``cancel`` is set."""
        tokens: list[int] = []
        shown = 0  # characters of the generated text already given out
        choose = sampler.choose if sampler else None
        for step in self.generator.steps(ids, max_tokens, choose=choose):
            if step.token in self.generator.eos_ids or step.token in stop_ids:
                text = self._text(tokens)
                yield Finish("stop", text[shown:], len(tokens) + 1)
                return
            tokens.append(step.token)
            text = self._text(tokens)
            logprob = sampler.logprobs[-1] if sampler and sampler.params.top_logprobs is not None else None
            cut = min((text.find(s, max(0, shown - len(s))) for s in stops if s in text), default=-1)
            if cut >= 0:
                yield Piece(step.token, "", step.seconds, logprob)
                yield Finish("stop", text[shown:cut], len(tokens))
                return
            ready = len(text) - held_back(text, stops)
            yield Piece(step.token, text[shown:ready], step.seconds, logprob)
            shown = max(shown, ready)
            if cancel.is_set():
                yield Finish("cancelled", "", len(tokens))
                return
        yield Finish("length", self._text(tokens)[shown:], len(tokens))

    def _text(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)
