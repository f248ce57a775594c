"""The batching policy: which call into the build comes next. No I/O, no model: a pure function of the sequences.

A build decodes ``lines`` sequences at once (its ``batch_size``; its KV caches hold one sequence per line). Each call
``next`` answers is one of:

- ``Prefill(sequence)``: one prefill call of one sequence (a bucket of its prompt on the device, or its whole prompt on
  the host, seeded into its line). One sequence prefills at a time, holding its line meanwhile.
- ``Decode(sequences)``: one decode step of every sequence decoding, each a token.

The rules:

1. **Admission**: a waiting sequence takes a free line when no other sequence is prefilling. Among the waiting, the
   one whose group (a request) holds the fewest lines goes first, then the one whose group was given a line least
   recently (a newcomer counts as given one when it arrives), then the earliest: a request of many sequences (``n``
   choices, a list of prompts) cannot keep another from its first line, and requests waiting side by side take lines
   round-robin, so a request of 256 sequences neither starves a newcomer nor is starved by a stream of them. (Before,
   at batch 1, a newcomer waited for every sequence of a request of 16 prompts x n=16 queued ahead of it.)
2. **Interleaving**: between two decode steps, at most one prefill call. A long prompt is prefilled a bucket at a
   time with the others' decode steps in between, so a running sequence waits at most one prefill call (one bucket,
   or one host prefill) for its next token; with nothing decoding, prefill calls run back to back.
3. **Leaving**: a finished or cancelled sequence gives its line back at once (``remove``); the next step does not
   include it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.decoding.sequence import Admission, Sequence, Status


@dataclass(frozen=True)
class Prefill:
    sequence: Sequence


@dataclass(frozen=True)
class Decode:
    sequences: tuple[Sequence, ...]
    """In line order."""


class Scheduler:
    """The sequences of one build: those holding its ``lines`` cache lines, and those waiting for one."""

    def __init__(self, lines: int):
        self.lines: list[Sequence | None] = [None] * lines
        self.waiting: list[Sequence] = []
        self._prefilled_last = False
        self._used: set[int] = set()  # lines a sequence has held
        # Each group present's turn: when it was last given a line, or first seen waiting (by id, with the group
        # itself: an id is reused once its object is gone). ``_turn`` counts the lines given.
        self._turns: dict[int, tuple[object, int]] = {}
        self._turn = 0

    def add(self, sequence: Sequence) -> None:
        sequence.status = Status.waiting
        self.waiting.append(sequence)

    def remove(self, sequence: Sequence) -> None:
        """Take a sequence out, wherever it is, freeing its line."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        if sequence.line is not None and self.lines[sequence.line] is sequence:
            self.lines[sequence.line] = None
        sequence.line = None

    @property
    def held(self) -> list[Sequence]:
        """The sequences holding a line, in line order."""
        return [s for s in self.lines if s is not None]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.held

    def next(self) -> Prefill | Decode | None:
        """The next call, or None when there is nothing to do."""
        decoding = tuple(s for s in self.lines if s is not None and s.status == Status.decoding)
        prefilling = next((s for s in self.lines if s is not None and s.status == Status.prefilling), None)
        if prefilling is None:
            prefilling = self._admit()
        if prefilling is not None and not (decoding and self._prefilled_last):
            self._prefilled_last = True
            return Prefill(prefilling)
        self._prefilled_last = False
        return Decode(decoding) if decoding else None

    def _admit(self) -> Sequence | None:
        """The waiting sequence that takes a free line now (rule 1), or None."""
        if not self.waiting or None not in self.lines:
            return None
        held: dict[int, int] = {}
        for s in self.held:
            held[id(s.group)] = held.get(id(s.group), 0) + 1
        turns = self._group_turns()
        chosen = min(self.waiting, key=lambda s: (held.get(id(s.group), 0), turns[id(s.group)]))  # earliest of equals
        self._turn += 1
        self._turns[id(chosen.group)] = (chosen.group, self._turn)
        self.waiting.remove(chosen)
        line = self.lines.index(None)
        decoding = sum(s.status == Status.decoding for s in self.held)
        chosen.line, chosen.status, chosen.admitted = line, Status.prefilling, Admission(line, line in self._used,
                                                                                         decoding)
        self.lines[line] = chosen
        self._used.add(line)
        return chosen

    def _group_turns(self) -> dict[int, int]:
        """Each group present's turn (groups gone forgotten; a newcomer's is now): the least recent goes first, so
        requests waiting side by side take lines round-robin, a newcomer after those served before it arrived."""
        present = {id(s.group): s.group for s in [*self.waiting, *self.held]}
        self._turns = {g: e for g, e in self._turns.items() if g in present and e[0] is present[g]}
        for g, group in present.items():
            self._turns.setdefault(g, (group, self._turn))
        return {g: turn for g, (_, turn) in self._turns.items()}
