"""bf16 matmuls of many rows on a CPU without bf16 instructions: in fp32 over the same values (pipeline/host/
bf16_matmul.py). The route is read from the CPU; both routes decode the same tokens, their logits equal to bf16's
rounding; validation.json records which ran."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.errors import InputError
from pipeline.core.shape import BuildShape
from pipeline.host import bf16_matmul

from .test_cpu_backend import KV_MAX, build, run

BUCKET = 64  # a prefill of MIN_ROWS rows: the route applies


@pytest.fixture(scope="module")
def bf16_builds(tiny_dir, tmp_path_factory):
    """The tiny model's bf16 builds, by (tp_degree, prefill), each traced once."""
    cache = {}

    def get(tp: int, prefill: str):
        if (tp, prefill) not in cache:
            shape = BuildShape(KV_MAX, BUCKET, "bf16", prefill, tp)
            out = tmp_path_factory.mktemp("bf16") / f"{tp}_{prefill}"
            build(tiny_dir, out, shape)
            cache[tp, prefill] = out, shape
        return cache[tp, prefill]

    return get

X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f\n"  # AVX-512 without its BF16 extension
X86_BF16 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


@pytest.mark.parametrize("cpuinfo, flags, route", [(X86_AVX2, (), "fp32"), (X86_BF16, ("avx512_bf16",), "native"),
                                                   (ARM_BF16, ("bf16",), "native"), (None, (), "fp32")])
def test_the_route_is_chosen_from_the_cpus_flags(tmp_path, monkeypatch, cpuinfo, flags, route):
    monkeypatch.delenv(bf16_matmul.ENV, raising=False)
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    assert bf16_matmul.cpu_bf16_flags(path) == flags
    assert bf16_matmul.chosen(path) == route
    assert (bf16_matmul.MIN_ROWS, bf16_matmul.overridden()) == (64, False)  # what validation.json records beside


