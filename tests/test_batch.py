"""Decoding a batch of sequences (``variant.batch_size``): the recipe's lines, the cpu backend's batched graphs against
transformers and against themselves decoded alone, batch 1's rank files as they were, and the decode loop's policy
(pipeline/decoding/) with fake sequences and no model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pipeline.backends.base import CheckpointRef, TraceRequest
from pipeline.backends.cpu import CpuBackend
from pipeline.core.shape import BuildShape
from pipeline.decoding.engine import BatchEngine
from pipeline.decoding.runner import RanksFailed
from pipeline.decoding.scheduler import Decode, Prefill, Scheduler
from pipeline.decoding.sequence import Finish, Sequence, Status
from pipeline.recipe.checkpoint import Checkpoint
from pipeline.recipe.host import HostEmbeddings, HostPrefill
from pipeline.recipe.spec import load_spec
from pipeline.validation.generation import Generator

# Rank files of two shipped variants' shapes as every batch-1 build wrote them before batching existed (commit
# 11cc7fb), identical under torch 2.8.0 and 2.13.0 (traced from the tiny model, tp_degree 2). A change to the recipe
# that changes these changes what every batch-1 build is: make it on purpose, and write the new digests here.
BATCH_1_RANK_FILES = {
    BuildShape(512, 128, "fp32", "device", 2): {
        "tp_0.pt": "e93e6d1d1916f5ca9bcaa786725a3f846c26df566b095c402120007519e8878e",
        "tp_1.pt": "024dd89c974cf503264d61c9c4d51b12a0b5e0aa50e7d7763d7c3d5f53cef0bb"},
    BuildShape(256, 64, "bf16", "host", 2): {
        "tp_0.pt": "0cfa80f36439e75e4b3520ea2135a1f337174f06a8a8c2fede32b550c0a7b3e8",
        "tp_1.pt": "b382028b65d0178e390317ba84777b51ac2bb2d5a0ac21ecc47c4a8fa246d47e"},
}
DIGESTS_TORCH = ("2.8.0", "2.13.0")
KV_MAX, BUCKET, LINES = 256, 32, 3
NEW = 16  # tokens each sequence decodes here: the first 16 of the reference's


def build(tiny_dir: Path, out: Path, shape: BuildShape):
    return CpuBackend().trace(TraceRequest(CheckpointRef(tiny_dir, "model."), shape), out)


@pytest.mark.across_versions("torch", "safetensors")
@pytest.mark.skipif(torch.__version__.split("+")[0] not in DIGESTS_TORCH,
                    reason=f"the digests are recorded for torch {' and '.join(DIGESTS_TORCH)}")
@pytest.mark.parametrize("shape", list(BATCH_1_RANK_FILES), ids=["512_fp32", "256_bf16_host"])
def test_batch_1_rank_files_are_byte_for_byte_what_they_were(tiny_dir, tmp_path, shape):
    build(tiny_dir, tmp_path / "build", shape)
    found = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "build").iterdir()}
    assert found == BATCH_1_RANK_FILES[shape]


# -- the recipe's cache lines ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank(tiny_dir):
    """The tiny model as one rank at batch 3, fp32, with its embeddings: ``(rank, embed)``."""
    from pipeline.recipe.model import build_rank
    from pipeline.recipe.parallel import Parallel
    from pipeline.recipe.plan import ShardPlan, load_rank_state

    spec = load_spec(tiny_dir)
    plan = ShardPlan(spec, 1)
    with Checkpoint(tiny_dir, "model.") as ckpt:
        rank = build_rank(spec, plan, Parallel(1), KV_MAX, torch.float32,
                          load_rank_state(ckpt, plan, 0, torch.float32), batch_size=LINES)
        embed = HostEmbeddings(ckpt, spec)
        yield rank, embed


def caches_of(rank) -> list[torch.Tensor]:
    return [c.clone() for c in rank.decoder.caches()]


def test_a_prefill_writes_its_own_line_and_a_free_line_writes_nothing(one_rank):
    rank, embed = one_rank
    for cache in rank.decoder.caches():
        cache.normal_()  # whatever the other lines hold must survive bit for bit
    before = caches_of(rank)
    embeds, per_layer = embed(list(range(5, 5 + BUCKET)))
    with torch.no_grad():
        logits, _ = rank.prefill(embeds, per_layer, torch.arange(BUCKET).view(1, -1), torch.tensor([BUCKET - 1]),
                                 torch.tensor([1]))
    after = caches_of(rank)
    assert logits.shape == (1, rank.decoder.model_spec.vocab_size)
    for old, new in zip(before, after):
        assert torch.equal(new[[0, 2]], old[[0, 2]])  # the other lines: untouched
        assert torch.equal(new[1, :, BUCKET:], old[1, :, BUCKET:])  # beyond the prompt: untouched
        assert not torch.equal(new[1, :, :BUCKET], old[1, :, :BUCKET])  # the prompt's positions: written
    # A decode step of line 1 alone (lines 0 and 2 free: seq_ids -1) writes line 1's next position and nothing else.
    embeds, per_layer = embed([7, 8, 9])
    with torch.no_grad():
        logits, tokens = rank.decode(embeds.view(LINES, 1, -1), per_layer.view(LINES, 1, *per_layer.shape[2:]),
                                     torch.tensor([[0], [BUCKET], [0]]), torch.tensor([0]), torch.tensor([-1, 1, -1]))
    stepped = caches_of(rank)
    assert logits.shape == (LINES, rank.decoder.model_spec.vocab_size) and tokens.shape == (LINES,)
    for old, new in zip(after, stepped):
        assert torch.equal(new[[0, 2]], old[[0, 2]])
        changed = (new[1] != old[1]).any(dim=-1).any(dim=0).nonzero().view(-1).tolist()
        assert changed == [BUCKET]


# -- the cpu backend at batch 3, against transformers and against itself alone -----------------------------------

@pytest.fixture(scope="module")
def batch_builds(tiny_dir, tmp_path_factory):
    built = {}

    def get(prefill: str) -> tuple[Path, BuildShape]:
        shape = BuildShape(KV_MAX, BUCKET, "fp32", prefill, 2, batch_size=LINES)
        if shape not in built:
            out = tmp_path_factory.mktemp("batch") / prefill
            build(tiny_dir, out, shape)
            built[shape] = out
        return built[shape], shape

    return get


def decode_together(tiny_dir: Path, build_dir: Path, shape: BuildShape, prompts: list[list[int]]):
    """Every prompt decoded alone, then all at once (more than the lines hold: some wait and take a line another
    left): ``(alone, together)``, each a list of ``(tokens, logits)``."""
    from pipeline.artifact.archive import verify_build
    from pipeline.core.build_records import Member
    from pipeline.core.fsutil import sha256_file
    from pipeline.validation.batch import decode_together as together

    verified = verify_build(build_dir, tuple(Member(p.name, p.stat().st_size, sha256_file(p))
                                             for p in build_dir.iterdir()))
    spec = load_spec(tiny_dir)
    with Checkpoint(tiny_dir, "model.") as ckpt:
        host = HostPrefill(ckpt, spec, shape.kv_max, shape.torch_dtype) if shape.prefill == "host" else None
        with CpuBackend().load(verified, shape) as runner:
            gen = Generator(runner, HostEmbeddings(ckpt, spec), spec.eos_token_ids, spec.pad_token_id, host)
            alone = [gen.generate(ids, NEW) for ids in prompts]
            decoded = together(gen.batch, [gen.sequence(ids, NEW) for ids in prompts])
    return ([(g.tokens, g.logits) for g in alone],
            [([s.token for s in d.steps], torch.stack([s.logits for s in d.steps]), d.sequence.admitted)
             for d in decoded])


@pytest.mark.across_versions("torch", "transformers", "safetensors")
def test_a_batch_decodes_each_sequence_as_transformers_and_as_alone(batch_builds, tiny_dir, prompts, hf_reference):
    """Host prefill at batch 3: three prompts of different lengths and a fourth and fifth that wait for a line, each
    seeded into its line by the host's prefill model: each decodes transformers' greedy tokens, and the logits it
    decoded alone, bit for bit. (Device prefill: the batched build every make test validates, tests/conftest.py
    ``tiny_batched``, fp32 ``exact`` against the reference and its prompts together against themselves alone.)"""
    build_dir, shape = batch_builds("host")
    asked = prompts + prompts[:2]  # five sequences in three lines: two take a line another left, mid-flight
    alone, together = decode_together(tiny_dir, build_dir, shape, asked)
    references = hf_reference + hf_reference[:2]
    for (tokens, logits), (t_tokens, t_logits, _), (ref_tokens, _) in zip(alone, together, references):
        assert tokens == ref_tokens[:NEW] and t_tokens == ref_tokens[:NEW]
        assert torch.equal(t_logits, logits)
    admitted = [a for _, _, a in together]
    assert [a.line for a in admitted] == [0, 1, 2, 0, 1]
    assert all(a.line_reused and a.decoding_beside > 0 for a in admitted[3:])


# -- the policy: which call comes next (no model) --------------------------------------------------------------------

def seq(group: object = None, prompt: int = 4, tokens: int = 3) -> Sequence:
    return Sequence(list(range(prompt)), tokens, group=group)


def test_one_prefill_call_between_two_decode_steps_and_back_to_back_when_nothing_decodes():
    scheduler = Scheduler(2)
    a, b = seq(), seq()
    scheduler.add(a)
    scheduler.add(b)
    plan = []
    for _ in range(5):
        action = scheduler.next()
        plan.append(action)
        if isinstance(action, Prefill):
            action.sequence.status = Status.decoding  # its prompt in one call
    assert isinstance(plan[0], Prefill) and plan[0].sequence is a and a.line == 0
    assert isinstance(plan[1], Decode) and plan[1].sequences == (a,)  # b waits one step: a decodes first
    assert isinstance(plan[2], Prefill) and plan[2].sequence is b and b.line == 1
    assert isinstance(plan[3], Decode) and plan[3].sequences == (a, b)
    assert isinstance(plan[4], Decode)
    # a long prompt of several calls: each of its calls has a decode step of the others before the next
    c = seq()
    scheduler.remove(a)
    scheduler.add(c)
    assert isinstance(scheduler.next(), Prefill) and c.line == 0  # a's line, given back
    assert isinstance(scheduler.next(), Decode)
    assert isinstance(scheduler.next(), Prefill)  # c again (still prefilling): it holds its line meanwhile
    assert c.admitted.line_reused and c.admitted.decoding_beside == 1


def test_a_request_of_many_sequences_cannot_keep_another_from_its_first_line():
    """Admission goes to the request holding the fewest lines, then the earliest: a request of six sequences arriving
    first takes one line, and the one-sequence request behind it takes the next."""
    big, small = object(), object()
    scheduler = Scheduler(2)
    bigs = [seq(big) for _ in range(6)]
    for s in bigs:
        scheduler.add(s)
    late = seq(small)
    scheduler.add(late)
    started = []
    while len(started) < 3:
        action = scheduler.next()
        if isinstance(action, Prefill):
            action.sequence.status = Status.decoding
            started.append(action.sequence)
            if len(started) == 2:  # both lines taken; one of big's sequences ends
                scheduler.remove(started[0])
    assert started == [bigs[0], late, bigs[1]]


def admissions(scheduler: Scheduler, count: int) -> list[Sequence]:
    """The first ``count`` sequences to take a line, each ending as soon as it has one (one line: batch 1)."""
    started = []
    while len(started) < count:
        action = scheduler.next()
        assert isinstance(action, Prefill)
        started.append(action.sequence)
        scheduler.remove(action.sequence)
    return started


def test_requests_waiting_side_by_side_take_lines_in_turn_at_batch_1():
    """At batch 1 no request holds a line when one frees: the turn goes to the request given the fewest lines, so a
    request of many sequences queued ahead (16 prompts x n=16 in serve) does not make a later one wait for all of
    them; and a newcomer takes its turn after those served before it arrived, neither first in line for ever nor
    starving the big one."""
    big, small, later = object(), object(), object()
    scheduler = Scheduler(1)
    bigs = [seq(big) for _ in range(8)]
    for s in bigs:
        scheduler.add(s)
    smalls = [seq(small) for _ in range(2)]
    for s in smalls:
        scheduler.add(s)
    assert admissions(scheduler, 4) == [bigs[0], smalls[0], bigs[1], smalls[1]]
    newcomer = [seq(later) for _ in range(2)]
    for s in newcomer:
        scheduler.add(s)  # big was served before the newcomer arrived: it goes first, then they alternate
    assert admissions(scheduler, 4) == [bigs[2], newcomer[0], bigs[3], newcomer[1]]


def test_a_stream_of_single_requests_does_not_starve_a_backlogged_one_at_batch_2():
    """Two lines: one holds a single request for long, the other serves a big request with a backlog while single
    requests keep arriving. The big request still gets a turn in every few (round-robin by the last line given)."""
    big, holder = object(), object()
    scheduler = Scheduler(2)
    long_one = seq(holder)
    scheduler.add(long_one)
    bigs = [seq(big) for _ in range(20)]
    for s in bigs:
        scheduler.add(s)
    order = []
    for _ in range(12):
        scheduler.add(seq(object()))  # a single request arrives each turn
        action = scheduler.next()
        while not isinstance(action, Prefill):
            action = scheduler.next()
        order.append("big" if action.sequence.group is big else "other")
        action.sequence.status = Status.decoding  # its prompt in one call
        if action.sequence is not long_one:
            scheduler.remove(action.sequence)  # it ends at once; the long one keeps its line
    assert order[0] == "other" and order[1:].count("big") >= 3, order  # a turn in every few, never none


def test_a_sequences_own_error_ends_it_alone_and_the_ranks_failing_ends_every_one():
    class Runner:
        lines = 2
        fail: Exception | None = None

        def prefill(self, s):
            return torch.zeros(4), torch.tensor(1)

        def decode(self, seqs):
            if self.fail:
                raise self.fail
            return torch.zeros(2, 4), torch.ones(2, dtype=torch.long), 0.001

    def broken(logits):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    runner = Runner()
    engine = BatchEngine(runner)
    ok, bad = seq(tokens=3), seq(tokens=3)
    bad.choose = lambda logits: broken(logits) if len(bad.tokens) else 1  # its second token raises
    engine.run(ok, bad)
    assert (ok.finish, ok.tokens) == (Finish.length, [1, 1, 1])
    assert bad.finish == Finish.error and "probability tensor" in str(bad.error) and bad.tokens == [1]
    runner.fail = RanksFailed("the build's ranks failed in decode: EOFError")
    x, y, waiting = seq(tokens=5), seq(tokens=5), seq(tokens=5)
    with pytest.raises(RanksFailed):
        engine.run(x, y, waiting)
    assert x.finish == y.finish == waiting.finish == Finish.failed
    with pytest.raises(RanksFailed):  # nothing more is taken
        engine.submit(seq())


def test_a_cancelled_sequence_gives_its_line_back_before_the_next_call():
    calls = []

    class Runner:
        lines = 1

        def prefill(self, s):
            calls.append(("prefill", s))
            return torch.zeros(4), torch.tensor(1)

        def decode(self, seqs):
            calls.append(("decode", seqs))
            return torch.zeros(1, 4), torch.ones(1, dtype=torch.long), 0.001

    engine = BatchEngine(Runner())
    first, second = seq(tokens=100), seq(tokens=2)
    engine.submit(first, second)
    engine.step()  # first's prefill
    engine.step()  # a decode step
    first.cancel()
    while engine.step():
        pass
    assert first.finish == Finish.cancelled and len(first.tokens) == 2
    assert second.finish == Finish.length and second.line is None
    assert [kind for kind, s in calls if s is first or (kind == "decode" and first in s)] == ["prefill", "decode"]


# -- what a user of a published batched build sees ----------------------------------------------------------------

def test_the_card_versions_and_metrics_show_the_batch_and_its_throughput(tiny_batched):
    """The published card and ``versions`` show each version's batch and its tokens/s with every line in flight;
    metrics.json holds 1 to batch_size sequences in flight; validation.json the prompts decoded together."""
    import json

    from .conftest import BATCHED, run_cli

    root, _ = tiny_batched
    variant = root / "gemma4_tiny" / BATCHED
    metrics = json.loads((variant / "metrics.json").read_text())
    assert sorted(metrics["concurrency"]) == ["1", "2", "3", "4"]
    full = metrics["concurrency"]["4"]["aggregate_tokens_per_s"]
    together = json.loads((variant / "validation.json").read_text())["batch_parity"]
    assert together["passed"] and together["sequences"] == 5 and together["reused_mid_flight"] >= 1
    assert all(v["identical"] for v in together["together"])
    row = next(line for line in (root / "published" / "README.md").read_text().splitlines() if BATCHED in line)
    cells = [c.strip() for c in row.split("|")]
    assert cells[7] == "4" and cells[11] == f"{full:.1f}"  # batch, tok/s at full batch
    listed = run_cli("versions", str(root / "published")).stdout.splitlines()
    header, line = listed[0], next(x for x in listed if BATCHED in x)
    assert "batch" in header and "tok/s, full batch" in header
    assert line.split()[2] == "4" and f"{full:.1f}" in line.split()


class ToyRanks:
    """A build of two lines whose logits are a function of each row's token and position alone, or (``leaky``) of
    every row's: what validation must tell apart."""

    def __init__(self, leaky: bool):
        self.shape, self.leaky, self.vocab = BuildShape(64, 8, "fp32", "device", 1, batch_size=2), leaky, 16

    def _logits(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rows = embeds[:, -1, 0] + positions[:, -1].float()  # each row's last token and position
        if self.leaky:
            rows = rows + 0.001 * embeds[:, -1, 0].sum()
        logits = torch.sin(rows.view(-1, 1) * torch.arange(1, self.vocab + 1).float())
        return logits, logits.argmax(-1)

    def prefill(self, embeds, per_layer, positions, last_index, seq_ids):
        return self._logits(embeds[:, :int(last_index) + 1], positions[:, :int(last_index) + 1])

    def decode(self, embeds, per_layer, positions, last_index, seq_ids):
        return self._logits(embeds, positions)

    def reset(self):
        pass


@pytest.mark.parametrize("leaky", [False, True])
def test_validation_tells_a_batch_whose_rows_depend_on_each_other_from_one_whose_rows_do_not(leaky):
    from pipeline.validation.batch import together

    def embed(ids):
        return torch.tensor(ids, dtype=torch.float32).view(1, -1, 1).expand(1, len(ids), 4).contiguous(), \
            torch.zeros(0)

    gen = Generator(ToyRanks(leaky), embed, eos_ids=(), pad_id=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [2, 2]]
    alone = [(g.tokens, g.logits) for g in (gen.generate(p, 6) for p in prompts)]
    verdict = together(gen.batch, gen.eos_ids, ["a", "b", "c"], prompts, 6, [None] * 3, alone)
    assert verdict.sequences == 3 and verdict.reused_mid_flight == 1  # "c" took a line "a" left, "b" decoding
    assert verdict.passed == (not leaky)
    assert [v.identical for v in verdict.together] == ([True] * 3 if not leaky else [False] * 3)
