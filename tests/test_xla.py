"""backend=xla: the graphs neuronx-cc would receive, lowered by torch-xla on its CPU device, checked and run.

The HLO reading and the refusal without torch-xla run in `make test`; everything that lowers a graph needs torch-xla
2.8 (torch 2.8) and runs in `make test-xla` (REQUIRE_TORCH_XLA=1 turns a missing torch-xla into a failure there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.backends import hlo
from pipeline.config import available_variants
from pipeline.core.errors import BuildError, IntegrityError
from pipeline.core.shape import BuildShape

from .conftest import built_once
from .helpers import CONF, E2B_SHAPE, FAST_VALIDATE

REPO = Path(__file__).resolve().parent.parent
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
needs_torch_xla = pytest.mark.skipif(not HAS_TORCH_XLA and not os.environ.get("REQUIRE_TORCH_XLA"),
                                     reason="torch-xla is not installed: `make test-xla` runs these")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=900)


# -- reading HLO text (any environment) ------------------------------------------------------------------------------

# What torch-xla prints for a graph (shortened): a reducer computation, then the entry with debug metadata.
HLO_TEXT = """HloModule IrToHlo.17, entry_computation_layout={(f32[], f32[2,4]{1,0})->(f32[2]{0}, f32[2,4]{1,0})}

%AddComputation.3 (x.4: f32[], y.5: f32[]) -> f32[] {
  %x.4 = f32[] parameter(0)
  %y.5 = f32[] parameter(1)
  ROOT %add.6 = f32[] add(f32[] %x.4, f32[] %y.5)
}

ENTRY %IrToHlo.17 (p0.1: f32[], p1.2: f32[2,4]) -> (f32[2], f32[2,4]) {
  %p1.2 = f32[2,4]{1,0} parameter(1), metadata={op_type="xla__device_data" op_name="xla__device_data" \
source_file="/ckout/pipeline/recipe/model.py" source_line=40}
  %tanh.7 = f32[2,4]{1,0} tanh(f32[2,4]{1,0} %p1.2), metadata={op_type="aten__tanh" op_name="aten__tanh" \
source_file="/ckout/pipeline/recipe/model.py" source_line=32}
  %p0.1 = f32[] parameter(0)
  %reduce.8 = f32[2]{0} reduce(f32[2,4]{1,0} %tanh.7, f32[] %p0.1), dimensions={1}, to_apply=%AddComputation.3
  ROOT %tuple.9 = (f32[2]{0}, /*index=1*/f32[2,4]{1,0}) tuple(f32[2]{0} %reduce.8, f32[2,4]{1,0} %tanh.7)
}
""".replace("\\\n", "")


def test_a_graph_record_holds_the_entry_computations_opcodes_and_shapes():
    found = hlo.record(HLO_TEXT)
    assert found.opcodes == {"parameter": 2, "reduce": 1, "tanh": 1, "tuple": 1}  # not the reducer's add
    assert found.parameters == ["f32[]", "f32[2,4]"]  # in parameter order, not text order
    assert found.outputs == ["f32[2]", "f32[2,4]"]
    # The hash ignores what differs between checkouts (source paths) and processes (the module's serial number) ...
    moved = HLO_TEXT.replace("/ckout/", "/elsewhere/").replace("IrToHlo.17", "IrToHlo.90210")
    assert hlo.record(moved).hlo_sha256 == found.hlo_sha256
    # ... and nothing else.
    assert hlo.record(HLO_TEXT.replace("tanh(", "exponential(")).hlo_sha256 != found.hlo_sha256


def test_an_operator_the_compiler_does_not_list_is_named_with_the_recipe_line(monkeypatch):
    assert hlo.unsupported(HLO_TEXT) == []
    assert {"add", "dot", "all-reduce", "all-gather", "scatter", "tanh"} <= hlo.supported_opcodes()
    monkeypatch.setattr(hlo, "supported_opcodes", lambda: frozenset({"parameter", "reduce", "tuple", "add"}))
    problems = hlo.unsupported(HLO_TEXT, Path("/ckout"))
    assert problems == [hlo.Unsupported("tanh", ["pipeline/recipe/model.py:32"])]
    message = hlo.describe("decode", problems)
    assert "the decode graph" in message and "tanh (from pipeline/recipe/model.py:32)" in message
    assert "pipeline/backends/neuronx_cc_xla_operators.py" in message


def test_the_operator_list_names_its_source_and_leaves_out_what_it_cannot_vouch_for():
    from pipeline.backends import neuronx_cc_xla_operators

    text = neuronx_cc_xla_operators.__doc__
    assert "neuron-cc-ops-xla.html" in text and "release-notes/compiler/neuronx-cc" in text
    assert len(hlo.supported_opcodes()) > 50
    assert not {"while", "custom-call", "sort"} & hlo.supported_opcodes()


def test_an_instruction_the_reader_cannot_parse_is_an_error_not_a_skipped_line():
    dynamic = HLO_TEXT.replace("%tanh.7 = f32[2,4]{1,0} tanh", "%tanh.7 = f32[<=2,4]{1,0} tanh")
    with pytest.raises(ValueError, match="cannot parse.*tanh"):
        hlo.unsupported(dynamic)
    with pytest.raises(ValueError, match="cannot parse"):
        hlo.record(dynamic)


@pytest.mark.skipif(HAS_TORCH_XLA, reason="checks the refusal where torch-xla is absent (`make test`)")
def test_backend_xla_without_torch_xla_names_the_extra_and_the_make_target(tmp_path):
    root = tmp_path / "artifacts"
    assert cli("+variant=512_fp32", "backend=xla", f"artifacts_dir={root}", "stage=model").returncode == 0
    for stage in ("toolchain", "trace"):  # a refused run changes no record: no toolchain.json either
        proc = cli("+variant=512_fp32", "backend=xla", f"artifacts_dir={root}", f"stage={stage}")
        assert proc.returncode == 1
        assert "backend=xla needs torch-xla" in proc.stderr and "[xla]" in proc.stderr
        assert "make test-xla" in proc.stderr
    assert not (root / "toolchain.json").exists()
    assert sorted(p.name for p in (root / "gemma4_tiny").iterdir()) == ["model.json", "weights"]  # nothing begun


# -- through the pipeline, on torch-xla ------------------------------------------------------------------------------

def build(root: Path, variant: str, *overrides: str) -> subprocess.CompletedProcess:
    return cli(f"+variant={variant}", "backend=xla", f"artifacts_dir={root}", *FAST_VALIDATE, *overrides)


def one_rank_name(variant: str) -> str:
    """The folder a build of ``variant`` at tp_degree 1 goes into: its derived name (pipeline/run.py derived_name),
    never the shipped variant's."""
    return f"{variant}+tp1"


