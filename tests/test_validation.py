"""The validate stage decides what ships: broken artifacts fail every parity mode, bf16 passes on its logits, a
failure explains itself, throughput is reported NxDI-style and gated, and bad input is refused before loading."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pipeline.backends.base import CheckpointRef, TraceRequest
from pipeline.backends.cpu import CpuBackend
from pipeline.core.errors import InputError, ParityError, PipelineError, ThroughputError
from pipeline.core.fsutil import atomic_write_json, read_json, sha256_file
from pipeline.paths import Paths

from .helpers import FAST_VALIDATE, config, edited_checkpoint, run

MODES = ("exact", "teacher_forced", "logits")


@pytest.fixture(scope="module")
def project(validated_512_fp32) -> Path:
    """A healthy 512_fp32 build of the tiny model, validated and published (shared: read it, or clone_variant it)."""
    return validated_512_fp32


def clone_variant(project: Path, tmp_path: Path) -> Path:
    """A private copy of the project's artifacts, so a test can break its build without touching the others."""
    root = tmp_path / "artifacts"
    shutil.copytree(project, root, symlinks=True, ignore=shutil.ignore_patterns("logs", "published"))
    return root


def replace_ranks(root: Path, files: dict[str, Path]) -> None:
    """Swap rank files into the build, recording them in build.json as a trace would have."""
    paths = Paths(root, "gemma4_tiny", "512_fp32")
    for name, src in files.items():
        shutil.copyfile(src, paths.build / name)
    record = read_json(paths.build_record)
    for member in record["members"]:
        member["size"] = (paths.build / member["path"]).stat().st_size
        member["sha256"] = sha256_file(paths.build / member["path"])
    atomic_write_json(paths.build_record, record)


def trace_from(weights: Path, out: Path, cfg) -> Path:
    CpuBackend().trace(TraceRequest(CheckpointRef(weights, "model."), cfg.variant.shape), out)
    return out


def perturb_rank1(tensors):
    """Noise on the half of layer 2's up projection that rank 1 owns."""
    weight = tensors["model.layers.2.mlp.up_proj.weight"]
    half = weight.shape[0] // 2
    weight[half:] += 0.5 * torch.randn(weight[half:].shape, generator=torch.Generator().manual_seed(0))


def scalars_to_one(tensors):
    for key in tensors:
        if key.endswith("layer_scalar"):
            tensors[key] = torch.ones_like(tensors[key])


def break_build(kind: str, root: Path, tmp_path: Path, cfg) -> None:
    paths = Paths.of(cfg)
    if kind == "swapped_ranks":
        keep = tmp_path / "keep"
        keep.mkdir()
        for name in ("tp_0.pt", "tp_1.pt"):
            shutil.copyfile(paths.build / name, keep / name)
        replace_ranks(root, {"tp_0.pt": keep / "tp_1.pt", "tp_1.pt": keep / "tp_0.pt"})
        return
    edit = perturb_rank1 if kind == "perturbed_rank" else scalars_to_one
    weights = edited_checkpoint(paths.weights, tmp_path / "edited", edit)
    built = trace_from(weights, tmp_path / "edited_build", cfg)
    ranks = {"tp_1.pt": built / "tp_1.pt"} if kind == "perturbed_rank" else {
        "tp_0.pt": built / "tp_0.pt", "tp_1.pt": built / "tp_1.pt"}
    replace_ranks(root, ranks)


@pytest.fixture(scope="module", params=["perturbed_rank", "skipped_layer_scalar", "swapped_ranks"])
def broken(request, project, tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp(request.param)
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE)
    break_build(request.param, root, tmp_path, cfg)
    run(cfg, "package")
    return root


@pytest.mark.parametrize("mode", MODES)
def test_a_broken_artifact_fails_every_parity_mode(broken, mode):
    cfg = config(broken, *FAST_VALIDATE, f"validate.parity.fp32={mode}")
    with pytest.raises(ParityError, match=f"parity failed \\({mode}\\)"):
        run(cfg, "validate")
    metrics = read_json(Paths.of(cfg).metrics)
    assert metrics["gates"]["passed"] is False and metrics["parity"]["passed"] is False
    with pytest.raises(PipelineError, match="refusing to publish an artifact that did not pass validation"):
        run(cfg, "publish")


