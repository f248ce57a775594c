"""The decode loop: ``BatchEngine.step`` asks the scheduler for the next call, has the runner make it, and gives each
sequence its token. ``generate`` and validation step it until their sequences are done; ``serve`` runs it in a thread
of its own (``serve_forever``), its requests submitting sequences from other threads.

A sequence's token is chosen here, in the engine's thread: ``Sequence.choose`` (serve's sampler) from its row of the
logits, else the build's own argmax; then ``Sequence.on_step`` sees it. What a sequence's own host work raises (its
sampler, its consumer, the host's prefill of its prompt) ends that sequence (``Finish.error``) and the others go on;
what the ranks raise (``RanksFailed``) ends every sequence (``Finish.failed``) and is raised again: nothing more can
be decoded. A cancelled sequence (``Sequence.cancel``, from any thread) ends before the next call and gives its line
back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pipeline.decoding.runner import BatchRunner, RanksFailed
from pipeline.decoding.scheduler import Prefill, Scheduler
from pipeline.decoding.sequence import Finish, Sequence, Status, Step


class BatchEngine:
    """One loaded build's decoding. ``step`` is called from one thread at a time; ``submit`` and ``Sequence.cancel``
    from any."""

    def __init__(self, runner: BatchRunner, on_decode: Callable[[int], None] | None = None):
        self.runner = runner
        self.scheduler = Scheduler(runner.lines)
        self.on_decode = on_decode
        """Called (in the engine's thread) with the number of sequences in each decode step."""
        self.failure: RanksFailed | None = None
        self._incoming: list[Sequence] = []
        self._wake = threading.Condition()
        self._stopping = False

    # -- from any thread ----------------------------------------------------------------------------------------------

    def submit(self, *sequences: Sequence) -> None:
        with self._wake:
            if self.failure is not None:
                raise self.failure
            self._incoming.extend(sequences)
            self._wake.notify()

    def wake(self) -> None:
        """Look at the sequences again (one was cancelled while the engine waited)."""
        with self._wake:
            self._wake.notify()

    def stop(self) -> None:
        """End ``serve_forever`` once the sequences it holds are done (new ones are still taken until then)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    # -- the loop -----------------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """One call into the build (or none): False when there was nothing to do."""
        self._take_incoming()
        self._drop_cancelled()
        action = self.scheduler.next()
        if action is None:
            return False
        try:
            if isinstance(action, Prefill):
                self._prefill(action.sequence)
            else:
                self._decode(action.sequences)
        except RanksFailed as exc:
            self._fail_all(exc)
            raise
        return True

    def run(self, *sequences: Sequence) -> None:
        """Submit ``sequences`` and step until the engine is idle (validation's and ``generate``'s use)."""
        self.submit(*sequences)
        while self.step():
            pass

    def serve_forever(self) -> None:
        """Step while there is work; wait for more; return once ``stop`` was called and nothing is left, or raise
        ``RanksFailed``."""
        while True:
            if self.step():
                continue
            with self._wake:
                if self._incoming or any(s.cancel_requested for s in self.scheduler.held + self.scheduler.waiting):
                    continue
                if self._stopping and self.scheduler.idle:
                    return
                self._wake.wait(timeout=0.5)

    # -- what one call does -------------------------------------------------------------------------------------------

    def _prefill(self, seq: Sequence) -> None:
        try:
            if seq.prefill_calls == 0 and seq.prefilled == 0 and seq.on_start is not None:
                seq.on_start(seq)  # its first call: it has just taken its line
            out = self.runner.prefill(seq)
        except RanksFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - the host's work for this sequence: its error, not the others'
            self._end(seq, Finish.error, exc)
            return
        if out is not None:
            seq.status = Status.decoding
            logits, token = out
            self._deliver(seq, logits, int(token), seq.prefill_s, seq.prefill_calls)

    def _decode(self, seqs: tuple[Sequence, ...]) -> None:
        try:
            logits, tokens, seconds = self.runner.decode(seqs)
        except RanksFailed:
            raise
        except Exception as exc:  # noqa: BLE001 - host work shared by the step: its sequences end, the engine goes on
            for seq in seqs:
                self._end(seq, Finish.error, exc)
            return
        if self.on_decode:
            self.on_decode(len(seqs))
        for seq in seqs:  # each its own row (a copy: a step kept by its sequence keeps no other row alive)
            self._deliver(seq, logits[seq.line].clone(), int(tokens[seq.line]), seconds)

    def _deliver(self, seq: Sequence, logits, greedy: int, seconds: float, prefill_calls: int = 0) -> None:
        """Choose ``seq``'s token from its logits, hand the step to it, and end it if it is done."""
        try:
            started = time.perf_counter()
            token = seq.choose(logits) if seq.choose is not None else greedy
            step = Step(token, logits, seconds + (time.perf_counter() - started), prefill_calls)
            seq.tokens.append(token)
            wants_more = seq.on_step(seq, step) if seq.on_step is not None else True
        except Exception as exc:  # noqa: BLE001 - its sampler's or its consumer's error: this sequence only
            self._end(seq, Finish.error, exc)
            return
        finish = seq.done_after(token) or (None if wants_more is not False else Finish.stop)
        if finish is not None:
            self._end(seq, finish)

    # -- bookkeeping --------------------------------------------------------------------------------------------------

    def _take_incoming(self) -> None:
        with self._wake:
            incoming, self._incoming = self._incoming, []
        for seq in incoming:
            self.scheduler.add(seq)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.scheduler.held + self.scheduler.waiting if s.cancel_requested]:
            self._end(seq, Finish.cancelled)

    def _end(self, seq: Sequence, finish: Finish, error: BaseException | None = None) -> None:
        self.scheduler.remove(seq)
        seq.status, seq.finish, seq.error = Status.finished, finish, error
        if seq.on_end is not None:
            seq.on_end(seq)

    def _fail_all(self, exc: RanksFailed) -> None:
        with self._wake:
            self.failure = exc
            incoming, self._incoming = self._incoming, []
        for seq in [*self.scheduler.held, *self.scheduler.waiting, *incoming]:
            self._end(seq, Finish.failed, exc)
