"""The neuron backend without Inferentia: everything it computes without the hardware, its refusals, and the whole
pipeline run through it on a stand-in for the Neuron SDK (tests/fake_neuron, tp_degree 2)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from pipeline.backends.aliased_rank import AliasedRank, shape_problems
from pipeline.backends.base import CheckpointRef, TraceRequest, entry_inputs, example_inputs
from pipeline.backends.neuron import (
    NeuronBackend,
    OutOfMemory,
    classify_failure,
    missing_api,
    run_isolated,
    state_parameters,
    write_states,
)
from pipeline.backends.neuron_job import CompileResult, NeuronJob, make_job
from pipeline.backends.neuron_rank import (
    compiler_arg_string,
    model_builder_plan,
    router_key,
)
from pipeline.config import available_variants
from pipeline.core.errors import BuildError, ConfigError, IntegrityError
from pipeline.core.shape import BuildShape
from pipeline.core.units import GIB
from pipeline.host.preflight import Need, Resources
from pipeline.recipe.checkpoint import Checkpoint
from pipeline.recipe.model import build_rank
from pipeline.recipe.parallel import Parallel
from pipeline.recipe.plan import ShardPlan, load_rank_state
from pipeline.recipe.spec import load_spec

from . import fake_sdk
from .helpers import CONF, FAST_VALIDATE, device_prefill_variants, neuron_config, run

# Both dtypes: no auto-cast, the recipe states every dtype (conf/backend/neuron.yaml says why it is not the seed's
# "--auto-cast all --auto-cast-type bf16").
NEURON_ARGS = ["--model-type=transformer", "--auto-cast=none"]
NEURON_MODULES = ("torch_neuronx", "neuronx_distributed", "neuronxcc")


def job_for(tiny_dir: Path, tmp_path: Path, shape: BuildShape) -> NeuronJob:
    return make_job(CheckpointRef(tiny_dir, "model."), shape, [], tmp_path / "out", tmp_path / "work", 0, None)


# -- without any Neuron package --------------------------------------------------------------------------------------

def test_the_package_imports_and_refuses_neuron_work_without_the_neuron_packages(tiny_dir, tmp_path):
    assert all(importlib.util.find_spec(name) is None for name in NEURON_MODULES)  # this suite runs without them
    from pipeline.backends import get_backend, resolve

    assert resolve("auto") == "cpu"
    backend = get_backend("neuron")
    assert backend.members(BuildShape(512, 128, "bf16", "device", 2)) == ["model.pt"]
    assert backend.members(BuildShape(512, 128, "bf16", "host", 2)) == ["tp_0.pt", "tp_1.pt"]
    assert "deploy/install-inf2.sh" in missing_api("device")
    out = tmp_path / "build"
    with pytest.raises(BuildError, match=r"torch_neuronx.*pip.repos.neuron.amazonaws.com"):
        backend.trace(TraceRequest(CheckpointRef(tiny_dir, "model."), BuildShape(256, 32, "bf16", "device", 2)), out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


# -- compiler arguments --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", available_variants(CONF))
def test_compiler_arguments_per_variant(tmp_path, variant):
    from pipeline.stages.trace import compiler_args

    cfg = neuron_config(tmp_path, variant)
    args = compiler_args(cfg, "neuron")
    assert args == NEURON_ARGS  # nothing auto-cast: the fp32 parts of a bf16 build stay fp32
    assert shlex.split(compiler_arg_string(args)) == args  # ModelBuilder takes one string
    assert compiler_args(cfg, "cpu") == []


def test_compiler_id_names_the_neuronx_cc_release():
    from pipeline.core.build_records import NeuronxCcBuild, PackageVersion, ToolchainRecord

    def toolchain(full: str | None, wheel: str | None) -> ToolchainRecord:
        return ToolchainRecord(2, "neuron", {"neuronx-cc": PackageVersion(wheel)}, NeuronxCcBuild(full, None), {})

    backend = NeuronBackend()
    assert backend.compiler_id(toolchain("2.23.6484.0+f702b353", "2.23.6484.0")) == "ncc2.23.6484.0"
    assert backend.compiler_id(toolchain(None, "2.23.6484.0")) == "ncc2.23.6484.0"  # from the wheel's metadata only
    with pytest.raises(BuildError, match="records no neuronx-cc"):
        backend.compiler_id(toolchain(None, None))


# -- the ModelBuilder plan -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", device_prefill_variants())
def test_model_builder_plan_routes_prefill_and_decode_apart(tiny_dir, tmp_path, variant):
    cfg = neuron_config(tmp_path, variant)
    shape = cfg.variant.shape
    spec = load_spec(tiny_dir)
    plan = model_builder_plan(shape)
    assert plan == [*(f"prefill_{b}" for b in shape.smaller_buckets), "prefill", "decode"]
    inputs = {key: entry_inputs(spec, shape, key) for key in plan}
    assert len({router_key(i) for i in inputs.values()}) == len(plan)  # NxDModel routes each call by its shapes
    # ModelBuilder's executor is traced with one key's inputs (NxD v2.28.0 model_builder.py ~1091): every key takes
    # as many
    assert len({len(i) for i in inputs.values()}) == 1
    assert shape_problems(shape) == []


def test_a_one_token_prefill_bucket_is_refused_before_work(tiny_dir, tmp_path):
    shape = BuildShape(256, 1, "bf16", "device", 2)
    assert "at least 2 tokens" in shape_problems(shape)[0]
    with pytest.raises(ConfigError, match="variant.bucket=1"):
        NeuronBackend().trace(TraceRequest(CheckpointRef(tiny_dir, "model."), shape), tmp_path / "build")
    assert list(tmp_path.iterdir()) == []
    assert "at least 2 tokens" in shape_problems(BuildShape(256, 64, "bf16", "device", 2, 1, (1, 16)))[0]


# -- the traced module, its aliases and its checkpoint ---------------------------------------------------------------

def test_aliased_rank_returns_its_caches_as_outputs_aliased_back_to_themselves(tiny_dir):
    spec = load_spec(tiny_dir)
    plan = ShardPlan(spec, 1)
    with Checkpoint(tiny_dir, "model.") as ckpt:
        reference = build_rank(spec, plan, Parallel(1), 64, torch.float32,
                               load_rank_state(ckpt, plan, 0, torch.float32))
        decoder = build_rank(spec, plan, Parallel(1), 64, torch.float32,
                             load_rank_state(ckpt, plan, 0, torch.float32)).decoder
    rank = AliasedRank(decoder)
    caches = rank.caches()
    assert len(caches) == 2 * len(spec.producers) and all(isinstance(c, torch.nn.Parameter) for c in caches)
    assert not any(c.requires_grad for c in caches) and not any("_cache_" in n for n, _ in rank.named_buffers())
    assert list(rank.aliases().values()) == list(range(1, len(caches) + 1))
    inputs = example_inputs(spec, 16)
    with torch.no_grad():
        out = rank(*inputs)
        logits, _ = reference.prefill(*inputs)
    assert torch.equal(out[0], logits)
    for cache, index in rank.aliases().items():  # output j is the update of the parameter aliased to j
        assert out[index].shape == cache.shape and out[index].dtype == cache.dtype
    for name, index in zip(reference.decoder.cache_names(), range(1, len(caches) + 1)):
        assert torch.equal(out[index], getattr(reference.decoder, name))


def test_neuronx_distributed_cuts_the_full_checkpoint_into_the_plans_rank_slices(tiny_dir):
    """ModelBuilder shards each parallel layer's weight into equal contiguous chunks along its partition dimension
    (create_local_weight: torch.split(full, size // tp, dim)[rank]); that must be exactly ShardPlan's slice."""
    spec = load_spec(tiny_dir)
    plan = ShardPlan(spec, 2)
    with Checkpoint(tiny_dir, "model.") as ckpt:
        full = load_rank_state(ckpt, ShardPlan(spec, 1), 0, torch.float32)
        for rank in range(2):
            mine = load_rank_state(ckpt, plan, rank, torch.float32)
            for name, tensor in full.items():
                dim = plan.split(name)
                expected = tensor if dim is None else torch.split(tensor, tensor.shape[dim] // 2, dim)[rank]
                assert torch.equal(mine[name], expected), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_recipe_on_neuronx_distributed_layers_computes_what_the_cpu_recipe_does(fake_neuron, tiny_dir, tmp_path,
                                                                                     dtype):
    from pipeline.backends.neuron_rank import build_aliased_rank

    shape = BuildShape(64, 16, dtype, "host", 1)
    job = job_for(tiny_dir, tmp_path, shape)
    rank = build_aliased_rank(job, 0)
    assert type(rank.decoder.layers[0].mlp.down_proj).__name__ == "Row"  # neuronx-distributed's layer, adapted
    spec = load_spec(tiny_dir)
    plan = ShardPlan(spec, 1)
    with Checkpoint(tiny_dir, "model.") as ckpt:
        cpu = build_rank(spec, plan, Parallel(1), 64, shape.torch_dtype,
                         load_rank_state(ckpt, plan, 0, shape.torch_dtype))
    inputs = example_inputs(spec, 16)
    with torch.no_grad():
        assert torch.equal(rank(*inputs)[0], cpu.prefill(*inputs)[0])


def test_modelbuilder_structure_gets_layer_scalar_by_hand(fake_neuron, tiny_dir, tmp_path):
    from pipeline.backends.neuron_rank import RankInstance

    job = job_for(tiny_dir, tmp_path, BuildShape(64, 16, "bf16", "device", 1))
    instance = RankInstance(job, "prefill")
    instance.load_module()
    module, aliases = instance.get(0)
    assert set(aliases) == set(module.caches())
    with Checkpoint(tiny_dir, "model.") as ckpt:
        spec = load_spec(tiny_dir)
        for layer in spec.layers:
            expected = ckpt.read(f"layers.{layer.index}.layer_scalar", spec).float()
            assert torch.equal(module.decoder.layers[layer.index].layer_scalar, expected.view(1))
            assert float(expected) != 1.0


# -- loading: KV state ------------------------------------------------------------------------------------------------

def test_kv_state_is_found_in_numeric_order_and_seeded_only_when_shapes_match():
    module = torch.nn.Module()
    module.states = torch.nn.ParameterList([torch.nn.Parameter(torch.full((1, 1, 4, 2), float(i)),
                                                               requires_grad=False) for i in range(12)])
    module.weight = torch.nn.Parameter(torch.zeros(2))
    found = state_parameters(module)
    assert [int(p[0, 0, 0, 0]) for p in found] == list(range(12))  # states.10 after states.9
    caches = [torch.full((1, 1, 4, 2), 100.0 + i, dtype=torch.bfloat16) for i in range(12)]
    write_states(0, found, caches)
    assert float(module.states[11][0, 0, 0, 0]) == 111.0 and module.states[11].dtype == torch.float32
    with pytest.raises(IntegrityError, match="12 KV state tensors"):
        write_states(0, found, caches[:3])
    with pytest.raises(IntegrityError, match=r"states.0 has shape \[1, 1, 4, 2\]"):
        write_states(0, found, [torch.zeros(1, 2, 4, 2)] + caches[1:])


def test_the_runner_loads_only_a_verified_build_of_the_right_layout(tmp_path):
    from pipeline.artifact.archive import verify_build
    from pipeline.core.build_records import Member

    (tmp_path / "tp_0.pt").write_bytes(b"x")
    build = verify_build(tmp_path, (Member("tp_0.pt", 1, hashlib.sha256(b"x").hexdigest()),))
    with pytest.raises(TypeError, match="VerifiedBuild"):
        NeuronBackend().load(tmp_path, BuildShape(64, 16, "bf16", "host", 1))
    with pytest.raises(IntegrityError, match=r"needs \['model.pt'\]"):
        NeuronBackend().load(build, BuildShape(64, 16, "bf16", "device", 1))


# -- API detection, and the compile process's failures ----------------------------------------------------------------

HOST = Resources(mem_available=100 * GIB, swap_free=8 * GIB, swap_total=8 * GIB)
NEED = Need(memory=180 * GIB, what="tracing")


def _child(tmp_path: Path, body: str) -> tuple[list[str], Path]:
    result = tmp_path / "result.json"
    return [sys.executable, "-c", f"import json, os, signal, sys\nresult = {str(result)!r}\n{body}"], result


@pytest.mark.parametrize(("body", "match"), [
    ("os.kill(os.getpid(), signal.SIGKILL)",
     r"killed by SIGKILL \(exit -9\): most likely the out-of-memory killer.*available RAM 100.0 GiB, free swap 8.0 "
     r"GiB; the preflight's estimate was 180.0 GiB"),
    ("json.dump({'ok': False, 'error': 'RuntimeError: Compile command returned: -9'}, open(result, 'w'))",
     r"(?s)out-of-memory killer.*The compiler said: RuntimeError: Compile command returned: -9"),
    ("json.dump({'ok': False, 'error': 'ProcessExitedException: process 1 terminated with signal SIGKILL'}, "
     "open(result, 'w'))", "out-of-memory killer"),
    ("json.dump({'ok': False, 'error': 'RuntimeError: NCC_EOOM002 out of device memory'}, open(result, 'w'))",
     r"does not fit a NeuronCore's memory.*lower variant.kv_max"),
    ("json.dump({'ok': False, 'error': 'ValueError: bad graph', 'traceback': 'tb'}, open(result, 'w'))",
     r"the compile failed: ValueError: bad graph"),
    ("sys.exit(3)", "exited with code 3 without a result"),
    ("json.dump({'ok': False, 'error': 'ValueError: bad graph', 'seconds': 'soon'}, open(result, 'w'))",
     r"result.json is not a valid neuron compile result:\n  - field seconds has the wrong type \(str; expected "
     r"float\)"),
    ("json.dump({'ok': False, 'eror': 'ValueError: bad graph'}, open(result, 'w'))",
     r"(?s)result.json is not a valid neuron compile result:\n  - unknown field eror.*run stage=trace again"),
])
def test_compile_process_failures_are_reported_for_what_they_are(tmp_path, body, match):
    argv, result = _child(tmp_path, body)
    request = TraceRequest(CheckpointRef(tmp_path, "model."), BuildShape(64, 16, "bf16", "device", 2), host=HOST,
                           need=NEED)
    with pytest.raises(BuildError, match=match):
        run_isolated(argv, result, "the compile", request)


def test_the_compile_job_is_a_record_read_strictly_and_written_back_byte_for_byte(tiny_dir, tmp_path):
    job = job_for(tiny_dir, tmp_path, BuildShape(64, 16, "bf16", "device", 2))
    job.write(tmp_path / "job.json")
    read = NeuronJob.read(tmp_path / "job.json")
    assert read == job and read.shape.prefill == "device" and read.checkpoint.text_prefix == "model."
    read.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "job.json").read_bytes()
    data = json.loads((tmp_path / "job.json").read_text())
    data["shape"]["tp_degree"], data["out"] = "2", data.pop("out_dir")
    (tmp_path / "job.json").write_text(json.dumps(data))
    with pytest.raises(BuildError, match=r"job.json is not a valid neuron compile job:\n  - field shape.tp_degree has "
                       r"the wrong type \(str; expected int\)\n  - missing field out_dir\n  - unknown field out\n"):
        NeuronJob.read(tmp_path / "job.json")


def test_the_compile_result_is_a_record_an_outcome_or_a_failure(tmp_path):
    ok = CompileResult.succeeded(1.5, 2 << 30, {"prefill/_tp0_bk0": "-O1"})
    ok.write(tmp_path / "result.json")
    assert json.loads((tmp_path / "result.json").read_text()) == {
        "ok": True, "seconds": 1.5, "peak_rss_bytes": 2 << 30, "compiler_flags": {"prefill/_tp0_bk0": "-O1"}}
    assert CompileResult.read(tmp_path / "result.json") == ok
    try:
        raise ValueError("bad graph")
    except ValueError as exc:
        failed = CompileResult.failed(exc)
    assert failed.error == "ValueError: bad graph" and "raise ValueError" in failed.traceback
    for half in ({"ok": True, "seconds": 1.5}, {"ok": False}, {"ok": False, "error": "x", "seconds": 1.5}):
        (tmp_path / "result.json").write_text(json.dumps(half))
        with pytest.raises(BuildError, match=r"result.json is not a valid neuron compile result:\n  - ok is"):
            CompileResult.read(tmp_path / "result.json")


def test_a_refused_compile_job_is_reported_as_the_compile_failing(tiny_dir, tmp_path):
    job = job_for(tiny_dir, tmp_path, BuildShape(64, 16, "bf16", "device", 2))
    job.write(tmp_path / "job.json")
    data = json.loads((tmp_path / "job.json").read_text())
    del data["compiler_args"]
    (tmp_path / "job.json").write_text(json.dumps(data))
    request = TraceRequest(CheckpointRef(tiny_dir, "model."), job.shape)
    argv = [sys.executable, "-m", "pipeline.backends.neuron_rank", str(tmp_path / "job.json"),
            str(tmp_path / "result.json")]
    with pytest.raises(BuildError, match=r"the compile failed: BuildError: .*job.json is not a valid neuron compile "
                       r"job:\n  - missing field compiler_args"):
        run_isolated(argv, tmp_path / "result.json", "the compile", request)


def test_failure_text_is_classified():
    assert classify_failure("INFO:Neuron:Compile command returned: -9") is OutOfMemory.host_oom
    assert classify_failure("neuronx-cc exited with code -9") is OutOfMemory.host_oom
    assert classify_failure("Killed") is OutOfMemory.host_oom
    assert classify_failure("TDRV:dmem_alloc_internal Failed to alloc DEVICE memory") is OutOfMemory.device_oom
    assert classify_failure("ERROR NCC_EOOM001") is OutOfMemory.device_oom
    assert classify_failure("returned: -90 lines") is None and classify_failure("shape mismatch") is None


# -- the SDK release, NeuronCores and the rendezvous port: refused before any compile -------------------------------

def _prepared(root: Path, variant: str, *overrides: str):
    """A config whose toolchain and model stages have run: the next stage is the trace."""
    cfg = neuron_config(root, variant, *overrides)
    run(cfg, "toolchain")
    run(cfg, "model")
    return cfg


def _nothing_built(root: Path, variant: str) -> bool:
    variant_dir = root / "gemma4_tiny" / variant
    return not variant_dir.exists() or not any(p.name != "validate" for p in variant_dir.iterdir())


def test_an_installed_mix_of_sdk_releases_is_refused_before_any_compile(fake_neuron, tmp_path):
    info = next(fake_neuron.glob("neuronx_cc-*.dist-info"))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: neuronx-cc\nVersion: 2.24.5133.0\n")
    cfg = _prepared(tmp_path, "512_bf16")
    with pytest.raises(BuildError, match=r"(?s)not one Neuron SDK release: torch-neuronx 2.8.0.2.12.22436\+f702b353, "
                                         r"neuronx-cc 2.24.5133.0.*belongs to release 2.29.0.*deploy/install-inf2.sh"):
        run(cfg, "trace")
    assert _nothing_built(tmp_path, "512_bf16")
    assert missing_api("device", check_release=False) is None  # backend.check_sdk_release=false lets it through


@pytest.mark.parametrize(("release", "host_prefill"), [("2.26.1", "built"), ("2.28.1", "built with a warning"),
                                                        ("2.29.0", "refused"), ("2.27.1", "refused")])
def test_host_prefill_is_decided_by_the_installed_sdk_release(monkeypatch, tmp_path, caplog, release, host_prefill):
    site = fake_sdk.install(tmp_path / "sdk", release)
    with fake_sdk.activated(site, monkeypatch):
        assert missing_api("device") is None
        reason = missing_api("host")
        if host_prefill == "refused":
            assert f"nothing has shown it to work on the installed SDK {release}" in reason
            assert "backend.allow_unsupported_host_prefill=true" in reason
            assert missing_api("host", allow_unsupported_host_prefill=True) is None
            cfg = _prepared(tmp_path / "a", "256_bf16_host")
            with pytest.raises(BuildError, match="no longer supports from SDK 2.27"):
                run(cfg, "trace")
            assert _nothing_built(tmp_path / "a", "256_bf16_host")
        else:
            assert reason is None
            assert ("unsupported by Neuron, verified by the seed recipe" in caplog.text) == (host_prefill != "built")


@pytest.mark.parametrize(("release", "defaults"), [("2.23.0", []), ("2.25.0", ["-O1"]), ("2.26.1", ["-O1"])])
def test_device_prefill_compiles_on_a_modelbuilder_with_or_without_the_flag_hook(monkeypatch, tmp_path, release,
                                                                                 defaults):
    """ModelBuilder takes compiler_flag_hook from SDK 2.26 (NxD commit fecfe75); a DLAMI's 2.23-2.25 has none, and
    passing it was a TypeError on every device-prefill compile (issue 51). Without it the flags per bucket are read
    from what add() stored, the --logfile trace() appends added: the same string the hook gets from 2.26 on. None of
    these releases appends --verbose=35 (NxD 0.16 on), and 2.23's (NxD 0.12) adds no defaults to given flags."""
    site = fake_sdk.install(tmp_path / "sdk", release)
    with fake_sdk.activated(site, monkeypatch):
        cfg = _prepared(tmp_path / "a", "512_fp32", "variant.tp_degree=1")
        run(cfg, "trace")
    build = json.loads((tmp_path / "a" / "gemma4_tiny" / "512_fp32+tp1" / "build.json").read_text())["trace"]
    assert build["effective_compiler_args"] == NEURON_ARGS + defaults
    logfile = "--logfile=<workdir>/model_builder/{}/_tp0_bk0/log-neuron-cc.txt"
    assert build["compiler_flags"] == {f"{key}/_tp0_bk0": NEURON_ARGS + [*defaults, logfile.format(key)]
                                       for key in ("decode", "prefill")}
    assert build["compile_cache"] == {"decode/_tp0_bk0": "compiled", "prefill/_tp0_bk0": "compiled"}
    # what each graph takes, from its bucket's metaneff.pb (docs/inf2-host.md, first-run checklist: layer_scalar)
    layers = len(load_spec(tmp_path / "a" / "gemma4_tiny" / "weights").layers)
    for bucket in ("decode/_tp0_bk0", "prefill/_tp0_bk0"):
        inputs = build["traced_inputs"][bucket]
        assert inputs["USER_INPUT"] == 4 and inputs["INPUT_STATE"] > 0 and inputs["INPUT_WEIGHT"] > layers
        assert inputs["layer_scalar_weights"] == layers


def test_neuroncores_the_host_lacks_or_another_run_holds_are_refused_before_any_compile(fake_neuron, tmp_path):
    from pipeline.backends import neuron_cores
    from pipeline.core.errors import PreflightError

    with pytest.raises(ConfigError, match=r"backend.visible_cores='0-2' names 3 NeuronCore\(s\) but "
                                          r"variant.tp_degree is 2"):
        neuron_config(tmp_path, "512_bf16", "backend.visible_cores=0-2")
    cfg = _prepared(tmp_path, "512_bf16", "backend.visible_cores=2-3")
    with pytest.raises(ConfigError, match=r"names NeuronCores this host does not have \(it has 2: 0-1"):
        run(cfg, "trace")
    assert _nothing_built(tmp_path, "512_bf16")
    with neuron_cores.leased(2, 2, None, "another build"):
        cfg = _prepared(tmp_path, "512_bf16")
        with pytest.raises(PreflightError, match=r"needs 2 free NeuronCores of 2, but they are taken by: core 0: "
                                                 r"another build \(pid"):
            run(cfg, "trace")
        assert _nothing_built(tmp_path, "512_bf16")
    run(cfg, "trace")  # released: the same run now builds
    assert (tmp_path / "gemma4_tiny" / "512_bf16" / "build" / "model.pt").is_file()


@pytest.mark.slow  # a whole build and validation (make test-slow), for make test's budget
def test_a_validation_runs_on_the_cores_its_lease_names(monkeypatch, tmp_path, caplog):
    """Another process holds NeuronCores 0-1 (its lease and, as its runtime would, the device cores): on a 4-core
    host the validation leases 2-3 and its process, given NEURON_RT_VISIBLE_CORES=2-3, loads there."""
    caplog.set_level(logging.INFO, logger="pipeline")
    site = fake_sdk.install(tmp_path / "sdk", cores=4)
    with fake_sdk.activated(site, monkeypatch, cores=4):
        cfg = _prepared(tmp_path / "a", "512_fp32", *FAST_VALIDATE)
        for stage in ("reference", "trace", "package"):
            run(cfg, stage)
        holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom pipeline.backends import neuron_cores\n"
                                   "from torch_neuronx import _fake_runtime\n"
                                   "with neuron_cores.leased(2, 4, '0-1', 'a validation of another variant'):\n"
                                   "    _fake_runtime.claim_cores(2)\n    print('held', flush=True); sys.stdin.read()"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "NEURON_RT_VISIBLE_CORES": "0-1"})
        try:
            assert holder.stdout.readline().strip() == "held"
            run(cfg, "validate")
        finally:
            holder.communicate("")
    assert "validating 512_fp32: NeuronCores 2-3 (NEURON_RT_VISIBLE_CORES=2-3)" in caplog.text
    metrics = json.loads((tmp_path / "a" / "gemma4_tiny" / "512_fp32" / "metrics.json").read_text())
    assert metrics["parity"]["passed"]


