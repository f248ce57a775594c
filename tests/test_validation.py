"""The validate stage decides what ships: broken artifacts fail every parity mode, bf16 passes on its logits, a
failure explains itself, throughput is reported NxDI-style and gated, and bad input is refused before loading."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipeline.backends.base import CheckpointRef, TraceRequest
from pipeline.backends.cpu import CpuBackend
from pipeline.core import errors
from pipeline.core.errors import CheckpointError, InputError, ParityError, PipelineError, ThroughputError
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


BREAKAGES = ("perturbed_rank", "skipped_layer_scalar", "swapped_ranks")


def breakage_and_mode() -> list:
    """Every breakage in every parity mode; `make test` (and each version environment) runs a Latin square of them
    (each breakage once, each mode once), and the other six are marked slow (`make test-slow`), for `make test`'s
    budget."""
    square, rest = pytest.mark.across_versions("torch", "transformers"), pytest.mark.slow
    return [pytest.param(kind, mode, marks=square if (i - j) % len(MODES) == 0 else rest)
            for i, kind in enumerate(BREAKAGES) for j, mode in enumerate(MODES)]


@pytest.fixture(scope="module")
def broken(request, project, tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp(request.param)
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE)
    break_build(request.param, root, tmp_path, cfg)
    run(cfg, "package")
    return root


@pytest.mark.parametrize(("broken", "mode"), breakage_and_mode(), indirect=["broken"])
def test_a_broken_artifact_fails_every_parity_mode(broken, mode):
    cfg = config(broken, *FAST_VALIDATE, f"validate.parity.fp32={mode}")
    with pytest.raises(ParityError, match=f"parity failed \\({mode}\\)"):
        run(cfg, "validate")
    assert read_json(Paths.of(cfg).metrics)["parity"] == {"passed": False, "mode": mode}
    assert read_json(Paths.of(cfg).validation_report)["gates"]["passed"] is False
    with pytest.raises(PipelineError, match="refusing to publish an artifact that did not pass validation"):
        run(cfg, "publish")


@pytest.mark.across_versions("torch", "transformers")  # torch's numerics, transformers' reference
def test_the_healthy_build_passed_every_gate_and_reports_nxdi_keys(project):
    paths = Paths(project, "gemma4_tiny", "512_fp32")
    report = read_json(paths.validation_report)
    assert report["gates"] == {"parity": True, "throughput": True, "passed": True}
    tput = report["throughput"]
    for key in ("latency_ms_p50", "latency_ms_p90", "latency_ms_p95", "latency_ms_p99", "latency_ms_p100",
                "latency_ms_avg", "throughput", "tokens_per_s", "ms_per_token", "ttft_ms"):
        assert tput[key] > 0, key
    assert report["contexts"]["short"]["tokens_per_s"] == tput["tokens_per_s"]  # the slowest, of one context
    assert report["peak_rss_mb"]["host"] > 0 and report["peak_rss_mb"]["ranks"] > 0
    assert report["backend"] == "cpu" and report["hardware"] == "local"
    assert report["threads"] == {"host_prefill": 0, "decode": 1, "usable_cpus": len(os.sched_getaffinity(0))}
    assert report["throughput_gate"]["floor"] == "cpu.any"
    rows = read_json(paths.plot_rows)
    assert [r["context"] for r in rows] == ["short"] and rows[0]["tokens_per_s"] > 0


@pytest.mark.across_versions("torch", "transformers")  # torch's numerics, transformers' reference
def test_metrics_hold_the_headline_figures_only(project):
    """metrics.json is what dvc metrics show prints, one column per figure: the figures a person compares."""
    paths = Paths(project, "gemma4_tiny", "512_fp32")
    metrics, report = read_json(paths.metrics), read_json(paths.validation_report)
    assert metrics == {
        "parity": {"passed": True, "mode": "exact"},
        "tokens_per_s": {"short": report["contexts"]["short"]["tokens_per_s"]},
        "ttft_ms": {"short": report["contexts"]["short"]["ttft_ms"]},
        "peak_rss_mb": report["peak_rss_mb"],
        "concurrency": {"1": {key: report["concurrency"]["1"][key]  # one sequence in flight: a batch-1 build's batch
                              for key in ("aggregate_tokens_per_s", "tokens_per_s", "ms_per_token", "ttft_ms")}},
    }


def test_metrics_receipt_and_a_jobs_outcome_are_read_strictly_and_write_the_same_bytes(project, tmp_path):
    """metrics.json, publish.json and a multirun job's outcome.json are typed records: what the stages wrote reads
    back and writes the same bytes; an edited one is refused naming the file, the key and the stage to run again."""
    from pipeline.core.build_records import PublishReceipt
    from pipeline.stages import validate as validate_stage
    from pipeline.summary import JobOutcome
    from pipeline.validation.records import Metrics

    paths = Paths(project, "gemma4_tiny", "512_fp32")
    cfg = config(project, *FAST_VALIDATE)
    for kind, path in ((Metrics, paths.metrics), (PublishReceipt, paths.receipt)):
        record = kind.read(path)
        record.write(tmp_path / path.name)
        assert (tmp_path / path.name).read_bytes() == path.read_bytes(), path.name
    assert validate_stage.load(cfg).parity.passed is True
    root = clone_variant(project, tmp_path)
    edited = Paths(root, "gemma4_tiny", "512_fp32").metrics
    data = read_json(edited)
    data["tokens_per_s"] = {"short": "fast"}
    atomic_write_json(edited, data)
    with pytest.raises(PipelineError, match=r"metrics.json is not a valid metrics record:\n  - field "
                                            r"tokens_per_s.short has the wrong type .*\nIt was written by another "
                                            r"release .* run stage=validate force=true"):
        validate_stage.load(config(root, *FAST_VALIDATE))
    outcome = JobOutcome("512_fp32", True, None, parity=True, tokens_per_s=12.5)
    outcome.write(tmp_path / "outcome.json")
    assert read_json(tmp_path / "outcome.json") == {"variant": "512_fp32", "ok": True, "error": None, "parity": True,
                                                    "tokens_per_s": 12.5}
    assert JobOutcome.read(tmp_path / "outcome.json") == outcome


# The keys validation.json had before it was typed (existing validations have exactly these), and how the ranks of a
# cpu build of two exchanged their collectives (since shared memory replaced gloo's at load).
VALIDATION_KEYS = {"fingerprint", "version", "archive_sha256", "backend", "hardware", "coverage", "signature",
                   "preflight", "gates", "throughput_gate", "parity", "throughput", "contexts", "costs_s",
                   "peak_rss_mb", "threads", "prompts", "concurrency", "rank_collectives"}


def test_the_validation_record_reads_back_to_its_json_and_writes_the_same_bytes(project, tmp_path):
    """What the stage wrote is what the typed record holds, and writing it again gives the same bytes."""
    from pipeline.validation.records import ValidationRecord

    path = Paths(project, "gemma4_tiny", "512_fp32").validation_report
    record = ValidationRecord.read(path)
    assert set(read_json(path)) == VALIDATION_KEYS and record.to_json() == read_json(path)
    assert record.gates.passed and record.contexts["short"].tokens_per_s == record.throughput.tokens_per_s
    assert record.rank_collectives == "shared_memory"
    record.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()


BROKEN_VALIDATION_RECORDS = [
    (lambda d: d.pop("gates"), r"missing field gates"),
    (lambda d: d["gates"].update(passed="yes"), r"field gates\.passed has the wrong type \(str; expected bool\)"),
    (lambda d: d["contexts"]["short"].pop("ttft_ms"), r"missing field contexts\.short\.ttft_ms"),
]


def test_a_broken_validation_record_is_validated_again_and_never_published(project, tmp_path):
    """A validation.json this release cannot read (another release's, or edited) is not up to date: publish refuses
    it, naming the key and the fix, and validate runs again."""
    from pipeline.validation.records import ValidationRecord

    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE)
    path = Paths.of(cfg).validation_report
    assert run(cfg, "validate")[0].status == "skipped"
    written = read_json(path)
    for edit, problem in BROKEN_VALIDATION_RECORDS:
        data = json.loads(json.dumps(written))
        edit(data)
        atomic_write_json(path, data)
        with pytest.raises(PipelineError, match=rf"(?s){path} is not a valid validation record:\n  - {problem}\n"
                                                r".*run stage=validate force=true"):
            run(cfg, "publish")
        assert ValidationRecord.read_if_valid(path) is None
    assert run(cfg, "validate")[0].status == "ran"
    assert read_json(path)["gates"]["passed"] is True


def test_the_worker_reads_its_job_back_typed_as_the_stage_configured_it(project):
    """The job crosses to the validation process as JSON; the worker reads the validate settings back as the stage's
    typed sections (enums, floors, the logits' tolerances), equal to them, and refuses a setting of the wrong type by
    its key."""
    from pipeline.config import ParityMode, ThroughputConfig
    from pipeline.stages import package
    from pipeline.stages import validate as validate_stage
    from pipeline.validation.reference_records import ReferenceRecord
    from pipeline.validation.worker import ValidationJob

    cfg = config(project, *FAST_VALIDATE, "validate.parity.bf16=teacher_forced",
                 "validate.parity.logits.tol_map.top5=[0.0,0.5]", "validate.throughput.floors.cpu.any.tokens_per_s=7")
    reference = ReferenceRecord.read(Paths.of(cfg).reference)
    job = validate_stage.worker_job(cfg, package.load(cfg), reference, [0])
    again = ValidationJob.from_json(json.loads(json.dumps(job.to_json())))
    assert again == job and isinstance(again.throughput, ThroughputConfig)
    assert again.parity.mode("bf16") is ParityMode.teacher_forced and again.parity.logits.tol_map["top5"] == [0.0, 0.5]
    assert again.throughput.floor("cpu", "local")[1].tokens_per_s == 7
    for value, problem in (("most", r"validate\.parity\.teacher_forced_min: Value 'most'"),
                           (7.0, r"validate\.parity\.teacher_forced_min=7\.0 must be within \[0, 1\]")):
        data = job.to_json()
        data["parity"]["teacher_forced_min"] = value
        with pytest.raises(errors.ConfigError, match=problem):
            ValidationJob.from_json(data)


def test_the_failure_report_says_where_and_why(project, tmp_path, caplog):
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE)
    break_build("skipped_layer_scalar", root, tmp_path, cfg)
    run(cfg, "package")
    with caplog.at_level(logging.INFO, logger="pipeline"), pytest.raises(ParityError) as err:
        run(cfg, "validate")
    # The validation process's progress, one line per prompt and per context length, is logged by the stage itself.
    shown = "\n".join(r.getMessage() for r in caplog.records if r.name == "pipeline")
    assert re.search(r"^validate: prompt 1/2 capital \(26 tokens\): FAIL \(exact\), \d+ new tokens, first token "
                     r"[\d.]+ ms$", shown, re.MULTILINE), shown
    assert re.search(r"^validate: prompt 2/2 spans_64 \(\d+ tokens\): (pass|FAIL) \(exact\)", shown, re.MULTILINE)
    assert re.search(r"^validate: throughput 1/1, short context \(16 tokens\): [\d.]+ tokens/s, first token [\d.]+ ms$",
                     shown, re.MULTILINE), shown
    message = str(err.value)
    assert "capital (26 tokens), first divergence at new token 0" in message
    assert "reference top:" in message and "ours top:" in message
    entry = read_json(Paths.of(cfg).validation_report)["prompts"][0]
    divergence = entry["divergence"]
    assert entry["prompt"] == "capital" and divergence["step"] == 0
    assert len(divergence["reference_top"]) == 5 and len(divergence["ours_top"]) == 5
    assert divergence["reference_after"] != divergence["ours_after"]
    assert_writes_the_same_bytes(Paths.of(cfg).validation_report, tmp_path)


def assert_writes_the_same_bytes(path: Path, tmp_path: Path) -> None:
    """The validation record at ``path`` reads back typed (every prompt's verdict too) and writes the same bytes."""
    from pipeline.validation.records import PromptVerdict, ValidationRecord

    record = ValidationRecord.read(path)
    assert all(isinstance(verdict, PromptVerdict) for verdict in record.prompts)
    record.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()


@pytest.mark.across_versions("torch", "transformers")  # torch's numerics, transformers' reference
def test_bf16_passes_on_its_logits(project, tmp_path, monkeypatch):
    """Validated as a CPU without bf16 instructions runs it (its prefill's matmuls in fp32 over the bf16 values:
    pipeline/host/bf16_matmul.py); every other bf16 test here runs the CPU's own route. validation.json says which."""
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE, variant="512_bf16")
    monkeypatch.setenv("PIPELINE_BF16_MATMUL", "fp32")
    run(cfg)
    assert read_json(Paths.of(cfg).metrics)["parity"] == {"passed": True, "mode": "logits"}
    report = read_json(Paths.of(cfg).validation_report)
    assert report["parity"]["teacher_forced_match"] >= 0.9
    assert report["bf16_matmul"] == {"ranks": "fp32", "host_prefill": None, "min_rows": 64, "overridden": True,
                                     "cpu_bf16_flags": report["bf16_matmul"]["cpu_bf16_flags"]}
    assert "bf16_matmul" not in read_json(project / "gemma4_tiny" / "512_fp32" / "validation.json")
    assert_writes_the_same_bytes(Paths.of(cfg).validation_report, tmp_path)  # the logits mode's verdicts


def test_a_cpu_floor_is_reported_and_an_enforced_one_fails_the_stage_with_a_table(project, tmp_path, caplog):
    """The cpu backend's timings are the machine's: a floor it misses is reported in the table and validation.json,
    and the stage passes; the same floor with ``enforced=true`` fails it."""
    root = clone_variant(project, tmp_path)
    floor = "+validate.throughput.floors.cpu.local.tokens_per_s=100000"
    cfg = config(root, *FAST_VALIDATE, floor)
    with caplog.at_level(logging.INFO):
        run(cfg, "validate")
    report = read_json(Paths.of(cfg).validation_report)
    assert report["gates"] == {"parity": True, "throughput": True, "passed": True}
    assert report["throughput_gate"]["enforced"] is False and report["throughput_gate"]["passed"] is False
    assert re.search(r"decode tokens/s .* vs limit 100000: beyond it \(reported, not enforced\)", caplog.text)
    cfg = config(root, *FAST_VALIDATE, floor, "+validate.throughput.floors.cpu.local.enforced=true")
    with pytest.raises(ThroughputError, match=r"below the cpu.local floor:[\s\S]*decode tokens/s .* vs limit 100000"):
        run(cfg, "validate")
    assert read_json(Paths.of(cfg).validation_report)["gates"] == {"parity": True, "throughput": False,
                                                                    "passed": False}


@pytest.mark.parametrize("backend, hardware, holds", [("cpu", "local", True), ("neuron", "inf2_8xlarge", False)])
def test_the_rehearsals_figures_on_a_cpu_without_bf16_pass_the_cpu_gate_and_would_fail_inf2s(project, backend,
                                                                                             hardware, holds):
    """Issue 50's rehearsal on an AVX2-only EPYC: 1.0 token/s and a 62.4 s first token (device prefill) on the cpu
    backend. Its gate reports both rows beyond the floor and lets the build through; the same figures on inf2, whose
    floors are enforced, fail."""
    from pipeline.stages.validate import throughput_gate
    from pipeline.validation.records import ThroughputSummary

    latency = dict.fromkeys(("latency_ms_p50", "latency_ms_p90", "latency_ms_p95", "latency_ms_p99",
                             "latency_ms_p100", "latency_ms_avg"), 1000.0)
    figures = ThroughputSummary(**latency, tokens_per_s=1.0, ms_per_token=1000.0, ttft_ms=62351.4, throughput=1.0,
                                decode_steps=16)
    gate = throughput_gate(config(project, *FAST_VALIDATE), backend, hardware, "device", figures)
    assert [(row.value, row.passed) for row in gate.checks] == [(1.0, False), (62351.4, False)]
    assert gate.holds is holds and gate.enforced is not holds


# -- errors in the validation process ---------------------------------------------------------------------------

def replace_weights(root: Path, tmp_path: Path, edit) -> None:
    """Edit the checkpoint the validation process reads (the stage itself reads only its tokenizer)."""
    weights = Paths(root, "gemma4_tiny", "512_fp32").weights
    edited = edited_checkpoint(weights, tmp_path / "edited", edit)
    weights.unlink() if weights.is_symlink() else shutil.rmtree(weights)
    shutil.move(edited, weights)


def test_an_error_in_the_validation_process_keeps_its_class(project, tmp_path):
    root = clone_variant(project, tmp_path)
    replace_weights(root, tmp_path, lambda tensors: tensors.pop("model.embed_tokens.weight"))
    with pytest.raises(CheckpointError, match=r"^missing tensor 'model.embed_tokens.weight' in ") as err:
        run(config(root, *FAST_VALIDATE, "force=true"), "validate")
    assert type(err.value) is CheckpointError and "could not run" not in str(err.value)


def test_a_crash_in_the_validation_process_could_not_run_and_shows_its_last_lines(project, tmp_path):
    root = clone_variant(project, tmp_path)
    (Paths(root, "gemma4_tiny", "512_fp32").weights / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PipelineError) as err:
        run(config(root, *FAST_VALIDATE, "force=true"), "validate")
    message = str(err.value)
    assert type(err.value) is PipelineError and message.startswith("validation could not run: SafetensorError: ")
    assert "its last lines:" in message and "Traceback (most recent call last):" in message


@pytest.mark.parametrize("cls", [cls for cls in vars(errors).values()
                                 if isinstance(cls, type) and issubclass(cls, PipelineError)])
def test_every_pipeline_error_is_raised_again_as_itself(cls, tmp_path):
    """What the validation process writes about an error (RESULT.json) gives the stage the same class and message."""
    from pipeline.validation.records import WorkerResult

    exc = cls(["a problem", "another"]) if cls is errors.ConfigError else cls("parity failed: 3 of 5 prompts")
    WorkerResult(failure=errors.ErrorRecord.of(exc)).write(tmp_path / "result.json")
    again = WorkerResult.read(tmp_path / "result.json").failure.raised_again()
    assert type(again) is cls and str(again) == str(exc)
    assert getattr(again, "problems", None) == getattr(exc, "problems", None)
    assert errors.ErrorRecord.of(ValueError("a bug")).raised_again() is None


def test_the_validation_process_result_is_read_strictly():
    """RESULT.json holds what the validation process measured or the error it raised, exactly one; anything else is
    refused naming the key, as a stage and a validation process of different releases would write."""
    from pipeline.validation.records import WorkerResult

    failure = {"error_type": "ParityError", "error": "parity failed"}
    for data, problem in (({}, r"it holds metrics or a failure, exactly one of them"),
                          ({"ok": False, "failure": failure}, r"unknown field ok"),
                          ({"failure": {"error_type": "ParityError"}}, r"missing field failure\.error"),
                          ({"failure": failure | {"problems": "one"}},
                           r"field failure\.problems has the wrong type \(str; expected a list\)")):
        with pytest.raises(InputError, match=rf"^the validation process's result is not a valid validation "
                                             rf"process's result:\n  - {problem}\nThe validation process is of "
                                             r"another version of the pipeline than the stage: reinstall it$"):
            WorkerResult.from_bytes(json.dumps(data).encode(), "the validation process's result")


def test_a_result_with_figures_that_are_not_numbers_is_read(project, tmp_path):
    """A broken build's figures can be NaN or infinite: the stage still reads what its validation process measured
    (and reports the parity failure), as before the result was typed."""
    from dataclasses import fields

    from pipeline.stages import validate
    from pipeline.validation.records import Measured, ValidationRecord, WorkerResult

    report = ValidationRecord.read(Paths(project, "gemma4_tiny", "512_fp32").validation_report)
    measured = Measured(**{f.name: getattr(report, f.name) for f in fields(Measured)})
    data = WorkerResult(metrics=measured).to_json()
    data["metrics"]["throughput"]["tokens_per_s"] = float("nan")
    data["metrics"]["parity"]["max_abs_dlogit"] = float("inf")
    (tmp_path / "result.json").write_text(json.dumps(data))  # as the worker writes it: NaN and Infinity
    result = validate.read_result(tmp_path / "result.json")
    assert result.metrics.throughput.tokens_per_s != result.metrics.throughput.tokens_per_s  # NaN
    assert result.metrics.parity.max_abs_dlogit == float("inf")


# -- bad input, refused before anything is loaded ---------------------------------------------------------------

@pytest.mark.across_versions("torch", "transformers")  # torch's numerics, transformers' reference
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


REFERENCE_KEYS = {"fingerprint", "model", "max_new_tokens", "top_k", "prompts", "logits_file", "versions",
                  "eos_token_ids", "preflight"}
PROMPT_KEYS = {"name", "max_tokens", "text", "input_ids", "output_ids", "stopped_on_eos", "dtype_noise"}

BROKEN_REFERENCES = [
    (lambda d: d.pop("top_k"), r"missing field top_k"),
    (lambda d: d["prompts"][1].update(output_ids="many"),
     r"field prompts\[1\]\.output_ids has the wrong type \(str; expected a list\)"),
    (lambda d: d["prompts"][0]["dtype_noise"]["bf16"]["relative"].update(top7=0.1),
     r"unknown field prompts\[0\]\.dtype_noise\.bf16\.relative\.top7"),
]


def test_the_reference_record_is_read_strictly_and_writes_the_same_bytes(project, tmp_path):
    """reference.json is a typed record: what the reference stage wrote reads back and writes the same bytes; an
    edited one is refused by validate naming the file, the key and the fix, and the reference stage makes it again."""
    from pipeline.validation.reference_records import ReferenceRecord

    path = project / "gemma4_tiny" / "reference.json"
    written = read_json(path)
    assert set(written) == REFERENCE_KEYS and all(set(p) == PROMPT_KEYS for p in written["prompts"])
    ReferenceRecord.read(path).write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    root = clone_variant(project, tmp_path)
    cfg = config(root, *FAST_VALIDATE)
    edited = Paths.of(cfg).reference
    for edit, problem in BROKEN_REFERENCES:
        data = json.loads(json.dumps(written))
        edit(data)
        atomic_write_json(edited, data)
        with pytest.raises(PipelineError, match=rf"^{edited} is not a valid reference record:\n  - {problem}\nIt was "
                                                r"written by another release of the pipeline, or edited: run "
                                                r"stage=reference force=true$"):
            run(cfg, "validate")
    assert run(cfg, "reference")[0].status == "ran"
    again = ReferenceRecord.read(edited)  # the same reference again: nothing it depends on changed
    assert again.fingerprint == written["fingerprint"] and [p.output_ids for p in again.prompts] == [
        tuple(p["output_ids"]) for p in written["prompts"]]


@pytest.mark.slow  # `make test-slow`: a reference stage of its own; it can fail only on a CPU with bf16 instructions
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this CPU has no bf16 instructions: its bf16 matmuls are torch's own on every setting")
def test_the_bf16_noise_a_reference_holds_is_the_same_on_a_cpu_without_bf16_instructions(project, tmp_path):
    """A reference made here judges bf16 builds validated elsewhere (a DVC remote): its dtype noise must not depend
    on whether this CPU has bf16 instructions. ONEDNN_MAX_CPU_ISA=AVX2 and ATEN_CPU_CAPABILITY=avx2 make this CPU
    compute as an AVX2-only one (oneDNN's kernels and torch's own). Equal to fp32's rounding (torch's vectorized fp32
    kernels differ in their last bits between the two): before, through each CPU's bf16 kernels, spans_64's top-5
    figure was 0.0301 here and 0.0428 as an AVX2-only CPU."""
    root = clone_variant(project, tmp_path)
    (root / "gemma4_tiny" / "reference.json").unlink()
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "stage=reference", "backend=cpu", f"artifacts_dir={root}",
                           *FAST_VALIDATE], cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    noise = {p["name"]: p["dtype_noise"] for p in read_json(root / "gemma4_tiny" / "reference.json")["prompts"]}
    here = {p["name"]: p["dtype_noise"] for p in read_json(project / "gemma4_tiny" / "reference.json")["prompts"]}
    assert flat(noise) == pytest.approx(flat(here), rel=1e-4)


def flat(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


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
    from pipeline.validation.records import Coverage
    from pipeline.validation.reference_records import ReferenceRecord
    from pipeline.validation.worker import select_prompts

    prompts = ReferenceRecord.read(project / "gemma4_tiny" / "reference.json").prompts
    with pytest.raises(InputError, match="lack one between half a bucket and a bucket and one longer than two"):
        select_prompts(prompts, BuildShape(2048, 1024, "fp32", "device", 2), 32, None)
    chosen, coverage = select_prompts(prompts, BuildShape(512, 128, "fp32", "device", 2), 32, None)
    assert coverage == Coverage(near_bucket=("near_128",), multi_bucket=("near_512",))
    assert len(chosen) == 6  # every prompt that fits 512 with 32 new tokens: all but spans_512


def test_a_ladder_bucket_no_prompt_ends_in_is_refused():
    """Each smaller bucket's graph must run in parity: some prompt's last part ends in it (the tiny model's prompts
    are 26, 60, 118, 198 and 478 tokens; at bucket 128 they end in 26, 60, 118, 70 and 94 tokens)."""
    from pipeline.core.shape import BuildShape
    from pipeline.validation.records import Coverage
    from pipeline.validation.worker import select_prompts

    prompts = [SimpleNamespace(name=n, input_ids=[0] * k) for n, k in
               (("capital", 26), ("near_64", 60), ("near_128", 118), ("spans_64", 198), ("near_512", 478))]
    chosen, coverage = select_prompts(prompts, BuildShape(512, 128, "fp32", "device", 2, 1, (32, 64)), 32, None)
    assert coverage == Coverage(near_bucket=("near_128",), multi_bucket=("near_512",),
                                smaller_buckets={"32": ("capital",), "64": ("near_64",)})
    with pytest.raises(InputError, match=r"ends in the prefill bucket\(s\) \[16\] of variant.smaller_buckets=\[16, "
                                         r"64\] .* drop those buckets, or add a prompt"):
        select_prompts(prompts, BuildShape(512, 128, "fp32", "device", 2, 1, (16, 64)), 32, None)


@pytest.mark.across_versions("torch", "transformers")  # torch's numerics, transformers' reference
def test_host_prefill_runs_on_every_usable_cpu_and_decode_on_one_thread(monkeypatch):
    """The thread policy per phase (validation/generation.py): the seed measured E4B's host prefill at 6.3 s on one
    thread and 1.4 s on 32, so a prefill left at the validation process's one thread would be gated (and served)
    several times slower than the host allows. Each phase's thread count is seen from inside it."""
    from pipeline.core.shape import BuildShape
    from pipeline.decoding import runner
    from pipeline.validation import generation
    from pipeline.validation.records import ThreadPolicy

    monkeypatch.setattr(generation, "usable_cpus", lambda: 7)
    monkeypatch.setattr(runner, "usable_cpus", lambda: 7)
    seen: dict[str, list[int]] = {"prefill": [], "decode": []}
    shape = BuildShape(64, 16, "bf16", "host", 2)
    vocab = 11

    class Runner:
        def __init__(self):
            self.shape = shape

        def seed_kv(self, per_rank, line):
            pass

        def decode(self, embeds, per_layer, positions, last_index, seq_ids=None):
            seen["decode"].append(torch.get_num_threads())
            logits = torch.zeros(1, vocab)
            logits[0, 3] = 1.0
            return logits, torch.tensor([3])

    class HostModel:
        def prefill(self, token_ids):
            seen["prefill"].append(torch.get_num_threads())
            logits = torch.zeros(1, vocab)
            logits[0, 2] = 1.0
            return logits, torch.tensor([2]), [torch.zeros(1, 2, 64, 4)]

    torch.set_num_threads(1)  # as the validation process sets it
    gen = generation.Generator(Runner(), lambda ids: (torch.zeros(1, len(ids), 4), torch.zeros(1, len(ids), 1)),
                               eos_ids=(9,), pad_id=0, host_prefill=HostModel())
    out = gen.generate([1, 2, 3], 4)
    assert out.tokens == [2, 3, 3, 3]
    assert seen == {"prefill": [7], "decode": [1, 1, 1]}
    assert gen.threads == ThreadPolicy(host_prefill=7, decode=1, usable_cpus=7)
    assert torch.get_num_threads() == 1  # restored


def test_usable_cpus_follow_a_cgroup_quota(tmp_path, monkeypatch):
    from pipeline.host import procinfo

    group = tmp_path / "cg" / "job"
    group.mkdir(parents=True)
    (group / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    real_open = open

    def fake_open(path, *args, **kwargs):
        return real_open(tmp_path / "cgroup", *args, **kwargs) if path == "/proc/self/cgroup" else real_open(
            path, *args, **kwargs)

    (tmp_path / "cgroup").write_text("0::/job\n")
    monkeypatch.setattr("builtins.open", fake_open)
    assert procinfo.usable_cpus(str(tmp_path / "cg")) == 1
    (group / "cpu.max").write_text("max 100000\n")
    assert procinfo.usable_cpus(str(tmp_path / "cg")) == len(os.sched_getaffinity(0))
