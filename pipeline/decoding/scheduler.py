"""The batching policy: which call into the build comes next. No I/O, no model: a pure function of the sequences.

A build decodes ``lines`` sequences at once (its ``batch_size``; its KV caches hold one sequence per line). Each call
``next`` answers is one of:

- ``Prefill(sequence)``: one prefill call of one sequence (a bucket of its prompt on the device, or its whole prompt on
  the host, seeded into its line). One sequence prefills at a time, holding its line meanwhile.
- ``Decode(sequences)``: one decode step of every sequence decoding, each a token.

The rules:

1. **Admission**: a waiting sequence takes a free line when no other sequence is prefilling. Among the waiting, the
   one whose group (a request) holds the fewest lines goes first, then the one whose group has been given the fewest
   lines, then the earliest: a request of many sequences (``n`` choices, a list of prompts) cannot keep another from
   its first line, and requests waiting side by side take lines in turn. A group's count of lines given starts, when
   it arrives, at the least of the groups already there (start-time fair queuing), so a request of 256 sequences
   neither starves a newcomer nor is starved by a stream of them. (Before, at batch 1, a newcomer waited for every
   sequence of a request of 16 prompts x n=16 queued ahead of it.)
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
        self._given: dict[int, int] = {}  # lines given to each group present (by id), fair-queuing counts

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
        given = self._given_counts()
        chosen = min(self.waiting, key=lambda s: (held.get(id(s.group), 0), given[id(s.group)]))  # earliest of equals
        given[id(chosen.group)] += 1
        self.waiting.remove(chosen)
        line = self.lines.index(None)
        decoding = sum(s.status == Status.decoding for s in self.held)
        chosen.line, chosen.status, chosen.admitted = line, Status.prefilling, Admission(line, line in self._used,
                                                                                         decoding)
        self.lines[line] = chosen
        self._used.add(line)
        return chosen

    def _given_counts(self) -> dict[int, int]:
        """Lines given per group present: groups gone are forgotten (an id may be reused), a newcomer starts at the
        least count of those present."""
        present = {id(s.group) for s in self.waiting} | {id(s.group) for s in self.held}
        self._given = {g: n for g, n in self._given.items() if g in present}
        start = min(self._given.values(), default=0)
        for g in present:
            self._given.setdefault(g, start)
        return self._given
