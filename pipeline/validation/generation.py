"""Greedy generation of one sequence over a loaded build: what validation measures and ``generate`` prints.

The decode engine (pipeline/decoding/) with one sequence in it. Device prefill runs the prompt through the ``prefill``
graph bucket by bucket (the last bucket padded, padding positions continue the sequence so they are never attended
to), then decodes one token per ``decode`` call. Host prefill runs the prompt through the host's prefill model, seeds
the ranks with its KV heads, then decodes on the ranks. Teacher forcing (``forced``) feeds a given continuation
instead of the build's own choices, recording what the build would have picked at each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from pipeline.backends.base import RankRunner
from pipeline.core.errors import InputError
from pipeline.core.shape import BuildShape
from pipeline.decoding.engine import BatchEngine
from pipeline.decoding.runner import DECODE_THREADS, BatchRunner
from pipeline.decoding.sequence import Sequence, Step
from pipeline.host.procinfo import usable_cpus
from pipeline.recipe.host import HostEmbeddings, HostPrefill
from pipeline.validation.records import ThreadPolicy


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int]  # what the build chose at each step (its argmax), EOS included when it stopped there
    logits: torch.Tensor  # [steps, vocab] fp32, the logits behind each choice
    ttft_s: float  # prompt in to first token out, host work included
    decode_s: list[float] = field(default_factory=list)  # wall time of each decode call
    prefill_calls: int = 0


def new_tokens_problem(prompt_len: int, asked: int | None, kv_max: int, setting: str) -> str | None:
    """Why ``asked`` new tokens after a prompt of ``prompt_len`` do not fit a cache of ``kv_max`` (None when they do):
    the one rule of ``generate`` and ``serve`` (a request is never clamped in silence). ``setting`` names what the
    user set (``--max-new-tokens``, ``max_tokens``)."""
    room = kv_max - prompt_len
    if asked is not None and asked < 1:
        return f"{setting} {asked}: ask for at least 1 new token"
    if room < 1:
        return (f"the prompt is {prompt_len} tokens; this build's cache holds {kv_max} (variant.kv_max) with room for "
                "at least one new token: shorten it")
    if asked is not None and asked > room:
        return (f"{setting} {asked} with a prompt of {prompt_len} tokens needs {prompt_len + asked} cache positions; "
                f"this build holds {kv_max} (variant.kv_max): ask for at most {room}")
    return None


def check_fits(prompt_len: int, max_new_tokens: int, shape: BuildShape) -> None:
    """Refuse a request the build's static KV cache cannot hold."""
    if prompt_len < 1:
        raise InputError("the prompt is empty")
    if max_new_tokens < 1:
        raise InputError(f"{max_new_tokens} new tokens asked for: ask for at least 1")
    if prompt_len + max_new_tokens > shape.kv_max:
        raise InputError(
            f"a prompt of {prompt_len} tokens plus {max_new_tokens} new tokens needs {prompt_len + max_new_tokens} "
            f"cache positions but variant.kv_max is {shape.kv_max}: shorten the prompt, lower the new-token count, "
            "or build a variant with a larger kv_max"
        )


class Generator:
    """Greedy generation of one sequence at a time over a loaded build: validation's and ``generate``'s loop. The
    decode engine's, with one sequence in it (pipeline/decoding/): at batch above 1 it holds line 0 and the other
    lines decode nothing. The thread policy is per phase: host prefill with every usable CPU (``prefill_threads``),
    decode steps with ``decode_threads`` (``DECODE_THREADS``); both are recorded by validation (``threads``)."""

    def __init__(self, runner: RankRunner, embed: HostEmbeddings, eos_ids: tuple[int, ...], pad_id: int,
                 host_prefill: HostPrefill | None = None, prefill_threads: int | None = None,
                 decode_threads: int = DECODE_THREADS):
        self.batch = BatchRunner(runner, embed, pad_id, host_prefill, prefill_threads, decode_threads)
        self.runner = runner
        self.shape: BuildShape = runner.shape
        self.eos_ids = frozenset(eos_ids)
        self.prefill_threads, self.decode_threads = self.batch.prefill_threads, self.batch.decode_threads

    @property
    def threads(self) -> ThreadPolicy:
        """The thread policy, as validation.json records it."""
        host_prefill, decode = self.batch.threads
        return ThreadPolicy(host_prefill=host_prefill, decode=decode, usable_cpus=usable_cpus())

    def sequence(self, prompt: list[int], max_new_tokens: int, forced: list[int] | None = None,
                 choose: Callable[[torch.Tensor], int] | None = None) -> Sequence:
        """A sequence of ``prompt`` for this build's engine, refused if the cache cannot hold it."""
        check_fits(len(prompt), len(forced) if forced is not None else max_new_tokens, self.shape)
        return Sequence(list(prompt), max_new_tokens, self.eos_ids, choose, forced)

    def steps(self, prompt: list[int], max_new_tokens: int, forced: list[int] | None = None,
              choose: Callable[[torch.Tensor], int] | None = None) -> Iterator[Step]:
        """Greedy decode up to ``max_new_tokens`` (stopping after an EOS), or teacher-forced over ``forced``: one
        ``Step`` per token, as it is chosen. The first step's time is the prefill's. ``choose`` picks each token from
        the step's logits on the host instead of the argmax (the graphs are the same, nothing is compiled for it);
        validation never passes it."""
        seq = self.sequence(prompt, max_new_tokens, forced, choose)
        taken: list[Step] = []
        seq.on_step = lambda _, step: taken.append(step) is None  # collected, then handed out as the engine goes
        engine = BatchEngine(self.batch)
        engine.submit(seq)
        while engine.step() or taken:
            yield from taken
            taken.clear()
        if seq.error is not None:
            raise seq.error

    def generate(self, prompt: list[int], max_new_tokens: int, forced: list[int] | None = None) -> Generation:
        """Every step of ``steps`` at once: the tokens, their logits and the timing."""
        taken = list(self.steps(prompt, max_new_tokens, forced))
        return generation_of(len(prompt), taken)


def generation_of(prompt_len: int, taken: list[Step]) -> Generation:
    """A sequence's steps as one ``Generation``."""
    return Generation(prompt_len, [s.token for s in taken], torch.stack([s.logits for s in taken]),
                      taken[0].seconds, [s.seconds for s in taken[1:]], taken[0].prefill_calls)
