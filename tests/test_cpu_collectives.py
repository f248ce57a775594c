"""The cpu backend's collectives through shared memory (pipeline/backends/cpu_collectives.py): the same numbers as
gloo's, bit for bit, call after call; a build's logits the same by either route; the route chosen and recorded."""

from __future__ import annotations

import tempfile

import pytest
import torch

from pipeline.backends import cpu_collectives
from pipeline.core.errors import BuildError, InputError
from pipeline.core.shape import BuildShape
from pipeline.recipe.spec import load_spec

from .test_cpu_backend import KV_MAX, build, run

# Each torch's TorchScript rewriter, operator registration and c10d ops: in the version environments too.
pytestmark = pytest.mark.across_versions("torch", "transformers", "safetensors")

CALLS = 300  # enough calls that each slot parity is reused many times while the other rank may still read it


def _two_ranks(rank: int, world: int, init: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    cpu_collectives.attach(rank, world, init)
    ops, functional = torch.ops.pipeline_cpu, torch.ops._c10d_functional
    mismatches = []
    shapes = [(1, 2560), (3, 7), (4, 300), (cpu_collectives.SLOT_BYTES // 4 + 1,)]  # the last: gloo's fallback
    try:
        for call in range(CALLS):
            shape = shapes[call % len(shapes)] if call < len(shapes) * 2 else shapes[call % 3]
            x = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * call + rank)) * 10 ** (call % 5)
            gloo_sum = functional.wait_tensor(functional.all_reduce(x, "sum", "0"))
            gloo_gather = functional.wait_tensor(functional.all_gather_into_tensor(x, world, "0"))
            ours_sum, ours_gather = ops.all_reduce_sum(x), ops.all_gather_dim0(x, world)
            if not (torch.equal(ours_sum, gloo_sum) and torch.equal(ours_gather, gloo_gather)):
                mismatches.append(call)
    except Exception as exc:  # noqa: BLE001 - reported: the test fails naming it, not by waiting out the queue
        results.put((rank, f"rank {rank} failed: {exc!r}"))
        return
    results.put((rank, mismatches))
    dist.destroy_process_group()


def test_sums_and_gathers_equal_glooes_bit_for_bit_call_after_call():
    """Two rank processes, each call made both ways: fp32 parts of many magnitudes (so that the order of the sum
    would show), shapes that change between calls, and one larger than a slot (gloo's, on both)."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = tempfile.mktemp(prefix="collectives-test-")
    procs = [ctx.Process(target=_two_ranks, args=(rank, 2, init, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    found = {}
    try:
        while len(found) < len(procs):
            rank, outcome = results.get(timeout=300)
            found[rank] = outcome
            assert not isinstance(outcome, str), outcome  # a failed rank's peer may wait in a collective: stop both
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert found == {0: [], 1: []}
    assert all(proc.exitcode == 0 for proc in procs)


def test_the_route_is_shared_memory_on_x86_unless_the_environment_says_gloo(monkeypatch):
    monkeypatch.delenv(cpu_collectives.ENV, raising=False)
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert cpu_collectives.chosen() == "shared_memory"
    monkeypatch.setattr("platform.machine", lambda: "aarch64")  # stores may be seen out of order: gloo
    assert cpu_collectives.chosen() == "gloo"
    monkeypatch.setenv(cpu_collectives.ENV, "gloo")
    assert cpu_collectives.chosen() == "gloo"
    monkeypatch.setenv(cpu_collectives.ENV, "nccl")
    with pytest.raises(InputError, match=r"^PIPELINE_CPU_COLLECTIVES='nccl' is not one of shared_memory, gloo"):
        cpu_collectives.chosen()


@pytest.fixture(scope="module")
def two_rank_build(tiny_dir, tmp_path_factory):
    shape = BuildShape(KV_MAX, 32, "fp32", "device", 2)
    out = tmp_path_factory.mktemp("collectives") / "build"
    build(tiny_dir, out, shape)
    return out, shape


def test_every_collective_of_a_rank_is_rewritten(two_rank_build, tiny_dir):
    build_dir, shape = two_rank_build
    layers = load_spec(tiny_dir).num_layers
    module = torch.jit.load(str(build_dir / "tp_0.pt"))
    rewritten = cpu_collectives.rewrite_rank(module, shape.entries)
    for entry in shape.entries:
        kinds = [n.kind() for n in getattr(module, entry).graph.nodes()]
        assert not [k for k in kinds if k.startswith("_c10d_functional::")]
        assert kinds.count("pipeline_cpu::all_gather_dim0") == 1  # the vocabulary head's
    assert rewritten == len(shape.entries) * (2 * layers + 1)  # per graph: each layer's two row-parallel sums, the head


def test_a_build_decodes_the_same_logits_by_either_route(two_rank_build, tiny_dir, prompts, monkeypatch):
    """The tiny model's tp_degree 2 build, prefill and decode, through gloo and through shared memory: identical
    logits at every step, and the runner says which route ran (validation.json records it)."""
    build_dir, shape = two_rank_build
    found = {}
    for route in cpu_collectives.CHOICES:
        monkeypatch.setenv(cpu_collectives.ENV, route)
        found[route] = run(tiny_dir, build_dir, shape, prompts)
    for ours, gloo in zip(found["shared_memory"], found["gloo"], strict=True):
        assert ours.tokens == gloo.tokens and torch.equal(ours.logits, gloo.logits)


def test_no_room_for_the_slots_is_refused_naming_the_fix_and_leaves_no_file(tmp_path, monkeypatch):
    """Rank 0 reserves the mapping's blocks before any rank maps it: a full disk (or /dev/shm) is an error naming the
    setting that avoids it, not a SIGBUS at some later step, and the file is gone."""
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    rendezvous = tmp_path / "gemma4-gloo-test" / "init"
    rendezvous.parent.mkdir()
    path = cpu_collectives._slots_path(str(rendezvous), cpu_collectives.mapping_bytes(2))
    with pytest.raises(BuildError, match=r"no room for the ranks' shared collectives \(32 MiB\) at .*: No space left "
                                         r"on device\. Free some space there, or set PIPELINE_CPU_COLLECTIVES=gloo"):
        cpu_collectives.attach(0, 2, str(rendezvous))
    assert not path.exists()
