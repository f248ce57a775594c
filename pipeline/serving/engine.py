"""The decode engine behind ``serve``: one verified build, loaded once, decoding every request's sequences together.

``Engine.load`` does what ``generate`` does (verify the rank files against the manifest, by pull's record where
they are unchanged since it hashed them, load them with the backend that built them, open the checkpoint for the
host's embedding lookups), then decodes a warm-up token so that the first request does not pay for the graphs' first
run. The host keeps only what it computes: the token and per-layer embedding tables stay in their safetensors files,
memory-mapped, and only the rows of the tokens it embeds are read (``recipe/host.HostEmbeddings``); no decoder layer
and no float copy of a table is on the host. A host-prefill build
is the exception: the prompt runs through the prefill model on the host (``HostPrefill``), which holds every decoder
layer at the build's dtype; ``host_bytes`` says how much, and ``serve`` logs it.

The build's ``batch_size`` sequences decode at once (pipeline/decoding/: the scheduler admits, interleaves prefill
calls with decode steps, and frees a finished sequence's line for the next). ``serve_forever`` runs that loop in the
thread that loaded the build (a backend's rank processes end with the thread that started them). Requests arrive as
token ids (``chat_ids`` and ``text_ids`` make them); each of their sequences leaves as a stream of ``Piece``s
(``TextStream``, in the loop's thread): the text each token adds, found by decoding everything generated so far (a
token may end in the middle of a character), held back while it could be the start of a stop string.

What fails is told apart: an exception raised by the build's ranks (``RanksFailed``: a rank process died, the
runtime raised) leaves nothing to serve with, and the server stops taking requests; anything else a sequence's decode
raises (its sampler, the tokenizer, the host's prefill of its prompt) is that sequence's error, and the others go on.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifact.manifest import Manifest, manifest_of
from pipeline.artifact.pulled import reverified
from pipeline.backends import get_backend
from pipeline.core.errors import InputError
from pipeline.core.fsutil import sha256_file
from pipeline.core.log import log
from pipeline.core.shape import BuildShape
from pipeline.decoding.engine import BatchEngine
from pipeline.decoding.runner import DECODE_THREADS, BatchRunner
from pipeline.decoding.sequence import Finish as SequenceFinish
from pipeline.decoding.sequence import Sequence, Step
from pipeline.serving.sampling import Sampler, TokenLogprob, token_logprob
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


class TextStream:
    """One sequence's text as it decodes, handed to ``sink`` as it comes (``Piece`` per token, then one ``Finish``, or
    the exception that ended it), from the engine's thread. Ends the sequence at one of ``ends`` (end-of-sequence and
    stop tokens; not shown), or at a stop string (the text cut before it); neither before ``min_tokens`` tokens (the
    sampler holds those tokens off meanwhile)."""

    def __init__(self, engine: Engine, stops: tuple[str, ...], ends: frozenset[int], sampler: Sampler | None,
                 sink: Callable[[Piece | Finish | BaseException], None],
                 ended: Callable[[Sequence], None] | None = None, min_tokens: int = 0):
        self.engine, self.stops, self.ends, self.sampler, self.sink = engine, stops, ends, sampler, sink
        self.ended, self.min_tokens = ended, min_tokens
        self.tokens: list[int] = []
        self.shown = 0  # characters of the generated text already given out
        self.done = False

    def on_step(self, seq: Sequence, step: Step) -> bool:
        logprob = self.sampler.logprobs[-1] if self.sampler and self.sampler.params.top_logprobs is not None else None
        if step.token in self.ends:
            # a token of its own (counted, its log-probability given, as vLLM gives it), with no text
            self.sink(Piece(step.token, "", step.seconds, logprob))
            self._finish("stop", self.engine.text(self.tokens)[self.shown:], len(self.tokens) + 1)
            return False
        self.tokens.append(step.token)
        text = self.engine.text(self.tokens)
        stops = self.stops if len(self.tokens) >= self.min_tokens else ()
        cut = min((text.find(s, max(0, self.shown - len(s))) for s in stops if s in text), default=-1)
        if cut >= 0:
            self.sink(Piece(step.token, "", step.seconds, logprob))
            self._finish("stop", text[self.shown:cut], len(self.tokens))
            return False
        ready = len(text) - held_back(text, self.stops)
        self.sink(Piece(step.token, text[self.shown:ready], step.seconds, logprob))
        self.shown = max(self.shown, ready)
        return True

    def on_end(self, seq: Sequence) -> None:
        self._last_item(seq)
        if self.ended is not None:
            self.ended(seq)

    def _last_item(self, seq: Sequence) -> None:
        if self.done:
            return
        if seq.finish == SequenceFinish.length:
            self._finish("length", self.engine.text(self.tokens)[self.shown:], len(self.tokens))
        elif seq.finish == SequenceFinish.cancelled:
            self._finish("cancelled", "", len(self.tokens))
        elif seq.finish == SequenceFinish.stop:  # its end-of-sequence token: on_step said so already
            self._finish("stop", self.engine.text(self.tokens)[self.shown:], len(self.tokens))
        else:  # its own error, or the ranks'
            self.done = True
            self.sink(seq.error)

    def _finish(self, reason: str, text: str, count: int) -> None:
        self.done = True
        self.sink(Finish(reason, text, count))


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


def require_the_builds_checkpoint(checkpoint: Path, manifest: Manifest) -> None:
    """The checkpoint ``manifest``'s build was made from, by its config.json's digest (``model.config_digest``): the
    host looks up its embedding tables and the ranks were traced for its shapes, so another model's checkpoint (E2B's
    for an E4B build) would fail mid-request or, at equal widths, decode the wrong text without a word."""
    found = sha256_file(checkpoint / "config.json")
    model = manifest.model
    if found == model.config_digest:
        return
    where = (f"for the release: hf download {model.hub_id} --revision {model.revision} --local-dir DIR"
             if model.hub_id and model.revision else f"the {model.name} model stage's weights/ folder")
    raise InputError(f"--checkpoint {checkpoint} is not the checkpoint {manifest.version} was built from: its "
                     f"config.json has sha256 {found[:12]}, {model.name}'s ({model.hub_id or 'generated'}) "
                     f"{model.config_digest[:12]}. Point --checkpoint at the files the build was made from ({where})")


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
    """A loaded build. ``load`` and ``close`` bracket its life; ``serve_forever`` runs its decode loop in the thread
    that loaded it; ``submit`` and a sequence's ``cancel`` are called from any thread."""

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
        self.batch: BatchEngine | None = None
        self.on_decode: Callable[[int], None] | None = None
        """Called with the sequences of each decode step (serve's occupancy metric); set before ``load``."""
        self.eos_ids: frozenset[int] = frozenset()
        self.host_bytes: dict[str, int] = {}
        self.max_prompt_chars = 0  # set by load
        self.vocab_size = 0  # set by load
        # The tokenizer is used from two threads (the server's tokenizing thread, the decode thread); transformers
        # reconfigures the Rust tokenizer on each call (truncation, padding), which another thread's call at the same
        # moment meets as "Already borrowed" (huggingface/tokenizers#537): one at a time.
        self._tokenizer_lock = threading.Lock()

    @property
    def lines(self) -> int:
        """How many sequences decode at once: the build's ``batch_size``."""
        return self.shape.batch_size

    def verify(self, full: bool = False) -> str:
        """The rank files against the manifest, and the checkpoint (its tokenizer; the build's model): before any
        load. A pulled version's files are checked by their record when unchanged since pull hashed them
        (pipeline/artifact/pulled.py), else (or with ``full``) hashed; returns which."""
        require_tokenizer(self.checkpoint)
        require_the_builds_checkpoint(self.checkpoint, self.manifest)  # before gigabytes are hashed
        self.build, how = reverified(self.rank_dir, self.manifest, full)
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
        self.eos_ids = frozenset(spec.eos_token_ids)
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
        self.batch = BatchEngine(BatchRunner(runner, HostEmbeddings(ckpt, spec), spec.pad_token_id, host,
                                             decode_threads=self.decode_threads), on_decode=self.on_decode)
        started = time.perf_counter()
        warmup = Sequence(self.chat_ids([{"role": "user", "content": WARMUP_CONTENT}]), 2, self.eos_ids)
        self.batch.run(warmup)
        if warmup.error is not None:
            raise warmup.error
        log.info("serve: %s loaded (%d sequence%s at once); warm-up (a prefill and a decode step) took %.0f ms",
                 self.version, self.lines, "s" if self.lines > 1 else "", (time.perf_counter() - started) * 1e3)

    def serve_forever(self) -> None:
        """The decode loop, until ``stop`` and every sequence it holds is done (or the ranks fail: ``RanksFailed``)."""
        self.batch.serve_forever()

    def stop(self) -> None:
        if self.batch is not None:
            self.batch.stop()

    def close(self) -> None:
        self._stack.close()

    # -- requests -------------------------------------------------------------------------------------------------

    def chat_ids(self, messages: list[dict]) -> list[int]:
        with self._tokenizer_lock:
            return messages_ids(self.tokenizer, messages)

    def text_ids(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A raw completion prompt: the tokenizer's own special tokens (BOS), no chat template."""
        with self._tokenizer_lock:
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def tokenizer_info(self) -> dict:
        """vLLM's ``/tokenizer_info``: the tokenizer's special tokens and chat template (lm-eval's remote tokenizer
        reads them), and the longest sequence this build holds."""
        tok = self.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": tok.chat_template, "model_max_length": self.shape.kv_max}

    def room(self, prompt_tokens: int) -> int:
        """How many new tokens the build's cache holds after a prompt of this length."""
        return self.shape.kv_max - prompt_tokens

    def token_text(self, token: int) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode([token])

    def text(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def sequence(self, ids: list[int], max_tokens: int, stops: tuple[str, ...], sink, sampler: Sampler | None = None,
                 stop_ids: tuple[int, ...] = (), group: object = None, on_start=None, on_end=None,
                 ignore_eos: bool = False, min_tokens: int = 0) -> Sequence:
        """A sequence decoding ``ids`` (greedy, or ``sampler``'s choices) whose text goes to ``sink``
        (``TextStream``), with the caller's hooks (``on_end`` after its last item); ``submit`` it. ``ignore_eos``:
        end-of-sequence tokens end nothing (vLLM's, for fixed output lengths)."""
        eos = frozenset() if ignore_eos else self.eos_ids
        stream = TextStream(self, stops, eos | frozenset(stop_ids), sampler, sink, on_end, min_tokens)
        return Sequence(list(ids), max_tokens, eos, sampler.choose if sampler else None, group=group,
                        on_step=stream.on_step, on_start=on_start, on_end=stream.on_end)

    def scoring(self, ids: list[int], top: int, scores: list[TokenLogprob], group: object = None, on_start=None,
                on_end=None) -> Sequence:
        """A sequence that scores the prompt ``ids``: its first token prefilled, then every next one fed by a decode
        step (teacher forcing, as validation's), each step's logits giving the log-probability of the token fed
        after it, appended to ``scores`` (with the ``top`` most likely). No graph of its own: a prompt of n tokens
        costs a prefill call and n - 1 decode steps."""

        def on_step(seq: Sequence, step: Step) -> bool:
            scores.append(token_logprob(step.logits, ids[len(seq.tokens)], top))
            return True

        return Sequence(list(ids[:1]), len(ids) - 1, frozenset(), forced=list(ids[1:]), group=group,
                        on_step=on_step, on_start=on_start, on_end=on_end)

    def submit(self, *sequences: Sequence) -> None:
        self.batch.submit(*sequences)

    def wake(self) -> None:
        """Have the loop look at its sequences again (one was cancelled)."""
        self.batch.wake()