def trace_record(root: Path, variant: str) -> dict:
    return json.loads((root / "gemma4_tiny" / variant / "build.json").read_text())["trace"]


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory) -> Path:
    """512_fp32 at tp_degree 1 on torch-xla, every stage: traced, packaged, validated token for token, published.
    Built once per run and shared between workers: a test that rebuilds works on a copy."""
    def make(folder: Path) -> Path:
        proc = build(folder / "artifacts", "512_fp32", "variant.tp_degree=1")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return folder / "artifacts"

    return built_once(tmp_path_factory, "xla-one-rank", make)


@needs_torch_xla
def test_fp32_on_the_xla_device_matches_the_reference_token_for_token(one_rank):
    metrics = json.loads((one_rank / "gemma4_tiny" / one_rank_name("512_fp32") / "metrics.json").read_text())
    assert metrics["parity"]["mode"] == "exact" and metrics["parity"]["passed"]
    published = sorted(p.name for p in (one_rank / "published").iterdir() if not p.name.startswith("."))
    assert one_rank_name("512_fp32") in published  # the variant's folder of the publish repository


@needs_torch_xla
def test_the_build_record_holds_what_the_compiler_would_see_and_what_running_it_showed(one_rank, tiny_dir):
    from pipeline.recipe.spec import load_spec

    spec = load_spec(tiny_dir)
    trace = trace_record(one_rank, one_rank_name("512_fp32"))
    (rank,) = trace["ranks"]
    assert sorted(rank["graphs"]) == ["decode", "prefill"]
    decode, prefill = rank["graphs"]["decode"], rank["graphs"]["prefill"]
    assert decode["hlo_sha256"] != prefill["hlo_sha256"]
    # What the neuron backend compiles: the logits, then every cache (aliased); the greedy token is taken on the host.
    caches = rank["checks"]["caches"]
    assert decode["outputs"][0] == f"f32[1,{spec.vocab_size}]" and len(decode["outputs"]) == 1 + caches
    assert "s64" not in " ".join(decode["outputs"])
    hidden = spec.hidden_size  # the embeddings of one token and of a 128-token bucket
    assert f"f32[1,1,{hidden}]" in decode["parameters"] and f"f32[1,128,{hidden}]" in prefill["parameters"]
    assert decode["opcodes"]["dot"] > 0 and "all-reduce" not in decode["opcodes"]  # one rank: no collective
    checks = rank["checks"]
    assert checks["executed"] and checks["compiles_at_warm_up"] == 2 and checks["compiles_after_warm_up"] == 0
    assert checks["host_fallbacks"] == [] and checks["aliased_inputs_per_graph"] == [caches, caches]
    assert trace["torch_xla"] and trace["members"][0]["path"] == "tp_0.pt"