def test_the_environment_overrides_the_route_and_a_wrong_value_is_named(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    path.write_text(X86_BF16)
    monkeypatch.setenv(bf16_matmul.ENV, "fp32")
    assert bf16_matmul.chosen(path) == "fp32" and bf16_matmul.overridden()
    monkeypatch.setenv(bf16_matmul.ENV, "fast")
    with pytest.raises(InputError, match=r"^PIPELINE_BF16_MATMUL='fast' is not one of auto, native, fp32: unset it"):
        bf16_matmul.chosen(path)


def test_the_mode_widens_bf16_matmuls_of_many_rows_only():
    torch.manual_seed(0)
    w = torch.randn(96, 80).bfloat16()
    many, few = torch.randn(bf16_matmul.MIN_ROWS, 80).bfloat16(), torch.randn(4, 80).bfloat16()
    with bf16_matmul.Fp32Matmuls():
        wide = torch.nn.functional.linear(many, w)
        product = many @ w.T
        narrow = torch.nn.functional.linear(few, w)
        fp32 = torch.nn.functional.linear(many.float(), w.float())
    expected = torch.nn.functional.linear(many.float(), w.float()).bfloat16()
    assert wide.dtype == torch.bfloat16 and torch.equal(wide, expected) and torch.equal(product, expected)
    assert torch.equal(narrow, torch.nn.functional.linear(few, w))  # a decode step's rows: torch's own kernel
    assert fp32.dtype == torch.float32  # fp32 stays fp32


def test_only_a_one_row_bf16_graph_is_kept_from_onednn_and_the_switch_is_restored():
    """A decode step of one sequence goes through torch's own bf16 kernels; a batch's decode (4 rows) and the ladder's
    smallest bucket (32 rows) keep oneDNN's, faster from 4 rows on; an fp32 build is left alone."""
    ladder = BuildShape(256, 64, "bf16", "device", 2, smaller_buckets=(32,))
    assert bf16_matmul.one_row_entries(ladder) == ("decode",)
    assert bf16_matmul.one_row_entries(BuildShape(256, 64, "bf16", "device", 2, batch_size=4)) == ()
    assert bf16_matmul.one_row_entries(BuildShape(256, 64, "fp32", "device", 2)) == ()
    before = torch.backends.mkldnn.enabled
    with bf16_matmul.one_row():
        assert torch.backends.mkldnn.enabled is False
    assert torch.backends.mkldnn.enabled == before


def test_a_weight_widened_in_slices_gives_what_it_gives_widened_whole(monkeypatch):
    """The eager route widens a weight a slice of outputs at a time (E4B's vocabulary head is 2.7 GB in fp32): the
    same bf16 result as widened whole, bias included."""
    torch.manual_seed(0)
    x, w, bias = torch.randn(2, 70, 48).bfloat16(), torch.randn(100, 48).bfloat16(), torch.randn(100).bfloat16()
    whole = torch.nn.functional.linear(x.float(), w.float(), bias.float()).bfloat16()
    monkeypatch.setattr(bf16_matmul, "SLICE_ELEMENTS", 48 * 7)  # slices of 7 outputs, the last of 2
    with bf16_matmul.Fp32Matmuls():
        sliced = torch.nn.functional.linear(x, w, bias)
    assert sliced.dtype == torch.bfloat16 and sliced.shape == (2, 70, 100)
    assert torch.allclose(sliced.float(), whole.float(), rtol=2**-7, atol=0)  # to bf16's rounding, at most


def test_a_rank_graph_of_many_rows_is_rewritten_and_one_of_few_is_not(bf16_builds):
    build_dir, shape = bf16_builds(2, "device")  # loaded, not run: a rank's collectives need no group until called
    module = torch.jit.load(str(build_dir / "tp_0.pt"))
    assert bf16_matmul.widened_entries(shape) == ("prefill",)  # 64 rows; decode's 1 is not
    assert bf16_matmul.rewrite_rank(module, bf16_matmul.widened_entries(shape)) == ["prefill"]
    kinds = [n.kind() for n in module.prefill.graph.nodes()]
    linears = kinds.count("aten::linear") + kinds.count("aten::matmul")
    assert linears > 0 and kinds.count("prim::dtype") == linears  # every one casts back to its input's dtype
    assert "prim::dtype" not in [n.kind() for n in module.decode.graph.nodes()]


@pytest.mark.parametrize("prefill", ["device", "host"])
def test_both_routes_decode_the_same_tokens_with_logits_equal_to_bf16_rounding(bf16_builds, tiny_dir, prompts,
                                                                                hf_reference, monkeypatch, prefill):
    """A bf16 build on the tiny model, fed transformers' greedy continuation (teacher-forced) by each route (the fp32
    one forced): at every step the same greedy token wherever the two routes' logits differ by less than half the
    margin between the top two (the tiny model's random weights make near-ties, where any rounding may pick either), the
    fp32 route no farther from the fp32 reference than the native one (within 1.5x: two roundings of the same sums
    differ from each other about as much as from fp32; on a CPU without bf16 instructions torch's own bf16 kernels,
    forced here, are the farther ones, measured with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: 0.66 against
    0.43), and not identical (the fp32 route ran)."""
    build_dir, shape = bf16_builds(2, prefill)
    assert max(len(p) for p in prompts) >= bf16_matmul.MIN_ROWS  # a prefill of many rows, in either kind of prefill
    forced = [tokens for tokens, _ in hf_reference]
    found = {}
    for route in bf16_matmul.ROUTES:
        monkeypatch.setenv(bf16_matmul.ENV, route)
        found[route] = run(tiny_dir, build_dir, shape, prompts, forced)
    moved, compared = 0.0, 0
    for native, wide, (_, reference) in zip(found["native"], found["fp32"], hf_reference, strict=True):
        steps = min(len(native.logits), len(reference))
        native_error, wide_error = ((g.logits[:steps] - reference[:steps]).abs().max().item() for g in (native, wide))
        assert wide_error <= 1.5 * native_error, (native_error, wide_error)
        for a, b in zip(native.logits, wide.logits, strict=True):
            top2 = a.topk(2).values
            if top2[0] - top2[1] > 2 * (a - b).abs().max():  # then no rounding this small can reorder them
                assert a.argmax() == b.argmax()
                compared += 1
        moved = max(moved, (wide.logits - native.logits).abs().max().item())
    assert moved > 0 and compared >= 2 / 3 * sum(len(g.logits) for g in found["native"])  # not a vacuous check


def test_the_validation_preflight_counts_the_widened_weights_where_the_route_applies(monkeypatch):
    """512_bf16 of E4B validated through the fp32 route (this machine limited to AVX2): the worker 669.5 MB and each
    rank 7366.4 MB at peak, against 5432.1 MB through the bf16 kernels; the estimate covers it within 1.15, the
    estimate without the route does not. Ranks that do not run on the host (neuron) add nothing."""
    from pipeline.backends.registry import BACKENDS
    from pipeline.core.units import GIB
    from pipeline.host import preflight
    from pipeline.recipe.spec import spec_from_config

    from .test_spec_and_plan import E4B_CONFIG

    spec, shape = spec_from_config(E4B_CONFIG), BuildShape(512, 128, "bf16", "device", 2, smaller_buckets=(32,))
    cpu, neuron = BACKENDS["cpu"], BACKENDS["neuron"]
    plain = preflight.estimate(spec, shape, cpu, None).resources.validate_gb
    widened = preflight.estimate(spec, shape, cpu, None, fp32_route=True).resources.validate_gb
    assert widened - plain == pytest.approx(2 * cpu.factors.fp32_route_largest_copies * 671_088_640 / GIB)
    measured = (669.5 + 2 * 7366.4) / 1024
    assert plain < measured <= widened <= 1.15 * measured
    assert preflight.estimate(spec, shape, neuron, None, fp32_route=True).resources == \
        preflight.estimate(spec, shape, neuron, None).resources
    monkeypatch.setenv(bf16_matmul.ENV, "fp32")
    assert bf16_matmul.rank_graphs_widened(shape)
    assert not bf16_matmul.rank_graphs_widened(BuildShape(512, 128, "fp32", "device", 2))
    assert not bf16_matmul.rank_graphs_widened(BuildShape(512, 32, "bf16", "device", 2))  # no graph of 64 rows
    monkeypatch.setenv(bf16_matmul.ENV, "native")
    assert not bf16_matmul.rank_graphs_widened(shape)
