"""A ladder of prefill buckets (``variant.smaller_buckets``): a prompt runs ``bucket`` tokens per call while more
remain, its last part in the smallest bucket that holds it, a graph per bucket; the same tokens as one bucket."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.shape import BuildShape
from pipeline.validation.generation import Generator

from .test_cpu_backend import KV_MAX, LOGIT_BOUND, build, run

LADDER = BuildShape(KV_MAX, 64, "fp32", "device", 2, smaller_buckets=(16, 32))


@pytest.mark.parametrize("ladder, problem", [
    ((32, 16), "must be increasing"), ((16, 16), "must be increasing"), ((16, 64), "below variant.bucket=64"),
    ((0, 16), "each at least 1"), ((16,), None)])
def test_a_ladder_is_increasing_and_below_the_bucket(ladder, problem):
    found = BuildShape(KV_MAX, 64, "fp32", "device", 2, smaller_buckets=ladder).problems()
    assert (problem in found[0]) if problem else found == []


def test_host_prefill_has_no_ladder_to_climb():
    found = BuildShape(KV_MAX, 64, "fp32", "host", 2, smaller_buckets=(16,)).problems()
    assert found == ["variant.smaller_buckets=[16] is for prefill=device: host prefill runs a prompt on the host, with "
                     "no prefill graph on the ranks; set smaller_buckets=[]"]


def test_each_bucket_is_a_graph_and_a_prompt_ends_in_the_smallest_that_holds_its_rest():
    assert LADDER.entries == ("prefill_16", "prefill_32", "prefill", "decode")
    assert [LADDER.entry_rows(e) for e in LADDER.entries] == [(1, 16), (1, 32), (1, 64), (1, 1)]
    assert [LADDER.bucket_for(n) for n in (1, 16, 17, 32, 33, 64, 500)] == [16, 16, 32, 32, 64, 64, 64]
    with pytest.raises(ValueError, match=r"48 tokens is none of this build's prefill buckets \[16, 32, 64\]"):
        LADDER.prefill_entry(48)
    assert BuildShape(KV_MAX, 64, "fp32", "device", 2).entries == ("prefill", "decode")  # as every build had


class CallSizes:
    """Ranks that answer every call with the same logits and record each prefill call's token count."""

    def __init__(self, shape: BuildShape):
        self.shape, self.sizes = shape, []

    def prefill(self, embeds, per_layer, positions, last_index, seq_ids=None):
        self.sizes.append((embeds.shape[1], int(positions[0, 0]), int(last_index)))
        return torch.zeros(1, 8), torch.zeros(1, dtype=torch.long)

    def decode(self, embeds, per_layer, positions, last_index, seq_ids=None):
        return torch.zeros(1, 8), torch.zeros(1, dtype=torch.long)

    def reset(self):
        pass


@pytest.mark.parametrize("length, calls", [
    (5, [(16, 0, 4)]), (16, [(16, 0, 15)]), (20, [(32, 0, 19)]), (64, [(64, 0, 63)]),
    (70, [(64, 0, 63), (16, 64, 5)]), (150, [(64, 0, 63), (64, 64, 63), (32, 128, 21)])])
def test_the_runner_climbs_the_ladder(length, calls):
    ranks = CallSizes(LADDER)
    gen = Generator(ranks, lambda ids: (torch.zeros(1, len(ids), 4), torch.zeros(0)), eos_ids=(), pad_id=0)
    gen.generate(list(range(1, length + 1)), 1)
    assert ranks.sizes == calls


@pytest.fixture(scope="module")
def ladder_builds(tiny_dir, tmp_path_factory):
    out = {}
    for name, shape in (("one", BuildShape(KV_MAX, 64, "fp32", "device", 2)), ("ladder", LADDER)):
        out[name] = tmp_path_factory.mktemp("ladder") / name, shape
        build(tiny_dir, out[name][0], shape)
    return out


def test_a_ladder_build_decodes_what_the_one_bucket_build_does(ladder_builds, tiny_dir, prompts):
    """fp32, on the tiny model: prompts ending in each bucket of the ladder (16, 32, 64), short and crossing
    buckets, decode the same tokens through the ladder as through one bucket, their logits equal to fp32 rounding
    (the padding differs, so the matmuls' shapes do)."""
    chosen = [prompts[0][:12], prompts[0], prompts[1], prompts[2][:128], prompts[2]]
    assert {LADDER.bucket_for(n - (n - 1) // 64 * 64) for n in map(len, chosen)} == {16, 32, 64}  # every graph runs
    one, ladder = (run(tiny_dir, *ladder_builds[name], chosen) for name in ("one", "ladder"))
    for a, b in zip(one, ladder, strict=True):
        assert b.tokens == a.tokens
        assert (b.logits - a.logits).abs().max().item() < LOGIT_BOUND


def test_the_rank_file_holds_a_graph_per_bucket(ladder_builds):
    module = torch.jit.load(str(ladder_builds["ladder"][0] / "tp_0.pt"))
    assert [e for e in ("prefill_16", "prefill_32", "prefill", "decode", "prefill_48") if hasattr(module, e)] == \
        list(LADDER.entries)
