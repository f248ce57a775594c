"""Greedy generation over a loaded build: the serving loop that validation measures.

Device prefill runs the prompt through the ``prefill`` graph bucket by bucket (the last bucket padded, padding
positions continue the sequence so they are never attended to), then decodes one token per ``decode`` call. Host
prefill runs the prompt through the host's prefill model, seeds each rank with its KV heads, then decodes on the ranks.
Teacher forcing (``forced``) feeds a given continuation instead of the build's own choices, recording what the build
would have picked at each step.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from pipeline.backends.base import RankRunner
from pipeline.core.errors import InputError
from pipeline.core.shape import BuildShape
from pipeline.host.procinfo import usable_cpus
from pipeline.recipe.host import HostEmbeddings, HostPrefill, split_kv_for_ranks
from pipeline.validation.records import ThreadPolicy


@dataclass
class Generation:
    prompt_len: int
    tokens: list[int]  # what the build chose at each step (its argmax), EOS included when it stopped there
    logits: torch.Tensor  # [steps, vocab] fp32, the logits behind each choice
    ttft_s: float  # prompt in to first token out, host work included
    decode_s: list[float] = field(default_factory=list)  # wall time of each decode call
    prefill_calls: int = 0


@dataclass
class Step:
    token: int  # the build's choice (its argmax), or what ``choose`` picked from the logits
    logits: torch.Tensor  # [vocab] fp32, the logits behind it
    seconds: float  # the prefill's wall time (host work included) for the first step, the decode call's after
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


DECODE_THREADS = 1
"""torch's threads on the host while decoding, unless the caller sets another count (validate.throughput.
decode_threads, generate's and serve's --decode-threads): a step only looks up two embedding rows and takes an
argmax of the returned logits, and more threads contend with the ranks (the cpu backend's processes, the Neuron
runtime's threads). bench/decode_threads.py measures 1, 2 and every usable CPU side by side (docs/performance.md)."""


def host_prefill_threads() -> int:
    """torch's threads for host prefill: every CPU this process may use. The host's prefill model runs the whole prompt
    through every layer in fp32; the seed recipe measured 6.3 s on 1 thread and 1.4 s on 32 for a 16-token prompt of
    E4B (optb_server_tp.py, which sets ``torch.set_num_threads(os.cpu_count())``)."""
    return usable_cpus()


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads, then restore the count it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Generator:
    """Greedy generation over a loaded build. The thread policy is per phase: host prefill with every usable CPU
    (``prefill_threads``), decode steps with ``decode_threads`` (``DECODE_THREADS``); both are recorded by validation
    (``threads``)."""

    def __init__(self, runner: RankRunner, embed: HostEmbeddings, eos_ids: tuple[int, ...], pad_id: int,
                 host_prefill: HostPrefill | None = None, prefill_threads: int | None = None,
                 decode_threads: int = DECODE_THREADS):
        self.runner = runner
        self.shape: BuildShape = runner.shape
        self.embed = embed
        self.eos_ids = set(eos_ids)
        self.pad_id = pad_id
        if self.shape.prefill == "host" and host_prefill is None:
            raise ValueError("a prefill=host build needs the host's prefill model (HostPrefill)")
        self.host_prefill = host_prefill
        self.prefill_threads = prefill_threads or host_prefill_threads()
        self.decode_threads = decode_threads

    @property
    def threads(self) -> ThreadPolicy:
        """The thread policy, as validation.json records it."""
        return ThreadPolicy(host_prefill=self.prefill_threads if self.shape.prefill == "host" else 0,
                            decode=self.decode_threads, usable_cpus=usable_cpus())

    def _prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.shape.prefill == "host":
            with torch_threads(self.prefill_threads):
                logits, token, caches = self.host_prefill.prefill(prompt)
            self.runner.seed_kv(split_kv_for_ranks(caches, self.shape.tp_degree, self.shape.torch_dtype))
            return logits, token, 0
        self.runner.reset()
        bucket = self.shape.bucket
        calls = math.ceil(len(prompt) / bucket)
        for c in range(calls):
            chunk = prompt[c * bucket:(c + 1) * bucket]
            padded = chunk + [self.pad_id] * (bucket - len(chunk))
            embeds, per_layer = self.embed(padded)
            positions = torch.arange(c * bucket, (c + 1) * bucket).view(1, -1)
            logits, token = self.runner.prefill(embeds, per_layer, positions, torch.tensor([len(chunk) - 1]))
        return logits, token, calls

    def steps(self, prompt: list[int], max_new_tokens: int, forced: list[int] | None = None,
              choose: Callable[[torch.Tensor], int] | None = None) -> Iterator[Step]:
        """Greedy decode up to ``max_new_tokens`` (stopping after an EOS), or teacher-forced over ``forced``: one
        ``Step`` per token, as it is chosen (the server streams them). The first step's time is the prefill's.
        ``choose`` (serve's sampling) picks each token from the step's logits on the host instead of the argmax:
        the graphs are the same, nothing is compiled for it; validation never passes it."""
        steps = len(forced) if forced is not None else max_new_tokens
        check_fits(len(prompt), steps, self.shape)
        started = time.perf_counter()
        with torch_threads(self.decode_threads):  # the device prefill's host work, and every decode step below
            logits, token, calls = self._prefill(prompt)
            token = choose(logits.view(-1)) if choose else int(token)
        yield Step(token, logits.view(-1), time.perf_counter() - started, calls)
        fed, position = int(token), len(prompt)
        for step in range(1, steps):
            fed = forced[step - 1] if forced is not None else fed
            if forced is None and fed in self.eos_ids:
                return
            t0 = time.perf_counter()
            with torch_threads(self.decode_threads):
                embeds, per_layer = self.embed([fed])
                logits, token = self.runner.decode(embeds, per_layer, torch.tensor([[position]]), torch.tensor([0]))
                token = choose(logits.view(-1)) if choose else int(token)
            yield Step(token, logits.view(-1), time.perf_counter() - t0)
            fed = int(token)
            position += 1

    def generate(self, prompt: list[int], max_new_tokens: int, forced: list[int] | None = None) -> Generation:
        """Every step of ``steps`` at once: the tokens, their logits and the timing."""
        taken = list(self.steps(prompt, max_new_tokens, forced))
        return Generation(len(prompt), [s.token for s in taken], torch.stack([s.logits for s in taken]),
                          taken[0].seconds, [s.seconds for s in taken[1:]], taken[0].prefill_calls)