def test_the_healthy_build_passed_every_gate_and_reports_nxdi_keys(project):
    paths = Paths(project, "gemma4_tiny", "512_fp32")
    metrics = read_json(paths.metrics)
    assert metrics["gates"] == {"parity": True, "throughput": True, "passed": True}
    tput = metrics["throughput"]
    for key in ("latency_ms_p50", "latency_ms_p90", "latency_ms_p95", "latency_ms_p99", "latency_ms_p100",
                "latency_ms_avg", "throughput", "tokens_per_s", "ms_per_token", "ttft_ms"):
        assert tput[key] > 0, key
    assert metrics["peak_rss_mb"]["host"] > 0 and metrics["peak_rss_mb"]["ranks"] > 0
    assert all(isinstance(v, (int, float, bool)) or v is None or isinstance(v, (dict, str))
               for v in metrics.values())
    report = read_json(paths.validation_report)
    assert report["backend"] == "cpu" and report["hardware"] == "local"
    assert report["throughput_gate"]["floor"] == "cpu.any"
    rows = read_json(paths.plot_rows)
    assert [r["context"] for r in rows] == ["short"] and rows[0]["tokens_per_s"] > 0


def test_the_failure_report_says_where_and_why(project, tmp_path):
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE)
    break_build("skipped_layer_scalar", root, tmp_path, cfg)
    run(cfg, "package")
    with pytest.raises(ParityError) as err:
        run(cfg, "validate")
    message = str(err.value)
    assert "capital (26 tokens), first divergence at new token 0" in message
    assert "reference top:" in message and "ours top:" in message
    entry = read_json(Paths.of(cfg).validation_report)["prompts"][0]
    divergence = entry["divergence"]
    assert entry["prompt"] == "capital" and divergence["step"] == 0
    assert len(divergence["reference_top"]) == 5 and len(divergence["ours_top"]) == 5
    assert divergence["reference_after"] != divergence["ours_after"]


def test_bf16_passes_on_its_logits(project, tmp_path):
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE, variant="512_bf16")
    run(cfg)
    metrics = read_json(Paths.of(cfg).metrics)
    assert metrics["parity"]["mode"] == "logits" and metrics["parity"]["passed"] is True
    assert metrics["parity"]["teacher_forced_match"] >= 0.9


def test_a_throughput_floor_fails_the_stage_with_a_table(project, tmp_path):
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE, "+validate.throughput.floors.cpu.local.tokens_per_s=100000")
    with pytest.raises(ThroughputError, match=r"below the cpu.local floor:[\s\S]*decode tokens/s .* vs limit 100000"):
        run(cfg, "validate")
    assert read_json(Paths.of(cfg).metrics)["gates"] == {"parity": True, "throughput": False, "passed": False}


# -- bad input, refused before anything is loaded ---------------------------------------------------------------

def test_a_prompt_longer_than_the_variant_allows_is_refused_before_loading(project, tmp_path, monkeypatch):
    from pipeline.stages import validate

    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE, "validate.prompt_names=[capital,spans_512]")
    monkeypatch.setattr(validate, "run_fresh", lambda job, *_: pytest.fail("validation started"))
    with pytest.raises(InputError, match=r"'spans_512' has 1099 tokens; .* variant.kv_max is 512"):
        run(cfg, "validate")


def test_a_missing_reference_is_named(project, tmp_path):
    root = clone_variant(project, tmp_path)
    (root / "gemma4_tiny" / "reference.json").unlink()
    with pytest.raises(PipelineError, match=r"reference.json missing or unreadable: run stage=reference"):
        run(config(root, *FAST_VALIDATE), "validate")


def test_a_stale_reference_is_named(project, tmp_path):
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE, "validate.prompts.1.max_tokens=50")
    with pytest.raises(PipelineError, match=r"reference.json is stale: validate.prompts or validate.max_new_tokens"):
        run(cfg, "validate")
    reference = read_json(root / "gemma4_tiny" / "reference.json")
    reference["model"]["weights_digest"] = "0" * 64
    atomic_write_json(root / "gemma4_tiny" / "reference.json", reference)
    with pytest.raises(PipelineError, match=r"reference.json is stale: it was made for other weights"):
        run(config(root, *FAST_VALIDATE), "validate")


def test_a_variant_the_prompts_do_not_cover_is_refused(project):
    """A custom variant whose bucket no prompt comes near must get prompts added, not a vacuous pass."""
    from pipeline.core.shape import BuildShape
    from pipeline.validation.worker import select_prompts

    reference = read_json(project / "gemma4_tiny" / "reference.json")
    with pytest.raises(InputError, match="lack one between half a bucket and a bucket and one longer than two"):
        select_prompts(reference["prompts"], BuildShape(2048, 1024, "fp32", "device", 2), 32, None)
    chosen, coverage = select_prompts(reference["prompts"], BuildShape(512, 128, "fp32", "device", 2), 32, None)
    assert coverage == {"near_bucket": ["near_128"], "multi_bucket": ["near_512"]}
    assert len(chosen) == 5
