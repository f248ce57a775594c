"""The one place that knows a build's graphs: it turns sequences into the graphs' inputs and their outputs into each
sequence's logits.

- A **prefill call** of a sequence. Device prefill runs its prompt through the prefill graphs into its cache line,
  ``bucket`` tokens per call while more remain, then the rest (all of a short prompt) in the smallest bucket of the
  ladder that holds it (``variant.smaller_buckets``), padded, the padding's positions continuing the sequence so that
  nothing attends to them; host prefill runs the whole prompt through the host's prefill model and seeds the
  sequence's line of every rank with its KV heads (head r to rank r). At batch 1 the caches are zeroed before a
  prompt, as they always were; at batch above 1 the other lines are in use and only the sequence's own is written.
- A **decode step**: one token per line, each at its sequence's own position; a line with no sequence decodes the
  padding token and writes nothing (its ``seq_ids`` entry is -1). Rank 0's logits come back one row per line.

Every call into the ranks is guarded: what the ranks raise is ``RanksFailed`` (the build is gone or mid-step, nothing
more can be decoded), anything else is the host's own work for a sequence, which fails that sequence only.

The thread policy is per phase: host prefill with every usable CPU, everything else with ``decode_threads``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import torch

from pipeline.backends.base import RankRunner
from pipeline.core.errors import PipelineError
from pipeline.decoding.sequence import Sequence
from pipeline.host import bf16_matmul
from pipeline.host.procinfo import usable_cpus
from pipeline.recipe.host import HostEmbeddings, HostPrefill, split_kv_for_ranks

DECODE_THREADS = 1
"""torch's threads on the host while decoding, unless the caller sets another count (validate.throughput.
decode_threads, generate's and serve's --decode-threads): a step only looks up embedding rows and takes an argmax of
the returned logits, and more threads contend with the ranks (the cpu backend's processes, the Neuron runtime's
threads). bench/decode_threads.py measures 1, 2 and every usable CPU side by side (docs/performance.md)."""


def host_prefill_threads() -> int:
    """torch's threads for host prefill: every CPU this process may use. The host's prefill model runs the whole prompt
    through every layer; the seed recipe measured 6.3 s on 1 thread and 1.4 s on 32 for a 16-token prompt of E4B
    (optb_server_tp.py, which sets ``torch.set_num_threads(os.cpu_count())``)."""
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


class RanksFailed(PipelineError):
    """A call into the build's ranks failed: the ranks may be mid-step or gone, so nothing more can be decoded."""


class BatchRunner:
    """A loaded build's graphs, called for sequences. ``lines`` is the build's ``batch_size``."""

    def __init__(self, runner: RankRunner, embed: HostEmbeddings, pad_id: int, host_prefill: HostPrefill | None = None,
                 prefill_threads: int | None = None, decode_threads: int = DECODE_THREADS):
        self.runner = runner
        self.shape = runner.shape
        self.lines = self.shape.batch_size
        self.embed = embed
        self.pad_id = pad_id
        if self.shape.prefill == "host" and host_prefill is None:
            raise ValueError("a prefill=host build needs the host's prefill model (HostPrefill)")
        self.host_prefill = host_prefill
        self.host_bf16_matmul = bf16_matmul.chosen() if host_prefill is not None else None
        """How host prefill runs bf16 matmuls of many rows on this CPU (pipeline/host/bf16_matmul.py)."""
        self.prefill_threads = prefill_threads or host_prefill_threads()
        self.decode_threads = decode_threads

    def _ranks(self, call: str, *args):
        try:
            return getattr(self.runner, call)(*args)
        except Exception as exc:
            raise RanksFailed(f"the build's ranks failed in {call}: {type(exc).__name__}: {exc}") from exc

    def _seq_ids(self, values: list[int]) -> torch.Tensor | None:
        return torch.tensor(values) if self.shape.batched else None

    # -- prefill ------------------------------------------------------------------------------------------------------

    def prefill(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One prefill call of ``seq`` into its line: ``(logits [vocab], greedy token)`` once its whole prompt is in,
        else None (more calls to come). Its time and calls add up on the sequence."""
        started = time.perf_counter()
        if self.shape.prefill == "host":
            out = self._host_prefill(seq)
        else:
            with torch_threads(self.decode_threads):
                out = self._device_prefill_call(seq)
        seq.prefill_s += time.perf_counter() - started
        return out

    def _host_prefill(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        with torch_threads(self.prefill_threads), bf16_matmul.eager(self.host_bf16_matmul):
            logits, token, caches = self.host_prefill.prefill(seq.prompt)
        self._ranks("seed_kv", split_kv_for_ranks(caches, self.shape.tp_degree, self.shape.torch_dtype), seq.line)
        seq.prefilled = len(seq.prompt)
        return logits.view(-1), token.view(-1)[0]

    def _device_prefill_call(self, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor] | None:
        if seq.prefilled == 0 and not self.shape.batched:
            self._ranks("reset")  # batch 1's one line: zeroed before each prompt, as it always was
        start = seq.prefilled
        # Full buckets while more remain, then the smallest that holds the rest. Every call before the last was a
        # full bucket and kv_max is a multiple of it, so a padded call never runs past the cache.
        bucket = self.shape.bucket_for(len(seq.prompt) - start)
        chunk = seq.prompt[start:start + bucket]
        padded = chunk + [self.pad_id] * (bucket - len(chunk))
        embeds, per_layer = self.embed(padded)
        positions = torch.arange(start, start + bucket).view(1, -1)
        logits, token = self._ranks("prefill", embeds, per_layer, positions, torch.tensor([len(chunk) - 1]),
                                    self._seq_ids([seq.line]))
        seq.prefilled += len(chunk)
        seq.prefill_calls += 1
        if seq.prefilled < len(seq.prompt):
            return None
        return logits.view(-1), token.view(-1)[0]

    # -- decode -------------------------------------------------------------------------------------------------------

    def decode(self, seqs: Seq[Sequence]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One decode step of ``seqs`` (each in its line): ``(logits [lines, vocab], greedy tokens [lines], seconds)``,
        row r being line r's."""
        started = time.perf_counter()
        tokens, positions, seq_ids = [self.pad_id] * self.lines, [0] * self.lines, [-1] * self.lines
        for seq in seqs:
            tokens[seq.line], positions[seq.line] = seq.next_input()
            seq_ids[seq.line] = seq.line
        with torch_threads(self.decode_threads):
            embeds, per_layer = self.embed(tokens)  # [1, lines, ...]: one token per line
            embeds = embeds.view(self.lines, 1, -1)
            if per_layer.numel():
                per_layer = per_layer.view(self.lines, 1, *per_layer.shape[2:])
            logits, token = self._ranks("decode", embeds, per_layer, torch.tensor(positions).view(self.lines, 1),
                                        torch.tensor([0]), self._seq_ids(seq_ids))
        return logits.view(self.lines, -1), token.view(-1), time.perf_counter() - started

    @property
    def threads(self) -> tuple[int, int]:
        """``(host prefill's, decode's)`` torch threads: host prefill's is 0 where the device prefills."""
        return (self.prefill_threads if self.shape.prefill == "host" else 0), self.decode_threads
