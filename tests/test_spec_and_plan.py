"""The model spec read from config.json, the sharding plan, and the per-rank KV seeding slices."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.core.errors import ConfigError, UnsupportedModelError
from pipeline.models.e4b_shaped import E2B_TEXT, E4B_TEXT
from pipeline.recipe.host import split_kv_for_ranks
from pipeline.recipe.plan import ShardPlan
from pipeline.recipe.spec import FULL, SLIDING, load_spec, rope_inv_freq, spec_from_config

# What differs between versions: the recipe against transformers' config and rotary tables.
# make test-production runs these, and make test-lowest where a distribution named is at another version than
# the production pins (tests/conftest.py, --already-tested-with).
pytestmark = pytest.mark.across_versions("torch", "transformers", "safetensors")

# google/gemma-4-E4B-it's config.json, its shape-bearing fields (the multimodal release nests the decoder; the one
# statement of them is pipeline/models/e4b_shaped.py).
E4B_CONFIG = {"model_type": "gemma4", "tie_word_embeddings": True, "text_config": dict(E4B_TEXT)}


def test_e4b_spec_from_global_head_dim():
    spec = spec_from_config(E4B_CONFIG)
    assert spec.num_layers == 42 and spec.hidden_size == 2560 and spec.ple_dim == 256
    assert {layer.head_dim for layer in spec.layers if layer.layer_type == SLIDING} == {256}
    assert {layer.head_dim for layer in spec.layers if layer.layer_type == FULL} == {512}
    # The last 18 layers reuse the caches of the last non-shared layer of their type (23 full, 22 sliding).
    assert [layer.index for layer in spec.producers] == list(range(24))
    assert {layer.kv_source for layer in spec.layers[24:] if layer.layer_type == FULL} == {23}
    assert {layer.kv_source for layer in spec.layers[24:] if layer.layer_type == SLIDING} == {22}
    assert spec.ropes[FULL].rotated_pairs == 64 and spec.ropes[SLIDING].rotated_pairs == 128
    assert spec.eos_token_ids == (1, 106) and spec.tie_word_embeddings


@pytest.mark.parametrize("index", [str, lambda i: str(i).zfill(2)], ids=["plain", "zero_padded"])
def test_per_layer_config_spelling_reads_the_same(index):
    """transformers 5.24's save_pretrained writes the layer indices zero-padded ("05" ... "41" of E4B's 42 layers)."""
    with_plc = copy.deepcopy(E4B_CONFIG)
    text = with_plc["text_config"]
    del text["global_head_dim"]
    text["per_layer_config"] = {index(i): {"head_dim": 512} for i, t in enumerate(text["layer_types"]) if t == FULL}
    assert spec_from_config(with_plc) == spec_from_config(E4B_CONFIG)


def test_tiny_model_exercises_every_mechanism(tiny_dir):
    spec = load_spec(tiny_dir)
    assert spec.ple_dim > 0
    assert {SLIDING, FULL} == set(spec.layer_types)
    assert len({layer.head_dim for layer in spec.layers}) == 2
    assert any(not layer.is_producer for layer in spec.layers)
    assert spec.num_heads >= 4 and {layer.num_kv_heads for layer in spec.layers} == {2}
    assert spec.final_logit_softcapping == 30.0 and spec.tie_word_embeddings
    assert spec.sliding_window < 26  # shorter than the shortest test prompt


def test_layer_scalars_are_not_one(tiny_dir):
    from safetensors import safe_open

    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        scalars = [f.get_tensor(k).item() for k in f.keys() if k.endswith("layer_scalar")]
    assert len(scalars) == 8 and all(abs(s - 1.0) > 0.05 for s in scalars)


@pytest.mark.parametrize(("key", "value"), [("attention_k_eq_v", True), ("enable_moe_block", True),
                                            ("hidden_activation", "silu")])
def test_unsupported_features_are_refused_by_name(key, value):
    config = copy.deepcopy(E4B_CONFIG)
    config["text_config"][key] = value
    with pytest.raises(UnsupportedModelError, match=key):
        spec_from_config(config)


def test_not_a_gemma4_config():
    with pytest.raises(UnsupportedModelError, match="model_type 'llama'"):
        spec_from_config({"model_type": "llama"})


def test_rope_inv_freq_matches_transformers():
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    spec = spec_from_config(E4B_CONFIG)
    text = {k: v for k, v in E4B_CONFIG["text_config"].items() if k != "model_type"}
    hf = Gemma4TextRotaryEmbedding(Gemma4TextConfig(**text))
    for layer_type in (FULL, SLIDING):
        assert torch.equal(rope_inv_freq(spec.ropes[layer_type]), getattr(hf, f"{layer_type}_inv_freq"))


def test_plan_splits_heads_and_keeps_gqa_groups():
    spec = spec_from_config(E4B_CONFIG)
    plan = ShardPlan(spec, 2)
    plan.check()
    # q: 8 heads x 256 -> rank 1 owns heads 4..7; k: 2 heads -> rank 1 owns head 1.
    assert plan.rank_range("layers.0.self_attn.q_proj.weight", 1) == (0, 1024, 2048)
    assert plan.rank_range("layers.0.self_attn.k_proj.weight", 1) == (0, 256, 512)
    assert plan.rank_range("layers.5.self_attn.k_proj.weight", 1) == (0, 512, 1024)  # full layer, head_dim 512
    assert plan.rank_range("layers.0.self_attn.o_proj.weight", 0) == (1, 0, 1024)
    assert plan.rank_range("layers.0.mlp.down_proj.weight", 1) == (1, 5120, 10240)
    assert plan.rank_range("lm_head.weight", 1) == (0, 131072, 262144)
    assert plan.rank_range("layers.0.input_layernorm.weight", 1) is None
    assert plan.rank_range("layers.0.layer_scalar", 0) is None
    assert "embed_tokens_per_layer.weight" not in plan.rank_tensor_names()
    assert ShardPlan(spec, 1).rank_range("layers.0.self_attn.q_proj.weight", 0) is None


@pytest.mark.parametrize("tp", [3, 6, 0])
def test_plan_refuses_tp_that_does_not_divide_heads(tp):
    spec = spec_from_config(E4B_CONFIG)
    with pytest.raises(ConfigError, match="variant.tp_degree") as err:
        ShardPlan(spec, tp).check()
    assert "[1, 2, 4, 8]" in str(err.value) or tp == 0


def e2b_config() -> dict:
    """E2B's text config (one KV head; 35 layers, period five, 20 KV-shared with a double-wide MLP), docs/models.md."""
    return {"model_type": "gemma4", "tie_word_embeddings": True, "text_config": dict(E2B_TEXT)}


