"""The recipe through the cpu backend: traced rank files, loaded in fresh gloo processes, against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.backends.base import CheckpointRef, TraceRequest
from pipeline.backends.cpu import CpuBackend
from pipeline.core.build_records import TraceResult
from pipeline.core.errors import CheckpointError, ConfigError, InputError
from pipeline.core.shape import BuildShape
from pipeline.recipe.checkpoint import Checkpoint
from pipeline.recipe.host import HostEmbeddings, HostPrefill
from pipeline.recipe.spec import load_spec
from pipeline.validation.generation import Generator

from .conftest import NEW_TOKENS
from .helpers import edited_checkpoint

# What differs between versions: torch's numerics and transformers' reference.
# make test-production runs these, and make test-lowest where a distribution named is at another version than
# the production pins (tests/conftest.py, --already-tested-with).
pytestmark = pytest.mark.across_versions("torch", "transformers", "safetensors")

KV_MAX, BUCKET = 256, 32
LOGIT_BOUND = 1e-3  # fp32 rank files vs transformers: only summation order differs (measured: < 5e-5)
BACKEND = CpuBackend()


def build(tiny_dir: Path, out: Path, shape: BuildShape) -> TraceResult:
    return BACKEND.trace(TraceRequest(CheckpointRef(tiny_dir, "model."), shape), out)


def verified(build_dir: Path):
    """The rank files, hashed as the trace recorded them (what a server gets after verifying an archive)."""
    from pipeline.artifact.archive import verify_build
    from pipeline.core.build_records import Member
    from pipeline.core.fsutil import sha256_file

    return verify_build(build_dir, tuple(Member(p.name, p.stat().st_size, sha256_file(p)) for p in build_dir.iterdir()))


def run(weights_dir: Path, build_dir: Path, shape: BuildShape, prompts, forced=None):
    """Greedy (or teacher-forced) generations of every prompt from a build, through the serving loop."""
    spec = load_spec(weights_dir)
    with Checkpoint(weights_dir, "model.") as ckpt:
        host = HostPrefill(ckpt, spec, shape.kv_max, shape.torch_dtype) if shape.prefill == "host" else None
        with BACKEND.load(verified(build_dir), shape) as runner:
            gen = Generator(runner, HostEmbeddings(ckpt, spec), spec.eos_token_ids, spec.pad_token_id, host)
            return [gen.generate(ids, NEW_TOKENS, forced=None if forced is None else forced[i])
                    for i, ids in enumerate(prompts)]


@pytest.fixture(scope="module")
def builds(tiny_dir, tmp_path_factory):
    cache = {}

    def get(tp: int, prefill: str, dtype: str = "fp32") -> tuple[Path, BuildShape]:
        shape = BuildShape(KV_MAX, BUCKET, dtype, prefill, tp)
        if shape not in cache:
            out = tmp_path_factory.mktemp("builds") / f"{tp}_{prefill}_{dtype}"
            build(tiny_dir, out, shape)
            cache[shape] = out
        return cache[shape], shape

    return get


@pytest.mark.parametrize("threads", [1, 2])
def test_every_decode_step_runs_with_the_threads_it_is_given(threads):
    """validate.throughput.decode_threads (and --decode-threads) reach each step, the device prefill's host work
    included, and are what validation.json records; the count is restored after."""
    seen = []

    class Runner:
        shape = BuildShape(kv_max=64, bucket=16, dtype="fp32", prefill="device", tp_degree=2)

        def reset(self):
            pass

        def prefill(self, *inputs):
            seen.append(torch.get_num_threads())
            return torch.zeros(1, 8), torch.tensor([3])

        decode = prefill

    def embed(ids):
        return torch.zeros(1, len(ids), 4), torch.zeros(1, len(ids), 2, 2)

    before = torch.get_num_threads()
    gen = Generator(Runner(), embed, (7,), 0, decode_threads=threads)
    assert [s.token for s in gen.steps([1, 2, 3], 3)] == [3, 3, 3]
    assert seen == [threads] * 3 and gen.threads.decode == threads and torch.get_num_threads() == before


# tp_degree 2 is what ships; tp_degree 1 (also run by the neuron stand-in's end-to-end tests) only in `make test-slow`.
@pytest.mark.parametrize(("tp", "prefill"), [pytest.param(1, "device", marks=pytest.mark.slow), (2, "device"),
                                             pytest.param(1, "host", marks=pytest.mark.slow), (2, "host")])
def test_fp32_ranks_match_transformers_token_for_token(builds, tiny_dir, prompts, hf_reference, tp, prefill):
    build_dir, shape = builds(tp, prefill)
    assert sorted(p.name for p in build_dir.iterdir()) == [f"tp_{r}.pt" for r in range(tp)]
    for gen, (ref_tokens, ref_logits) in zip(run(tiny_dir, build_dir, shape, prompts), hf_reference):
        assert len(ref_tokens) == NEW_TOKENS
        assert gen.tokens == ref_tokens
        assert (gen.logits - ref_logits).abs().max().item() < LOGIT_BOUND
    # The prompts cross the sliding window and, for device prefill, a bucket boundary.
    assert max(len(p) for p in prompts) > 2 * BUCKET


def test_bf16_agreement_with_fp32_reference_is_within_transformers_own_bf16(builds, tiny_dir, prompts, hf_reference,
                                                                             hf_model, capsys):
    """bf16 is judged teacher-forced on the fp32 reference's continuation. It must be at least as close to fp32 as
    transformers' own bf16 model is (which rounds more: its residual stream and norms are bf16 too)."""
    build_dir, shape = builds(2, "device", "bf16")
    forced = [tokens for tokens, _ in hf_reference]
    ours = run(tiny_dir, build_dir, shape, prompts, forced=forced)
    hf_bf16 = hf_model.to(torch.bfloat16)
    try:
        report = []
        for ids, gen, (tokens, ref_logits) in zip(prompts, ours, hf_reference):
            with torch.no_grad():
                theirs = hf_bf16(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:].float()
            ours_err = (gen.logits - ref_logits).abs().max().item()
            theirs_err = (theirs - ref_logits).abs().max().item()
            matched = sum(a == b for a, b in zip(gen.tokens, tokens))
            report.append({"prompt_tokens": len(ids), "max_abs_dlogit": round(ours_err, 4),
                           "transformers_bf16_max_abs_dlogit": round(theirs_err, 4),
                           "teacher_forced_match": f"{matched}/{len(tokens)}"})
            assert ours_err <= theirs_err * 1.25
            assert matched >= len(tokens) - 2
    finally:
        hf_model.to(torch.float32)
    with capsys.disabled():
        print("\nbf16 vs fp32 reference:", json.dumps(report))


