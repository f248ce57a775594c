"""Sampling for ``serve``: the next token chosen on the host from the decode step's logits, as OpenAI's API asks.

The compiled graphs return the full fp32 logits row of every step (validation compares them), so sampling needs no
other graph: ``Sampler.choose`` is given the row and returns the token, which the next decode step is fed.

- ``temperature`` 0 (or omitted) is greedy: the argmax, the text validation checked; so is any temperature below
  ``SAMPLING_EPS`` (vLLM's rule: dividing by 1e-308 overflows the logits to inf, and their softmax to nan). Above it
  the logits are divided by it and a token is drawn from their softmax, restricted to the smallest set of most likely
  tokens whose probabilities reach ``top_p`` (nucleus sampling).
- ``top_k`` keeps the ``k`` most likely tokens (0 or -1: all), ``min_p`` those at least ``min_p`` times as likely as
  the most likely one: both after temperature and before ``top_p``, in vLLM's order.
- ``logit_bias`` (token id -> -100..100, OpenAI's) is added to the logits before anything else, greedy included.
- ``min_tokens`` (vLLM's): until that many tokens are chosen, the end-of-sequence and stop tokens (``held_off``)
  cannot be (their logits are -inf), greedy included.
- ``repetition_penalty`` (vLLM's, after the CTRL paper: 1 is off) divides the positive logits and multiplies the
  negative ones of every token in the prompt or already generated; ``presence_penalty`` and ``frequency_penalty``
  lower the logit of every token already generated in this request (once, and once per occurrence: OpenAI's
  definition). All before the choice, greedy included, as vLLM applies them.
- ``seed`` (a signed 64-bit integer, as vLLM takes it) makes a request reproducible: one ``torch.Generator`` per
  request, seeded with it, is the only source of randomness (the same request with the same seed gives the same text,
  on the same build). Without a seed, one is drawn from the operating system.
- ``logprobs``: the log-probabilities of the chosen token and of the ``top_logprobs`` most likely ones, from the
  model's own distribution at that step (the log-softmax of the logits, before temperature, penalties and top_p), so
  they read the same whatever the sampling settings.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs (completions: 5)
SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS (vllm/sampling_params.py): a temperature below it is greedy
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM's bounds (torch.iinfo(torch.long)); manual_seed overflows past them


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int | None = None
    """None: no log-probabilities; 0: the chosen token's; N: and the N most likely tokens'."""
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    held_off: tuple[int, ...] = ()
    """The tokens ``min_tokens`` holds off: the request's end-of-sequence and stop tokens."""

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def changes_logits(self) -> bool:
        """Whether anything moves the logits before the choice (else greedy is the build's own argmax)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.min_tokens and self.held_off))


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


class Sampler:
    """One request's choices, in order; ``choose`` is called once per step, from the decode thread."""

    def __init__(self, params: SamplingParams, prompt_ids: tuple[int, ...] | list[int] = ()):
        self.params = params
        self.prompt_ids = set(prompt_ids)  # what repetition_penalty counts beside the generated tokens
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator().manual_seed(seed)
        self.counts: Counter[int] = Counter()
        self.logprobs: list[TokenLogprob] = []

    def choose(self, logits: torch.Tensor) -> int:
        p = self.params
        raw = logits.detach().float().view(-1)
        scores = self._penalized(raw)
        if p.greedy:
            token = int(torch.argmax(scores))
        else:
            probs = torch.softmax(finite(scores / p.temperature), dim=-1)
            if 0 < p.top_k < probs.numel():
                probs = top_k(probs, p.top_k)
            if p.min_p > 0:
                probs = min_p(probs, p.min_p)
            if p.top_p < 1.0:
                probs = nucleus(probs, p.top_p)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        self.counts[token] += 1
        if p.top_logprobs is not None:
            self.logprobs.append(token_logprob(raw, token, p.top_logprobs))
        return token

    def _penalized(self, raw: torch.Tensor) -> torch.Tensor:
        p = self.params
        if not p.changes_logits:
            return raw
        scores = raw.clone()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
            scores[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=scores.dtype)
        if p.repetition_penalty != 1.0 and (self.prompt_ids or self.counts):
            ids = torch.tensor(sorted(self.prompt_ids | set(self.counts)), dtype=torch.long)
            picked = scores[ids]
            scores[ids] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if p.held_off and self.counts.total() < p.min_tokens:
            scores[torch.tensor(p.held_off, dtype=torch.long)] = -torch.inf
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            tokens = torch.tensor(list(self.counts), dtype=torch.long)
            counts = torch.tensor([self.counts[t] for t in self.counts], dtype=scores.dtype)
            scores[tokens] -= p.frequency_penalty * counts + p.presence_penalty
        return scores


def finite(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` with an overflow to +-inf held at the largest finite value: the limit of what was asked. A
    repetition_penalty of 1e-300 (in range: vLLM takes any above 0) divides a positive logit to inf, whose softmax is
    nan; held finite, the tokens it favours take all the probability between them, as a penalty tending to 0 would
    give."""
    limit = torch.finfo(scores.dtype).max
    return scores.clamp(-limit, limit)


def top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``probs`` kept on its ``k`` most likely tokens, renormalized."""
    kept = torch.zeros_like(probs)
    best = torch.topk(probs, k)
    kept[best.indices] = best.values
    return kept / kept.sum()


def min_p(probs: torch.Tensor, ratio: float) -> torch.Tensor:
    """``probs`` kept on the tokens at least ``ratio`` times as likely as the most likely one, renormalized."""
    kept = torch.where(probs >= ratio * probs.max(), probs, torch.zeros_like(probs))
    return kept / kept.sum()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` kept on the smallest set of most likely tokens whose total reaches ``top_p`` (at least one),
    renormalized."""
    ordered, order = torch.sort(probs, descending=True)
    before = torch.cumsum(ordered, dim=-1) - ordered  # the mass of the tokens ahead of each
    keep = before < top_p
    keep[0] = True
    kept = torch.zeros_like(probs)
    kept[order[keep]] = ordered[keep]
    return kept / kept.sum()


def token_logprob(raw: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logprobs = torch.log_softmax(raw, dim=-1)
    best = torch.topk(logprobs, top).indices.tolist() if top else []
    return TokenLogprob(token, float(logprobs[token]), tuple((t, float(logprobs[t])) for t in best))
