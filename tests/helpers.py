"""Run pipeline stages in-process through the same entry point the command line uses."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

try:
    import tomllib  # noqa: F401 (re-exported for the tests)
except ModuleNotFoundError:  # Python 3.10, the inf2 DLAMI's (make test-production): tomli is what became tomllib
    import tomli as tomllib  # noqa: F401 (re-exported for the tests)

from hydra import compose, initialize_config_dir

from pipeline.artifact.manifest import SCHEMA_VERSION, Manifest
from pipeline.config import PipelineConfig
from pipeline.run import load_config, run_pipeline

CONF = Path(__file__).resolve().parent.parent / "conf"


def _cpu_compiler() -> str:
    import torch

    return "cpu-torch" + torch.__version__.split("+")[0]


CPU_COMPILER = _cpu_compiler()
"""The compiler part of a cpu-backend version here, e.g. ``cpu-torch2.13.0`` (``cpu-torch2.8.0`` at the production
versions)."""

CPU_TOOLCHAIN = {"schema_version": 2, "backend": "cpu", "packages": {"torch": {"version": "2.13.0"}},
                 "neuronx_cc": {"version": None, "source": None}, "system_packages": {}}
"""A toolchain record (toolchain.json) of a host with torch and no Neuron packages, as a manifest repeats it."""

# Validation settings that keep a test run to a few seconds: two prompts (one spans several 128-token buckets), and
# one short throughput context.
FAST_VALIDATE = [
    "validate.prompt_names=[capital,spans_64]",
    "validate.throughput.contexts=[short]",
    "validate.throughput.runs=1",
    "validate.throughput.warmup_runs=0",
    "validate.throughput.decode_tokens=4",
    "validate.warmup_prompts=0",
]


def edited_checkpoint(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` whose tensors ``edit(tensors)`` changed in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def device_prefill_variants() -> list[str]:
    """The named variants whose prefill runs on the device (conf/variant/*.yaml, by their ``prefill`` field)."""
    import yaml

    from pipeline.config import available_variants

    return [v for v in available_variants(CONF)
            if yaml.safe_load((CONF / "variant" / f"{v}.yaml").read_text())["prefill"] == "device"]


def config(artifacts: Path, *overrides: str, variant: str | None = "512_fp32") -> PipelineConfig:
    backend = [] if any(o.startswith("backend=") for o in overrides) else ["backend=cpu"]
    args = [f"artifacts_dir={artifacts}", *backend, *overrides]
    if variant:
        args.insert(0, f"+variant={variant}")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return load_config(compose(config_name="config", overrides=args), variant)


def neuron_config(artifacts: Path, variant: str, *overrides: str) -> PipelineConfig:
    return config(artifacts, "backend=neuron", *overrides, variant=variant)


def run(cfg: PipelineConfig, stage: str = "all"):
    cfg.stage = stage
    return run_pipeline(cfg)


def a_manifest(**changes) -> Manifest:
    """A valid manifest of a two-rank cpu build of the tiny model (made-up checksums), with ``changes`` to its
    top-level fields."""
    members = [{"path": f"tp_{rank}.pt", "size": 1000 + rank, "sha256": f"{rank + 1}" * 64} for rank in (0, 1)]
    manifest = Manifest.from_json({
        "schema_version": SCHEMA_VERSION, "version": f"512_fp32-{CPU_COMPILER}-0123abcd", "fingerprint": "0" * 64,
        "model": {"name": "gemma4_tiny", "hub_id": None, "revision": None, "config_digest": "c" * 64,
                  "weights_digest": "d" * 64},
        "variant": {"name": "512_fp32", "kv_max": 512, "bucket": 128, "dtype": "fp32", "prefill": "device",
                    "tp_degree": 2},
        "backend": "cpu", "compiler": {"id": CPU_COMPILER, "args": [], "versions": {"torch": "2.13.0"}},
        "toolchain": CPU_TOOLCHAIN, "layout": "per_rank", "members": members,
        "archive": {"name": "a.tar.zst", "format": "tar.zst", "size": 2000, "sha256": "e" * 64, "root": "a"},
        "created_by": "gemma4-neuron-pipeline test",
    }, "a_manifest")
    return replace(manifest, **changes)


def stand_in_floors(validate: dict) -> None:
    """Lower the neuron throughput floors of a conf/validate dict to the cpu backend's sanity floor.

    The stand-in SDK decodes on this machine's CPU, so inf2's floors would measure the machine's load, not the code: a
    busy 2-core host falls under the decode floor (28.4 tok/s against 30, seen beside another run) and over the host
    prefill's first-token floor (3105 ms against 2000, seen in a .ci/run while other tests read and wrote gigabytes;
    7 ms idle). The gates themselves are tested in test_validation.py and test_rebuild.py.
    """
    floors = validate["throughput"]["floors"]
    for hardware in floors["neuron"].values():
        for key in ("tokens_per_s", "ttft_ms_device", "ttft_ms_host"):
            hardware[key] = floors["cpu"]["any"][key]


STAND_IN_REGRESSION = {"tokens_per_s_drop": 1.0, "ttft_ms_rise": 1e6}
"""publish.regression's tolerances where the stand-in SDK's builds are compared with each other: limits any timing
meets, so that the rows are still computed and recorded (what is checked is that each new version is compared with
the one it replaces, the outcome in its manifest) while test_rebuild.py tests the gate's limits. The stand-in's timings
are this machine's CPU at that moment: a host-prefill first token measured 18 ms before a compiler upgrade and
1708 ms after it in one .ci/run (65 ms and 1589 ms in another), and tokens/s with one sequence in flight 113 before
and 5.4 after in a third (-95 %, past the 90 % drop these tolerances once allowed), the machine busy with the other
tests each time."""


E2B_SHAPE = [  # the tiny model in Gemma-4-E2B's shape (docs/models.md): overrides of model.tiny
    "+model.tiny.num_key_value_heads=1", "+model.tiny.use_double_wide_mlp=true", "+model.tiny.unused_shared_kv=true",
    "+model.tiny.num_hidden_layers=10", "+model.tiny.num_kv_shared_layers=4",
    "+model.tiny.layer_types=[" + ",".join((["sliding_attention"] * 4 + ["full_attention"]) * 2) + "]",
]
"""E2B's mechanisms at toy size: one KV head under four query heads (copied to both ranks at tp_degree 2), a period
of five layers (four sliding, one full), the last four KV-shared with a double-wide MLP, and the release's K/V
projections of those layers in the checkpoint, unused."""