def test_fewer_kv_heads_than_ranks_are_copied_whole_and_counted_on_every_rank():
    spec = spec_from_config(e2b_config())
    assert {layer.num_kv_heads for layer in spec.layers} == {1}
    assert [layer.intermediate_size for layer in spec.layers] == [6144] * 15 + [12288] * 20
    one, two = ShardPlan(spec, 1), ShardPlan(spec, 2)
    two.check()
    k, q = "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.q_proj.weight"
    assert [two.rank_range(k, r) for r in (0, 1)] == [(0, 0, 256), (0, 0, 256)]  # head 0 on both ranks
    assert two.rank_shape(k) == (256, 1536) and two.rank_range(q, 1) == (0, 1024, 2048)
    assert two.rank_range("layers.4.self_attn.v_proj.weight", 1) == (0, 0, 512)  # full layer, head_dim 512
    kv = [n for n in one.rank_tensor_names() if n.endswith(("k_proj.weight", "v_proj.weight"))]
    assert len(kv) == 2 * 15 and {two.rank_shape(n) for n in kv} == {one.rank_shape(n) for n in kv}  # a whole copy
    assert two.rank_kv_bytes(512, 1, torch.bfloat16) == one.rank_kv_bytes(512, 1, torch.bfloat16)  # a whole copy each
    full = torch.arange(256 * 4, dtype=torch.float32).view(256, 4)
    assert torch.equal(two.builder_tensor(k, full), torch.cat([full, full]))  # NxD's equal chunks: head 0 twice
    assert two.builder_tensor(q, full) is full and one.builder_tensor(k, full) is full