@needs_torch_xla
def test_the_preflights_estimate_covers_what_the_xla_processes_used(one_rank):
    variant = one_rank / "gemma4_tiny" / one_rank_name("512_fp32")
    built = json.loads((variant / "build.json").read_text())["preflight"]
    figures = built["estimate"]["resources_gb"]
    assert 0 < built["measured"]["graph_peak_rss_bytes"] <= figures["trace_per_graph_gb"] * 2**30
    peaks = json.loads((variant / "validation.json").read_text())["preflight"]["measured"]["validation_peak_rss_mb"]
    assert 0 < peaks["host"] + peaks["ranks"] <= figures["validate_gb"] * 1024  # the worker and its one rank


@needs_torch_xla
def test_a_rebuild_lowers_the_same_graphs_and_writes_the_same_bytes(one_rank, tmp_path):
    root = tmp_path / "artifacts"
    shutil.copytree(one_rank, root, symlinks=True)
    before = trace_record(root, one_rank_name("512_fp32"))
    proc = build(root, "512_fp32", "variant.tp_degree=1", "stage=trace", "force=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = trace_record(root, one_rank_name("512_fp32"))
    assert after["members"] == before["members"]
    assert after["ranks"][0]["graphs"] == before["ranks"][0]["graphs"]


@needs_torch_xla
@pytest.mark.parametrize("variant", ["512_bf16", "256_bf16_host"])
def test_bf16_passes_its_logits_mode(tmp_path, variant):
    # host prefill: the host's float model fills the caches, then the decode-with-state graph runs on the device
    root = tmp_path / "artifacts"
    proc = build(root, variant, "variant.tp_degree=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((root / "gemma4_tiny" / one_rank_name(variant) / "metrics.json").read_text())
    assert metrics["parity"]["mode"] == "logits" and metrics["parity"]["passed"]
    (rank,) = trace_record(root, one_rank_name(variant))["ranks"]
    built = json.loads((root / "gemma4_tiny" / one_rank_name(variant) / "build.json").read_text())
    prefill, ladder = built["variant"]["prefill"], built["variant"].get("smaller_buckets", [])
    assert sorted(rank["graphs"]) == (["decode"] if prefill == "host" else  # 512_bf16: its ladder's graph too
                                      sorted(["decode", "prefill", *(f"prefill_{b}" for b in ladder)]))
    assert variant == "256_bf16_host" or ladder == [16, 32]
    assert rank["checks"]["compiles_after_warm_up"] == 0


@needs_torch_xla
@pytest.mark.parametrize(("variant", "name"), [("512_fp32", "512_fp32+tp1+bs3"),
                                               ("256_bf16_host", "256_bf16_host+fp32+tp1+bs3")])
def test_a_batch_lowers_runs_and_decodes_each_sequence_as_alone(tmp_path, variant, name):
    """At batch 3 on one rank: every graph takes seq_ids (prefill: one line; decode: the three rows), compiles nothing
    after its warm-up and updates every line's caches in place; a host prefill seeds one line of the device's caches;
    each prompt is the reference's token for token, and decoded together, bit for bit, itself decoded alone, one
    taking a line mid-flight. In fp32: torch-xla's CPU client rounds a batch's graphs unlike batch 1's (logits ~3e-6
    apart), which a bf16 cache write can amplify past the dtype-noise bound on the tiny model (docs/xla.md)."""
    root = tmp_path / "artifacts"
    proc = build(root, variant, "variant.tp_degree=1", "variant.batch_size=3", "variant.dtype=fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rank,) = trace_record(root, name)["ranks"]
    checks = rank["checks"]
    assert checks["compiles_after_warm_up"] == 0 and checks["host_fallbacks"] == []
    assert checks["aliased_inputs_per_graph"] == [checks["caches"]] * len(rank["graphs"])
    for entry, graph in rank["graphs"].items():  # seq_ids: a prefill's one line beside its last index, or three rows
        wanted = {"s64[3]": 1, "s64[3,1]": 1} if entry == "decode" else {"s64[1]": 2}
        assert {p: graph["parameters"].count(p) for p in wanted} == wanted, graph["parameters"]
    together = json.loads((root / "gemma4_tiny" / name / "validation.json").read_text())["batch_parity"]
    assert together["passed"] and together["reused_mid_flight"] >= 1


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """An artifacts folder with the toolchain (backend=xla) and the tiny model: what the trace stage reads. Shared
    between workers: each test traces its own variant there, under the stage locks."""
    def make(folder: Path) -> Path:
        for stage in ("toolchain", "model"):
            proc = cli("+variant=512_fp32", "backend=xla", f"artifacts_dir={folder / 'artifacts'}", f"stage={stage}")
            assert proc.returncode == 0, proc.stderr[-3000:]
        return folder / "artifacts"

    return built_once(tmp_path_factory, "xla-prepared", make)


@needs_torch_xla
@pytest.mark.parametrize("variant", available_variants(CONF))
def test_every_held_in_variant_lowers_to_listed_operators_with_its_collectives(prepared, variant):
    """Each variant as it ships: every rank's graphs lowered and recorded, the graphs their shape asks for, each at
    tp_degree 2 with the row-parallel all-reduces and the head's all-gather (none at tp_degree 1)."""
    proc = cli(f"+variant={variant}", "backend=xla", f"artifacts_dir={prepared}", "stage=trace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = json.loads((prepared / "gemma4_tiny" / variant / "build.json").read_text())
    variant_record = built["variant"]
    ladder = [f"prefill_{b}" for b in variant_record.get("smaller_buckets", [])]  # a graph per bucket
    entries = ["decode"] if variant_record["prefill"] == "host" else sorted(["decode", "prefill", *ladder])
    tp_degree = variant_record["tp_degree"]
    for rank in built["trace"]["ranks"]:
        assert sorted(rank["graphs"]) == entries
        for graph in rank["graphs"].values():
            collectives = (graph["opcodes"].get("all-reduce", 0) > 0, graph["opcodes"].get("all-gather", 0))
            assert collectives == ((True, 1) if tp_degree == 2 else (False, 0))
            assert not set(graph["opcodes"]) - hlo.supported_opcodes()
    assert len(built["trace"]["ranks"]) == tp_degree == (1 if variant.endswith("_tp1") else 2)


@needs_torch_xla
def test_e2b_shape_is_validated_on_one_rank_and_lowered_on_two_with_its_kv_head_copied(tmp_path):
    """The tiny model in E2B's shape (one KV head): 512_bf16_tp1 through every stage on the XLA device, validated;
    512_fp32's two ranks lowered, each attending its query heads over its copy of the one KV head."""
    root = tmp_path / "artifacts"
    proc = build(root, "512_bf16_tp1", *E2B_SHAPE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((root / "gemma4_tiny" / "512_bf16_tp1" / "metrics.json").read_text())
    assert metrics["parity"]["passed"]
    proc = cli("+variant=512_fp32", "backend=xla", f"artifacts_dir={root}", "stage=trace", *E2B_SHAPE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = trace_record(root, "512_fp32")["ranks"]
    assert len(ranks) == 2 and all(graph["opcodes"]["all-reduce"] > 0 for r in ranks for graph in r["graphs"].values())


@needs_torch_xla
def test_two_ranks_are_lowered_and_not_run_and_their_validation_is_refused_before_any_work(prepared, tmp_path):
    proc = cli("+variant=256_bf16_host", "backend=xla", f"artifacts_dir={prepared}", "stage=trace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = trace_record(prepared, "256_bf16_host")["ranks"]
    assert [r["file"] for r in ranks] == ["tp_0.pt", "tp_1.pt"]
    assert all(not r["checks"]["executed"] and "collectives" in r["checks"]["why"] for r in ranks)
    # Each graph holds its own collectives only (torch-xla chains them through one token per device).
    assert ranks[0]["graphs"] == ranks[1]["graphs"]
    # The whole pipeline on a tp_degree 2 variant is refused before its first stage ...
    root = tmp_path / "artifacts"
    proc = build(root, "256_bf16_host")
    assert proc.returncode == 1 and "backend=xla runs builds of tp_degree 1 only" in proc.stderr
    assert "variant.tp_degree=2" in proc.stderr and not (root / "gemma4_tiny").exists()
    # ... and the validate stage alone refuses before the preflight and the archive.
    assert cli("+variant=256_bf16_host", "backend=xla", f"artifacts_dir={prepared}", "stage=package").returncode == 0
    proc = cli("+variant=256_bf16_host", "backend=xla", f"artifacts_dir={prepared}", "stage=validate")
    assert proc.returncode == 1 and "backend=xla runs builds of tp_degree 1 only" in proc.stderr
    assert "preflight" not in proc.stderr and not (prepared / "gemma4_tiny" / "256_bf16_host" / "validate").exists()


@needs_torch_xla
def test_a_bucket_that_would_make_a_graph_dynamic_is_refused_before_lowering(tmp_path):
    root = tmp_path / "artifacts"
    proc = build(root, "512_fp32", "variant.tp_degree=1", "variant.bucket=100")
    assert proc.returncode != 0 and "variant.kv_max=512 is not a multiple of variant.bucket=100" in proc.stderr
    assert not list((root / "gemma4_tiny").glob("512_fp32*"))  # neither the variant's folder nor a derived one


# -- the checks, each broken once (in this process, on torch-xla) ----------------------------------------------------

@pytest.fixture(scope="module")
def xla_rank_module():
    if not HAS_TORCH_XLA and not os.environ.get("REQUIRE_TORCH_XLA"):
        pytest.skip("torch-xla is not installed: `make test-xla` runs these")
    from pipeline.backends import xla_rank

    xla_rank.set_environment(2, debug=True)  # two virtual devices: tp_degree 2 graphs are lowered here too
    return xla_rank


@pytest.fixture
def rank_on_device(xla_rank_module, tiny_dir):
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.plan import ShardPlan, load_rank_state
    from pipeline.recipe.spec import load_spec

    spec, shape = load_spec(tiny_dir), BuildShape(64, 16, "fp32", "device", 1)
    with Checkpoint(tiny_dir, "model.") as ckpt:
        state = load_rank_state(ckpt, ShardPlan(spec, 1), 0, torch.float32)
    return xla_rank_module.rank_module(spec, shape, state), spec, shape


def test_the_unbroken_rank_passes_every_check(xla_rank_module, rank_on_device):
    found = xla_rank_module.run_checks(*rank_on_device)
    assert found.compiles_after_warm_up == 0 and found.host_fallbacks == []


def test_a_graph_that_changes_every_step_is_refused(xla_rank_module, rank_on_device, monkeypatch):
    from pipeline.recipe.model import RankDecoder

    rope = RankDecoder._rope

    def rope_sliced_at_a_python_int(self, positions, rows):  # a slice bound read back to the host: a graph per step
        start, count = int(positions.view(-1)[0]), positions.shape[-1]
        return rope(self, torch.arange(self.kv_max, device=positions.device)[start:start + count].view(1, count), rows)

    monkeypatch.setattr(RankDecoder, "_rope", rope_sliced_at_a_python_int)
    with pytest.raises(BuildError, match=r"(\d+) compilation\(s\) after the warm-up") as refused:
        xla_rank_module.run_checks(*rank_on_device)
    assert int(refused.value.args[0].split("lowered graphs ")[1].split()[0]) >= xla_rank_module.WARM_DECODE_STEPS


def test_an_operator_that_falls_back_to_the_host_is_refused(xla_rank_module, rank_on_device, monkeypatch):
    from pipeline.recipe.model import RankDecoder

    rope = RankDecoder._rope

    def rope_with_nonzero(self, positions, rows):  # torch.nonzero's shape depends on the data: run on the host
        return rope(self, positions + 0 * torch.nonzero(positions).sum(), rows)

    monkeypatch.setattr(RankDecoder, "_rope", rope_with_nonzero)
    with pytest.raises(BuildError, match=r"operators run on the host instead of in the graph: \[.*'aten::nonzero'"):
        xla_rank_module.run_checks(*rank_on_device)


def test_a_cache_that_is_replaced_instead_of_updated_in_place_is_refused(xla_rank_module, rank_on_device, monkeypatch):
    def replace_caches(module, caches):  # a new tensor each step: a second full copy of every cache
        for cache, new in zip(module.caches(), caches, strict=True):
            cache.data = new.clone()

    monkeypatch.setattr(xla_rank_module, "write_back", replace_caches)
    caches = len(rank_on_device[0].caches())
    with pytest.raises(BuildError, match=f"must update the {caches} KV caches in place"):
        xla_rank_module.run_checks(*rank_on_device)


def test_a_value_read_back_to_python_while_lowering_is_refused(xla_rank_module, rank_on_device, monkeypatch):
    from pipeline.recipe.model import RankDecoder

    rope = RankDecoder._rope

    def rope_read_back(self, positions, rows):  # .item() runs the graph so far: the compiler would get two graphs
        return rope(self, positions + 0 * int(positions.sum().item()), rows)

    monkeypatch.setattr(RankDecoder, "_rope", rope_read_back)
    with pytest.raises(BuildError, match="lowering the decode graph ran part of it"):
        xla_rank_module.lower(*rank_on_device, "decode")


def test_a_tp_degree_2_graph_without_its_all_reduces_is_refused(xla_rank_module, tiny_dir, monkeypatch):
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.plan import ShardPlan, load_rank_state
    from pipeline.recipe.spec import load_spec

    spec, shape = load_spec(tiny_dir), BuildShape(64, 16, "bf16", "host", 2)
    with Checkpoint(tiny_dir, "model.") as ckpt:
        state = load_rank_state(ckpt, ShardPlan(spec, 2), 0, torch.bfloat16)

    def graphs():
        module = xla_rank_module.rank_module(spec, shape, dict(state))
        text = xla_rank_module.lower(module, spec, shape, "decode")
        return module, {"decode": hlo.record(text)}

    module, lowered = graphs()
    assert xla_rank_module.collective_problems(module, lowered) == []
    assert lowered["decode"].opcodes["all-reduce"] == 2 * spec.num_layers  # attention output and MLP down
    monkeypatch.setattr(xla_rank_module.XlaRowLinear, "forward",
                        lambda self, x: xla_rank_module.ShardLinear.forward(self, x).float())  # the sums forgotten
    module, lowered = graphs()
    problems = xla_rank_module.collective_problems(module, lowered)
    assert problems and "'all-reduce': 0" in problems[0] and f"'all-reduce': {2 * spec.num_layers}" in problems[0]


def test_an_unlisted_operator_fails_the_trace_naming_graph_op_and_recipe_line(xla_rank_module, rank_on_device,
                                                                               monkeypatch):
    module, spec, shape = rank_on_device
    text = xla_rank_module.lower(module, spec, shape, "decode")
    listed = frozenset(hlo.record(text).opcodes) - {"tanh"}
    monkeypatch.setattr(hlo, "supported_opcodes", lambda: listed)
    with pytest.raises(BuildError, match=r"the decode graph .* tanh \(from pipeline/recipe/model.py:\d+"):
        xla_rank_module.check_operators("decode", text)


@needs_torch_xla  # skipped before one_rank (a session fixture, set up before xla_rank_module's own skip) builds
def test_a_loaded_rank_refuses_other_code_and_a_graph_other_than_the_one_traced(xla_rank_module, one_rank):
    saved = torch.load(one_rank / "gemma4_tiny" / one_rank_name("512_fp32") / "build" / "tp_0.pt", weights_only=True)
    shape = BuildShape(512, 128, "fp32", "device", 1)
    with pytest.raises(IntegrityError, match="built by other code than this checkout's"):
        xla_rank_module.LoadedRank(saved | {"code": "0" * 64}, shape)  # as if built by another pipeline version
    rank = xla_rank_module.LoadedRank(saved, shape)
    inputs = [t.cpu() for t in xla_rank_module.entry_inputs(rank.spec, shape, "decode")]
    logits, token = rank.step("decode", inputs)
    assert logits.shape == (1, rank.spec.vocab_size) and token.tolist() == logits.argmax(-1).tolist()
    saved["graphs"]["decode"]["hlo_sha256"] = "0" * 64  # as if torch-xla lowered it otherwise now
    with pytest.raises(IntegrityError, match="the decode graph lowered at load .* is not the one traced"):
        xla_rank_module.LoadedRank(saved, shape).step("decode", inputs)
