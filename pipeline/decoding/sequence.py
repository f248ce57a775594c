"""One sequence's state: its prompt, how it chooses and stops, and where it is. No I/O, no model.

The scheduler moves a sequence through its states (``Status``); the runner reads its next inputs; the engine appends
each token it chooses and finishes it. A sequence in a batch is decoded exactly as it would be alone: nothing here
depends on the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeline.core.choices import StrEnum


class Status(StrEnum):
    waiting = "waiting"
    """Submitted; no cache line yet."""
    prefilling = "prefilling"
    """Holds a cache line; its prompt is prefilled one call at a time."""
    decoding = "decoding"
    """Its prompt is in its line; it takes one token per decode step."""
    finished = "finished"


class Finish(StrEnum):
    """Why a sequence ended."""

    stop = "stop"
    """An end-of-sequence token, or its consumer stopped it (a stop string, a stop token)."""
    length = "length"
    """It decoded as many tokens as it asked for."""
    cancelled = "cancelled"
    """Its client went away, or its request was given up."""
    error = "error"
    """Its own host-side work raised (``Sequence.error``): this sequence only."""
    failed = "failed"
    """The build's ranks failed: every sequence ends so."""


@dataclass(frozen=True)
class Admission:
    """When a sequence took its cache line: which, whether another sequence had held it before (in this engine), and
    how many sequences were decoding then."""

    line: int
    line_reused: bool
    decoding_beside: int


@dataclass(frozen=True)
class Step:
    """One token of a sequence: the token chosen, the logits behind it, and the time it took."""

    token: int
    logits: torch.Tensor
    """``[vocab]`` fp32: the build's logits at this step."""
    seconds: float
    """The first token's: its prompt's prefill, every call and its host work; after it, the decode step's call."""
    prefill_calls: int = 0
    """The first token's: how many prefill calls its prompt took (0 for host prefill)."""


@dataclass(eq=False)
class Sequence:
    """A prompt to decode, and the state of its decoding.

    ``choose`` picks a token from a step's logits (serve's sampling); None takes the build's own argmax, what
    validation checks. ``forced`` feeds these tokens instead of the sequence's own choices (teacher forcing), one
    step each. ``group`` is what admission is fair between (serve's requests). The hooks are called in the engine's
    thread: ``on_start`` when it takes its cache line, ``on_step`` with each step as it is chosen (it returns False
    to end the sequence there: a stop string), ``on_end`` once it has ended, however it ended (``finish``).
    """

    prompt: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    choose: Callable[[torch.Tensor], int] | None = None
    forced: list[int] | None = None
    group: object = None
    on_step: Callable[[Sequence, Step], bool] | None = None
    on_start: Callable[[Sequence], None] | None = None
    on_end: Callable[[Sequence], None] | None = None

    status: Status = Status.waiting
    line: int | None = None
    """The cache line it holds (prefilling or decoding)."""
    admitted: Admission | None = None
    prefilled: int = 0
    """Prompt tokens prefilled so far."""
    prefill_calls: int = 0
    prefill_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    """Every token chosen, in order (an end-of-sequence token included when it stopped there)."""
    finish: Finish | None = None
    error: BaseException | None = None
    cancel_requested: bool = False
    """Set from any thread (``cancel``); the engine ends the sequence before its next call."""

    @property
    def steps(self) -> int:
        """How many tokens it decodes at most: one per forced token, else ``max_new_tokens``."""
        return len(self.forced) if self.forced is not None else self.max_new_tokens

    def cancel(self) -> None:
        self.cancel_requested = True

    def next_input(self) -> tuple[int, int]:
        """The token the next decode step feeds and its cache position: the last token chosen (or forced), right
        after the prompt and the tokens fed before it."""
        step = len(self.tokens)
        fed = self.forced[step - 1] if self.forced is not None else self.tokens[-1]
        return fed, len(self.prompt) + step - 1

    def done_after(self, token: int) -> Finish | None:
        """Whether the token just chosen ends it: its budget is spent, or it ended the text (greedy or sampled;
        teacher forcing runs every forced step)."""
        if self.forced is None and token in self.eos_ids:
            return Finish.stop
        if len(self.tokens) >= self.steps:
            return Finish.length
        return None