def test_the_device_memory_estimate_counts_each_ranks_copy_of_the_kv_head():
    """A decode step of 4 lines over 32,768 positions writes E2B's caches (one head, 512 wide on its full layers) with
    six full-size temporaries: every rank does, its copy of the head whole (pipeline/backends/neuron_memory.py)."""
    from pipeline.backends.neuron_memory import layer_activations
    from pipeline.core.shape import BuildShape

    spec = spec_from_config(e2b_config())
    shape = BuildShape(kv_max=32768, bucket=512, dtype="bf16", prefill="device", tp_degree=2, batch_size=4)
    assert layer_activations(spec, shape, tokens=1, rows=4) >= 6 * 4 * 1 * 32768 * 512 * 2


def test_two_kv_heads_over_four_ranks_give_each_rank_the_head_its_queries_attend():
    spec = spec_from_config(E4B_CONFIG)  # 8 query heads, 2 KV heads: ranks 0-1 attend head 0, ranks 2-3 head 1
    plan = ShardPlan(spec, 4)
    plan.check()
    assert [plan.rank_range("layers.0.self_attn.k_proj.weight", r) for r in range(4)] == [
        (0, 0, 256), (0, 0, 256), (0, 256, 512), (0, 256, 512)]
    full = torch.arange(512, dtype=torch.float32).view(512, 1)
    chunks = plan.builder_tensor("layers.0.self_attn.k_proj.weight", full).chunk(4)
    assert [torch.equal(c, full[a:b]) for c, (_, a, b) in zip(chunks, [
        plan.rank_range("layers.0.self_attn.k_proj.weight", r) for r in range(4)])] == [True] * 4
    caches = [torch.arange(2 * 3, dtype=torch.float32).view(1, 2, 3, 1)]
    assert [r[0][0, 0, :, 0].tolist() for r in split_kv_for_ranks(caches, 4, torch.float32)] == [
        [0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]


def test_kv_seeding_sends_head_r_to_rank_r():
    caches = [torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4), torch.ones(1, 2, 3, 4)]
    per_rank = split_kv_for_ranks(caches, 2, torch.bfloat16)
    assert len(per_rank) == 2 and all(len(r) == 2 for r in per_rank)
    assert torch.equal(per_rank[0][0].float(), caches[0][:, 0:1])
    assert torch.equal(per_rank[1][0].float(), caches[0][:, 1:2])
    assert per_rank[1][1].dtype == torch.bfloat16 and per_rank[1][1].shape == (1, 1, 3, 4)
    with pytest.raises(ValueError, match="neither split over nor copy onto"):
        split_kv_for_ranks([torch.zeros(1, 3, 2, 2)], 2, torch.float32)


@pytest.mark.parametrize("chunk", [1, 200, 1 << 30])
def test_chunked_checkpoint_reads_equal_whole_slices(tiny_dir, monkeypatch, chunk):
    from safetensors.torch import load_file

    from pipeline.recipe import checkpoint as module

    monkeypatch.setattr(module, "READ_CHUNK_BYTES", chunk)
    spec = load_spec(tiny_dir)
    full = load_file(tiny_dir / "model.safetensors")
    with module.Checkpoint(tiny_dir, "model.") as ckpt:
        head = ckpt.read("lm_head.weight", spec, 0, 256, 512)
        down = ckpt.read("layers.1.mlp.down_proj.weight", spec, 1, 128, 256)
        norm = ckpt.read("norm.weight", spec)
    assert torch.equal(head, full["model.embed_tokens.weight"][256:512])
    assert torch.equal(down, full["model.layers.1.mlp.down_proj.weight"][:, 128:256])
    assert torch.equal(norm, full["model.norm.weight"])
