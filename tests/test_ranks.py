"""The rank runtime's messages (pipeline/backends/ranks.py): typed, pickled over real pipes to spawned processes, and
what a trace's rank processes report, as build.json records it."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.backends.ranks import (
    Close,
    Done,
    PackedTensor,
    RankGroup,
    RankStats,
    Reset,
    Seed,
    ServeJob,
    Step,
    Stepped,
    serve_commands,
)
from pipeline.core.errors import BuildError
from pipeline.core.shape import BuildShape

SHAPE = BuildShape(64, 16, "bf16", "device", 2)


def _toy_rank(rank: int, processes: int, init_file: str, job: ServeJob, conn) -> None:
    """A rank process whose graph doubles its first input and whose KV state is a list: the protocol, no model."""
    from pipeline.backends.ranks import report_failure

    state: list[torch.Tensor] = []

    def step(entry: str, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = inputs[0] * 2 + (state[0] if state else 0)
        return logits, torch.argmax(logits, dim=-1)

    try:
        serve_commands(conn, rank, step, seed=lambda values, line: state.extend(values), reset=state.clear)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, as every rank main does
        report_failure(conn, exc)


def test_a_rank_answers_each_command_with_its_typed_reply_over_a_real_pipe():
    group = RankGroup(2, ServeJob(build=None, shape=SHAPE), _toy_rank)
    try:
        ready = group.receive_all(timeout=120)
        assert [type(r) for r in ready] == [RankStats, RankStats] and [r.rank for r in ready] == [0, 1]
        x = torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.bfloat16)
        group.send_all(Step("decode", (PackedTensor.of(x), PackedTensor.of(torch.empty(0)))))
        first, second = group.receive_all(timeout=60)
        assert isinstance(first, Stepped) and first.seconds >= 0
        assert torch.equal(first.logits.tensor(), x * 2) and first.logits.tensor().dtype == torch.bfloat16
        assert first.token.tensor().tolist() == [1]
        assert second == Stepped(second.seconds)  # only rank 0 sends its outputs back
        for conn in group.conns:
            conn.send(Seed((PackedTensor.of(torch.full((1, 3), 10.0)),)))
        assert group.receive_all(timeout=60) == [Done(), Done()]
        group.send_all(Step("decode", (PackedTensor.of(torch.ones(1, 3)),)))
        assert group.receive_all(timeout=60)[0].logits.tensor().tolist() == [[12.0, 12.0, 12.0]]
        group.send_all(Reset())
        assert group.receive_all(timeout=60) == [Done(), Done()]
        group.send_all(Close())
        assert group.receive_all(timeout=60) == [Done(), Done()]
    finally:
        group.terminate()


def test_a_message_that_is_no_command_fails_the_rank_by_name():
    group = RankGroup(1, ServeJob(build=None, shape=SHAPE), _toy_rank)
    try:
        group.receive_all(timeout=120)
        group.send_all(("step", ("decode", [])))  # the tuples the pipes once carried
        with pytest.raises(BuildError, match=r"rank 0 failed: TypeError: rank 0 was sent \('step', \('decode', "
                           r"\[\]\)\), which is not a command of the rank runtime"):
            group.receive_all(timeout=60)
    finally:
        group.terminate()


def test_each_traced_rank_is_recorded_in_build_json_with_the_keys_it_always_had(validated_512_fp32):
    build = json.loads((validated_512_fp32 / "gemma4_tiny" / "512_fp32" / "build.json").read_text())
    ranks = build["trace"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(set(r) == {"rank", "file", "size", "sha256", "peak_rss_bytes", "trace_s", "load_s"} for r in ranks)
    assert [m["path"] for m in build["trace"]["members"]] == [r["file"] for r in ranks] == ["tp_0.pt", "tp_1.pt"]
    assert build["trace"]["peak_rss_bytes"] == max(r["peak_rss_bytes"] for r in ranks)