def test_rank_files_are_byte_identical_across_builds(builds, tiny_dir, tmp_path):
    first, shape = builds(2, "device")
    build(tiny_dir, tmp_path / "again", shape)
    for name in ("tp_0.pt", "tp_1.pt"):
        assert (first / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_parity_catches_a_loader_that_skips_layer_scalar(tiny_dir, tmp_path, prompts, hf_reference):
    """An artifact built as a parameters-only loader would build it (every layer_scalar left at 1) diverges."""
    def scalars_to_one(tensors):
        for key in tensors:
            if key.endswith("layer_scalar"):
                tensors[key] = torch.ones_like(tensors[key])

    broken = edited_checkpoint(tiny_dir, tmp_path / "weights", scalars_to_one)
    shape = BuildShape(KV_MAX, BUCKET, "fp32", "device", 2)
    build(broken, tmp_path / "build", shape)
    gens = run(broken, tmp_path / "build", shape, prompts[:1])
    ref_tokens, ref_logits = hf_reference[0]
    assert gens[0].tokens != ref_tokens
    assert (gens[0].logits[0] - ref_logits[0]).abs().max().item() > 100 * LOGIT_BOUND


# -- bad input: refused before any rank process starts or any output exists -----------------------------------------

@pytest.mark.parametrize(("kv_max", "bucket", "dtype", "tp", "match"), [
    (250, 32, "fp32", 2, "variant.kv_max=250 is not a multiple of variant.bucket=32: .* use kv_max=224 or 256"),
    (64, 128, "fp32", 2, "variant.bucket=128 is larger than variant.kv_max=64"),
    (256, 32, "fp16", 2, r"variant.dtype='fp16' is not one of \['bf16', 'fp32'\]"),
    (256, 32, "fp32", 3, r"variant.tp_degree=3 does not divide num_attention_heads=4 \(choose variant.tp_degree from"),
])
def test_bad_variants_are_refused_before_tracing(tiny_dir, tmp_path, kv_max, bucket, dtype, tp, match):
    with pytest.raises(ConfigError, match=match):
        build(tiny_dir, tmp_path / "out", BuildShape(kv_max, bucket, dtype, "device", tp))
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_missing_a_tensor_is_refused_by_name(tiny_dir, tmp_path):
    weights = edited_checkpoint(tiny_dir, tmp_path / "w", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.2.mlp.up_proj.weight'"):
        build(weights, tmp_path / "out", BuildShape(KV_MAX, BUCKET, "fp32", "device", 2))
    assert not (tmp_path / "out").exists()


def test_checkpoint_with_a_wrong_shape_or_an_extra_tensor_is_refused_by_name(tiny_dir, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 128)
        t["model.layers.0.self_attn.surprise.weight"] = torch.zeros(1)

    weights = edited_checkpoint(tiny_dir, tmp_path / "w", edit)
    with pytest.raises(CheckpointError) as err:
        build(weights, tmp_path / "out", BuildShape(KV_MAX, BUCKET, "fp32", "device", 2))
    expected = "'model.layers.0.self_attn.k_proj.weight' has shape [32, 128], config.json implies [64, 128]"
    assert expected in str(err.value)
    assert "unexpected tensor 'model.layers.0.self_attn.surprise.weight'" in str(err.value)


def test_prompt_longer_than_kv_max_allows_is_refused(builds, tiny_dir, prompts):
    build_dir, shape = builds(1, "device")
    too_long = prompts[2] * 2
    with pytest.raises(InputError, match=r"variant.kv_max is 256"):
        run(tiny_dir, build_dir, shape, [too_long])


def test_multimodal_layout_loads_the_same_rank_weights(tiny_dir, tmp_path):
    """E4B keeps the decoder under model.language_model.* inside a 'gemma4' config: the loader mapping reads it."""
    from safetensors.torch import load_file, save_file

    from pipeline.recipe.plan import ShardPlan, load_rank_state

    mm = tmp_path / "mm"
    mm.mkdir()
    for f in tiny_dir.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, mm / f.name)
    text = json.loads((tiny_dir / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text,
                                                "tie_word_embeddings": True}))
    text_tensors = load_file(tiny_dir / "model.safetensors")
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in text_tensors.items()}
    tensors["model.vision_tower.patch.weight"] = torch.zeros(2)  # other towers are ignored
    save_file(tensors, mm / "model.safetensors", metadata={"format": "pt"})

    spec = load_spec(mm)
    assert spec == load_spec(tiny_dir)
    plan = ShardPlan(spec, 2)
    with Checkpoint(tiny_dir, "model.") as a, Checkpoint(mm, "model.language_model.") as b:
        b.verify(spec)
        left, right = load_rank_state(a, plan, 1, torch.float32), load_rank_state(b, plan, 1, torch.float32)
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)