def test_core_leases_share_out_a_hosts_cores_and_the_trace_port_waits(tmp_path, monkeypatch):
    from pipeline.backends import neuron_cores
    from pipeline.core.errors import PreflightError

    monkeypatch.setenv("GEMMA4_NEURON_LOCK_DIR", str(tmp_path))
    first = neuron_cores.acquire(2, 4, None, "first")
    second = neuron_cores.acquire(2, 4, None, "second")
    assert (first.visible_cores, second.visible_cores) == ("0-1", "2-3")
    assert second.env() == {"NEURON_RT_VISIBLE_CORES": "2-3"}
    with pytest.raises(PreflightError, match="core 0: first .*core 2: second"):
        neuron_cores.acquire(2, 4, None, "third")
    first.release()
    assert neuron_cores.acquire(2, 4, "0,1", "third").visible_cores == "0-1"
    # the port: a second holder waits for the first (another process), and says for whom
    holder = subprocess.Popen([sys.executable, "-c", "import sys\nfrom pipeline.backends import neuron_cores\n"
                               "with neuron_cores.trace_port('a host-prefill compile'):\n"
                               "    print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "GEMMA4_NEURON_LOCK_DIR": str(tmp_path)})
    assert holder.stdout.readline().strip() == "held"
    waiter = subprocess.Popen([sys.executable, "-c", "import logging\nfrom pipeline.backends import neuron_cores\n"
                               "logging.basicConfig(level=logging.INFO)\n"
                               "with neuron_cores.trace_port('another compile'):\n    print('got it', flush=True)"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "GEMMA4_NEURON_LOCK_DIR": str(tmp_path)})
    with pytest.raises(subprocess.TimeoutExpired):
        waiter.wait(timeout=3)
    holder.communicate("")
    out, err = waiter.communicate(timeout=30)
    assert "waiting for port 2022, held by a host-prefill compile" in err and out.strip() == "got it"


def test_links_in_the_shared_lease_folder_are_never_followed_and_any_argv_is_named(tmp_path, monkeypatch):
    """The lease folder is every user's (sticky): a link another user made as an owner file is not written through,
    one made as a lease file is refused by name, and a byte of argv that is not UTF-8 is written escaped (it was a
    UnicodeEncodeError)."""
    from pipeline.backends import neuron_cores
    from pipeline.core.errors import PreflightError

    folder = tmp_path / "leases"
    folder.mkdir(mode=0o1777)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (folder / "nc0.owner").symlink_to(victim)
    monkeypatch.setenv("GEMMA4_NEURON_LOCK_DIR", str(folder))
    monkeypatch.setattr(sys, "argv", ["pipeline", "--dest", "/tmp/caf\udce9"])
    lease = neuron_cores.acquire(2, 4, "0-1", "a compile")
    assert (folder / "nc1.owner").read_text().endswith("/tmp/caf\\udce9)\n")
    lease.release()
    assert victim.read_text() == "precious\n"
    (folder / "nc2.lock").symlink_to(victim)
    with pytest.raises(PreflightError, match=r"nc2.lock: it is a symbolic link"):
        neuron_cores.acquire(1, 4, "2", "another")
    (folder / "nc3.lock").mkdir()
    with pytest.raises(PreflightError, match=r"nc3.lock: Is a directory; remove it"):
        neuron_cores.acquire(1, 4, "3", "another")


def test_a_failed_host_prefill_compile_keeps_its_log_where_the_error_says(fake_neuron, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON_COMPILE_ERROR", "NCC_IBIR158 unsupported operator")
    cfg = _prepared(tmp_path, "256_bf16_host")
    with pytest.raises(BuildError) as failed:
        run(cfg, "trace")
    kept = re.search(r"logs \(log-neuron-cc.txt\) are kept under (\S+)", str(failed.value))
    assert kept, str(failed.value)
    log = Path(kept.group(1)) / "log-neuron-cc.txt"
    assert "NCC_IBIR158 unsupported operator" in log.read_text()
    assert not (tmp_path / "gemma4_tiny" / "256_bf16_host" / "build").exists()


# -- the whole pipeline on the stand-in ----------------------------------------------------------------------------

def _manifest(root: Path, variant: str) -> dict:
    return json.loads((root / "gemma4_tiny" / variant / "dist" / "manifest.json").read_text())


def test_device_prefill_end_to_end_on_the_stand_in(neuron_checked):
    out, root = neuron_checked
    variant_dir = root / "gemma4_tiny" / "512_fp32"
    assert sorted(p.name for p in (variant_dir / "build").iterdir()) == ["model.pt"], out.stderr[-3000:]
    assert not any(p.name.startswith("compile-") for p in variant_dir.iterdir())  # work files removed on success
    manifest = _manifest(root, "512_fp32")
    assert manifest["layout"] == "nxd_model" and manifest["version"].startswith("512_fp32-ncc2.23.6484.0-")
    with zipfile.ZipFile(variant_dir / "build" / "model.pt") as saved:  # no paths of this checkout (torchscript.py)
        assert saved.namelist() and not [n for n in saved.namelist() if n.endswith(".debug_pkl")]
    assert manifest["variant"]["tp_degree"] == 2
    assert manifest["compiler"]["args"] == NEURON_ARGS
    assert manifest["compiler"]["versions"]["neuronx-cc"].startswith("2.23.6484.0+")  # with the build hash
    assert manifest["toolchain"]["neuronx_cc"]["source"] == "neuronxcc.__version__"
    build = json.loads((variant_dir / "build.json").read_text())
    assert build["preflight"]["host"]["neuron_cores"] == 2 and build["preflight"]["need"]["neuron_cores"] == 2
    assert build["trace"]["api"] == "ModelBuilder"
    assert build["trace"]["effective_compiler_args"] == NEURON_ARGS + ["-O1", "--verbose=35"]
    # What the SDK added, read from each graph's compiler log: ModelBuilder's defaults and --logfile, and what sits
    # below it (--framework, --target, --output); the sharded checkpoints it wrote into its work folder counted.
    added = build["trace"]["sdk_added_args"]
    assert {"--framework XLA", "--target inf2", "-O1", "--verbose=35"} <= set(added)
    assert any(a.startswith("--logfile=<workdir>/model_builder/prefill/_tp0_bk0/") for a in added), added
    assert sorted(build["trace"]["compiler_commands"]) == ["model_builder/decode/_tp0_bk0/log-neuron-cc.txt",
                                                           "model_builder/prefill/_tp0_bk0/log-neuron-cc.txt"]
    # The flags ModelBuilder passed, from its compiler_flag_hook: what a compile-cache hit records too
    assert build["trace"]["compile_cache"] == {"decode/_tp0_bk0": "compiled", "prefill/_tp0_bk0": "compiled"}
    assert build["trace"]["compiler_flags"] == {
        f"{key}/_tp0_bk0": build["trace"]["effective_compiler_args"]
        + [f"--logfile=<workdir>/model_builder/{key}/_tp0_bk0/log-neuron-cc.txt"] for key in ("decode", "prefill")}
    assert build["trace"]["workdir_bytes"] >= manifest["members"][0]["size"] * 0.5  # two rank slices of the weights
    memory = build["trace"]["device_memory_estimate"]
    assert 0 < memory["total"] < memory["neuroncore_hbm"] == 16
    parity = json.loads((variant_dir / "validation.json").read_text())["parity"]
    # Token for token: the stand-in loads every weight, the layer_scalar buffers among them, from the checkpoint it
    # is given (a missing one is a KeyError); and the load passes only with torch_neuronx imported first.
    assert parity["mode"] == "exact" and parity["passed"] and parity["prompts"] == 3


def test_model_pt_holds_every_ranks_weights_and_state_outside_its_graphs_and_the_room_check_counts_them(
        fake_neuron, neuron_checked):
    """Issue 51 (items 3 and 6b): as NxD's SPMD models, the stand-in's graphs take the weights and the KV state as
    inputs and hold neither; ``nxd_model.weights`` and ``nxd_model.state`` (NxD v2.28.0 trace/spmd.py:166-168) are
    what model.pt is made of, and the room check before saving it counts them (``nxd_held_tensors``)."""
    import torch_neuronx  # noqa: F401 - the stand-in's ops, which the saved graphs call

    from pipeline.backends import torchscript
    from pipeline.backends.neuron_rank import nxd_held_tensors

    out, root = neuron_checked
    path = root / "gemma4_tiny" / "512_fp32" / "build" / "model.pt"
    model = torch.jit.load(path)
    size, held = path.stat().st_size, nxd_held_tensors(model)
    in_graphs = torchscript.archive_bytes(model) - torchscript.SAVE_SLACK_BYTES
    assert in_graphs < 0.01 * size, (in_graphs, size)  # the graphs: a few empty tensors
    assert len(model.nxd_model.weights) == len(model.nxd_model.state) == 2  # one of each per rank
    assert size <= torchscript.archive_bytes(model, held) < size + torchscript.SAVE_SLACK_BYTES


def test_a_compile_cache_hit_records_the_same_flags_and_says_it_was_a_hit(tmp_path):
    """NxD compiles with use_cache=True: on a hit neuronx-cc writes no log, while NxD writes the NEFF it got back into
    the bucket's folder either way; the flags come from ModelBuilder's hook either way. compile_cache decides by the
    files: a log (readable or not) compiled, a NEFF without one a hit, anything else unknown (issue 51: a log that
    could not be parsed was reported as a hit)."""
    from pipeline.backends.neuron import compile_cache, passed_flags

    workdir = tmp_path / "compile-gemma4_tiny-512_fp32"
    buckets = ("prefill_16", "prefill", "decode", "lost")
    passed = {f"{key}/_tp0_bk0": f"--auto-cast=none -O1 --verbose=35 --logfile={workdir}/model_builder/{key}/_tp0_bk0/"
              "log-neuron-cc.txt" for key in buckets}
    passed["elsewhere/_tp0_bk0"] = f"--auto-cast=none --logfile={tmp_path}/my-log.txt"
    for key in (*buckets, "elsewhere"):
        (workdir / "model_builder" / key / "_tp0_bk0").mkdir(parents=True)
    for key in ("prefill_16", "prefill", "decode", "elsewhere"):
        (workdir / "model_builder" / key / "_tp0_bk0" / "graph.neff").write_bytes(b"neff")
    (workdir / "model_builder" / "prefill" / "_tp0_bk0" / "log-neuron-cc.txt").write_text("a command line\n")
    (workdir / "model_builder" / "prefill_16" / "_tp0_bk0" / "log-neuron-cc.txt").write_text("no command at all\n")
    (tmp_path / "my-log.txt").write_text("every bucket's log\n")
    assert compile_cache(passed, workdir) == {"decode/_tp0_bk0": "cache hit", "elsewhere/_tp0_bk0": "unknown",
                                              "lost/_tp0_bk0": "unknown", "prefill/_tp0_bk0": "compiled",
                                              "prefill_16/_tp0_bk0": "compiled"}
    assert passed_flags(passed, workdir)["decode/_tp0_bk0"] == [
        "--auto-cast=none", "-O1", "--verbose=35",
        "--logfile=<workdir>/model_builder/decode/_tp0_bk0/log-neuron-cc.txt"]


def test_a_compiler_log_without_a_readable_command_line_still_records_flags_and_compiles(monkeypatch, tmp_path):
    """How neuronx-cc's log starts is not public: with a log the command-line reader cannot read (the stand-in's
    FAKE_NEURON_LOG_HEAD=opaque) the build records no commands and no SDK-added arguments, and still the flags
    ModelBuilder passed and each bucket compiled, not a cache hit."""
    monkeypatch.setenv("FAKE_NEURON_LOG_HEAD", "opaque")
    site = fake_sdk.install(tmp_path / "sdk")
    with fake_sdk.activated(site, monkeypatch):
        cfg = _prepared(tmp_path / "a", "512_fp32", "variant.tp_degree=1", f"backend.compile_cache_dir={tmp_path}/c")
        run(cfg, "trace")
    build = json.loads((tmp_path / "a" / "gemma4_tiny" / "512_fp32+tp1" / "build.json").read_text())["trace"]
    assert build["compiler_commands"] == {} and build["sdk_added_args"] == []
    assert build["compile_cache"] == {"decode/_tp0_bk0": "compiled", "prefill/_tp0_bk0": "compiled"}
    assert sorted(build["compiler_flags"]) == ["decode/_tp0_bk0", "prefill/_tp0_bk0"]


def test_host_prefill_end_to_end_on_the_stand_in_seeds_each_ranks_kv(neuron_checked):
    out, root = neuron_checked
    variant_dir = root / "gemma4_tiny" / "256_bf16_host"
    assert sorted(p.name for p in (variant_dir / "build").iterdir()) == ["tp_0.pt", "tp_1.pt"], out.stderr[-3000:]
    manifest = _manifest(root, "256_bf16_host")
    assert manifest["layout"] == "per_rank" and manifest["compiler"]["args"] == NEURON_ARGS
    build = json.loads((variant_dir / "build.json").read_text())
    assert build["trace"]["api"] == "parallel_model_trace"
    # parallel_model_trace logs to its working directory (no --logfile): the compile's work folder, which survives
    assert list(build["trace"]["compiler_commands"]) == ["log-neuron-cc.txt"]
    assert {"--framework XLA", "--target inf2"} <= set(build["trace"]["sdk_added_args"])
    parity = json.loads((variant_dir / "validation.json").read_text())["parity"]
    # Within bf16 noise of the reference on every prompt only if each prompt's caches were seeded where the loaded
    # model reads them: its first forward replaced the state parameters, so the second and third prompts fail
    # unless they are read afresh.
    assert parity["mode"] == "logits" and parity["passed"] and parity["prompts"] == 3


@pytest.mark.slow  # a whole build of its own (make test-slow), for make test's budget
def test_a_compile_the_oom_killer_stops_leaves_nothing_and_says_so(fake_neuron, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON_COMPILE_ERROR", "Compile command returned: -9")
    cfg = neuron_config(tmp_path, "512_bf16", "variant.tp_degree=1")
    with pytest.raises(BuildError, match=r"(?s)out-of-memory killer.*At the preflight: available RAM"):
        run(cfg)
    variant_dir = tmp_path / "gemma4_tiny" / "512_bf16+tp1"  # an override's build has a name of its own
    assert not (variant_dir / "build").exists() and not (variant_dir / "build.json").exists()
    assert not [p for p in variant_dir.iterdir() if p.name.startswith(".")]  # no staging directory left


def test_the_neuron_preflight_refuses_a_host_without_neuroncores(fake_neuron, tmp_path, monkeypatch):
    """The Neuron packages installed, but no Neuron device (no neuron-ls): refused before any compile."""
    from pipeline.core.errors import PreflightError

    path = os.environ["PATH"].split(os.pathsep)
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in path if p != str(fake_neuron / "bin")))
    cfg = _prepared(tmp_path, "512_bf16")
    with pytest.raises(PreflightError, match="needs 2 NeuronCores but neuron-ls is not available"):
        run(cfg, "trace")
    assert not (tmp_path / "gemma4_tiny" / "512_bf16" / "build").exists()


# -- the first run on an inf2 host -------------------------------------------------------------------------------

def test_neuron_check_runs_every_layout_and_gives_a_verdict_per_check(neuron_checked):
    out, _ = neuron_checked
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = {line.split("  ")[0]: line for line in out.stdout.splitlines()[1:] if line.strip()}
    assert "Neuron SDK 2.28.1" in rows["Neuron packages"]
    assert "exact parity on 3/3 prompts" in rows["device prefill (ModelBuilder, model.pt): load and decode"]
    # three prompts, each re-seeding the ranks' state after the first forward replaced it
    assert "logits parity on 3/3 prompts" in rows["host prefill (parallel_model_trace, tp_N.pt): load and decode"]
    # at batch 4: the executor of five inputs, each graph's cache lines; host prefill seeding one line of the state
    for layout, mode in (("device prefill at batch 4", "exact"), ("host prefill at batch 4", "logits")):
        assert f"{mode} parity on 3/3 prompts; 5 decoded together in 4 lines as alone" in rows[f"{layout}: load and "
                                                                                              "decode"]
    assert "11 of 11 checks passed" in out.stdout


def test_neuron_check_without_the_packages_says_what_to_install_and_skips_the_rest():
    out = subprocess.run([sys.executable, "-m", "pipeline", "neuron-check"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=600)
    assert out.returncode == 1
    assert re.search(r"Neuron packages\s+FAIL .*deploy/install-inf2.sh", out.stdout)
    assert out.stdout.count("skipped") == 10 and "0 of 11 checks passed" in out.stdout


def test_a_process_that_loads_a_build_by_itself_leases_its_cores_for_its_lifetime(fake_neuron):
    """generate (and any other loader not started by a stage) takes its own lease and names its cores to the
    runtime; the lease lasts until the process exits, as the runtime's hold on the cores does."""
    code = ("import os, sys\nfrom pipeline.backends.neuron import lease_for_this_process\n"
            "lease_for_this_process(2)\nprint(os.environ['NEURON_RT_VISIBLE_CORES'], flush=True)\nsys.stdin.read()")
    first = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "0-1"
        second = subprocess.run([sys.executable, "-c", code], input="", capture_output=True, text=True)
        assert second.returncode != 0 and "taken by: core 0: loading a build in process" in second.stderr
        assert "set NEURON_RT_VISIBLE_CORES=A-B for this process" in second.stderr
        given = subprocess.run([sys.executable, "-c", code], input="", capture_output=True, text=True,
                               env={**os.environ, "NEURON_RT_VISIBLE_CORES": "0-1"})
        assert given.returncode == 0 and given.stdout.strip() == "0-1"  # the caller's choice is kept
        one = subprocess.run([sys.executable, "-c", code], input="", capture_output=True, text=True,
                             env={**os.environ, "NEURON_RT_VISIBLE_CORES": "1"})
        assert one.returncode != 0 and "NEURON_RT_VISIBLE_CORES='1' names 1 NeuronCore(s)" in one.stderr
    finally:
        first.communicate("")


def test_paths_the_compile_process_gets_are_absolute(tmp_path, monkeypatch):
    """The compile runs in its work directory: a relative cache path or PYTHONPATH entry would point elsewhere."""
    from pipeline.backends.neuron import compile_env
    from pipeline.backends.neuron_cores import Lease
    from pipeline.stages.trace import compile_cache

    cfg = neuron_config(tmp_path / "artifacts", "512_bf16", "backend.compile_cache_dir=neuron-cache")
    assert compile_cache(cfg) == str((tmp_path / "artifacts" / "neuron-cache").resolve())
    cfg = neuron_config(tmp_path / "artifacts", "512_bf16", "backend.compile_cache_dir=s3://bucket/cache")
    assert compile_cache(cfg) == "s3://bucket/cache"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "extra")
    env = compile_env(Lease([0, 1]))
    assert env["PYTHONPATH"].split(os.pathsep)[1] == str(tmp_path / "extra")
    assert env["NEURON_RT_VISIBLE_CORES"] == "0-1"


def test_host_prefill_on_an_unknown_release_needs_asking_for(fake_neuron):
    info = next(fake_neuron.glob("neuronx_cc-*.dist-info"))
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: neuronx-cc\nVersion: 2.99.1.0\n")
    assert "add its row" in missing_api("device")
    assert missing_api("device", check_release=False) is None
    assert "whether parallel_model_trace works there is unknown" in missing_api("host", check_release=False)
    assert missing_api("host", check_release=False, allow_unsupported_host_prefill=True) is None


# -- the throughput gate on the production path ----------------------------------------------------------------------

def test_hardware_auto_reads_the_instance_type_offline(tmp_path, monkeypatch):
    from pipeline.host.preflight import resolve_hardware

    dmi = tmp_path / "product_name"
    monkeypatch.setenv("GEMMA4_DMI_PRODUCT_NAME_FILE", str(dmi))
    for text, expected in (("inf2.8xlarge\n", "inf2_8xlarge"), ("inf2.xlarge", "inf2_xlarge"),
                           ("Standard PC (Q35 + ICH9, 2009)", "local")):
        dmi.write_text(text)
        assert resolve_hardware("auto") == expected
    dmi.unlink()
    assert resolve_hardware("auto") == "local" and resolve_hardware("inf2_xlarge") == "inf2_xlarge"


@pytest.mark.slow  # a whole build of its own (make test-slow), for make test's budget
def test_a_neuron_validation_without_a_floor_for_its_hardware_is_refused_before_loading(fake_neuron, tmp_path):
    cfg = _prepared(tmp_path, "512_fp32", *FAST_VALIDATE, "hardware=local")
    for stage in ("reference", "trace", "package"):
        run(cfg, stage)
    with pytest.raises(ConfigError, match=r"hardware='local' has no neuron throughput floor .*hardware=auto detects "
                                          r"its instance type"):
        run(cfg, "validate")
    assert not (tmp_path / "gemma4_tiny" / "512_fp32" / "metrics.json").exists()


def test_dvc_repro_validates_on_the_detected_hardware():
    import yaml

    repo = Path(__file__).resolve().parent.parent
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    assert "hardware=${hardware}" in stages["validate"]["do"]["cmd"]
    assert yaml.safe_load((repo / "params.yaml").read_text())["hardware"] == "auto"


def test_without_the_neuron_packages_every_stage_says_to_install_them_first(tmp_path):
    """The toolchain stage too: a refused run writes no toolchain.json (which every build depends on)."""
    cfg = neuron_config(tmp_path, "512_bf16")
    for stage in ("toolchain", "trace", "all"):
        with pytest.raises(BuildError) as refused:
            run(cfg, stage)
        assert "deploy/install-inf2.sh" in str(refused.value) and "stage=toolchain" not in str(refused.value)
    assert not (tmp_path / "toolchain.json").exists()


def test_a_variant_too_large_for_a_neuroncore_is_refused_before_any_compile(fake_neuron, tmp_path, monkeypatch):
    from pipeline.backends import neuron_memory

    monkeypatch.setattr(neuron_memory, "NEURONCORE_V2_HBM", neuron_memory.RUNTIME_RESERVE)  # a core with no room
    cfg = _prepared(tmp_path, "512_bf16")
    with pytest.raises(ConfigError, match=r"512/128 bf16 device-prefill at tp_degree 2 needs about .* GiB: weights "
                                          r".* more than a NeuronCore-v2's"):
        run(cfg, "trace")
    assert _nothing_built(tmp_path, "512_bf16")


@pytest.mark.parametrize("prefill, module, name", [("device", "neuronx_distributed/trace/model_builder.py", None),
                                                   ("host", "neuronx_distributed/trace/__init__.py",
                                                    "    parallel_model_trace,\n")])
def test_an_unknown_sdk_without_the_variants_api_is_refused_by_name(fake_neuron, prefill, module, name):
    """With backend.check_sdk_release=false an SDK outside the table may lack the API a variant compiles with: the
    module itself (ModelBuilder's), or the name in a module that is there (parallel_model_trace)."""
    package = fake_neuron / "neuronx_distributed"  # a link to tests/fake_neuron: edit a copy, never the stand-in
    source = package.resolve()
    package.unlink()
    shutil.copytree(source, package)
    fake_sdk.forget_modules()
    importlib.invalidate_caches()
    path = fake_neuron / module
    if name is None:
        path.unlink()
    else:
        path.write_text(path.read_text().replace(name, ""))  # the module imports, without the name
    reason = missing_api(prefill, check_release=False, allow_unsupported_host_prefill=True)
    api = "ModelBuilder" if prefill == "device" else "parallel_model_trace"
    assert reason and f"{api}, which the installed Neuron SDK lacks" in reason and "deploy/install-inf2.sh" in reason
