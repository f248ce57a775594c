"""What every backend provides: trace a variant's ranks into a build directory, and load them back to run.

A backend's ``trace`` writes the rank files (exactly ``members(variant)``) into a temporary directory beside the
final one and renames it into place only when every rank succeeded. ``load`` returns a ``RankRunner`` that executes
the traced entry points on all ranks at once and hands back rank 0's outputs (all ranks hold the same gathered
logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from pipeline.core.shape import BuildShape

if TYPE_CHECKING:
    from pipeline.core.build_records import ToolchainRecord, TraceResult
    from pipeline.host.preflight import Need, Resources


@dataclass(frozen=True)
class CheckpointRef:
    directory: Path
    text_prefix: str
    head_key: str = "lm_head.weight"


@dataclass(frozen=True)
class TraceRequest:
    checkpoint: CheckpointRef
    shape: BuildShape
    compiler_args: tuple[str, ...] = ()
    workdir: Path | None = None
    """The compiler's scratch directory (default: beside the build); cleared by the compiler, so always ours."""
    max_parallel: int = 0  # ranks compiled at once; 0 means all
    visible_cores: str | None = None
    """The NeuronCores to compile on (``backend.visible_cores``); None takes the first free ones."""
    check_sdk_release: bool = True
    """Refuse Neuron packages that are not exactly one SDK release (``backend.check_sdk_release``)."""
    allow_unsupported_host_prefill: bool = False
    """Compile host prefill on a release where it is not known to work (``backend.allow_unsupported_host_prefill``)."""
    compile_cache_dir: str | None = None
    """NEURON_COMPILE_CACHE_URL for the compiler (a path or s3:// URL); None keeps the compiler's default."""
    host: Resources | None = None
    """The preflight's measurement of this host; quoted when a rank or the compiler is killed."""
    need: Need | None = None


class RankRunner(Protocol):
    """A loaded build: every call runs on all ranks and returns rank 0's ``(logits [rows, vocab] fp32, token
    [rows])``: one row for a prefill, ``batch_size`` for a decode step. At batch above 1 every call also takes the
    ``seq_ids`` input (pipeline/recipe/model.py ``RankDecoder.step``); at batch 1 it is left out."""

    shape: BuildShape

    def prefill(self, embeds, per_layer_tokens, positions, last_index,
                seq_ids=None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode(self, embeds, per_layer_tokens, positions, last_index,
               seq_ids=None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def seed_kv(self, per_rank: list[list[torch.Tensor]], line: int = 0) -> None:
        """Write host-computed caches (``cache_names()`` order, rank r's heads, one sequence's: ``[1, heads, kv_max,
        d]``) into cache line ``line`` of each rank, the other lines untouched."""

    def reset(self) -> None:
        """Zero every rank's KV caches (between prompts, at batch 1 only: a batch's other lines are in use)."""

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def members(self, shape: BuildShape) -> list[str]:
        """The exact file names a build directory holds."""

    def compiler_id(self, toolchain: ToolchainRecord) -> str:
        """The compiler part of a version name, e.g. ``ncc2.23.6484.0`` or ``cpu-torch2.13.0``."""

    def check(self, request: TraceRequest) -> None:
        """Refuse, before anything is written, what this backend cannot build (its packages, the variant, the
        checkpoint)."""

    def check_installed(self, request: TraceRequest | None = None) -> None:
        """Refuse, before any stage runs (the toolchain record included), a backend whose packages are missing, or
        that cannot build ``request``'s variant with what is installed (where that is cheap to tell)."""

    def check_load(self, shape: BuildShape) -> None:
        """Refuse, before an archive is unpacked, a build of ``shape`` this backend cannot run."""

    def trace(self, request: TraceRequest, out_dir: Path) -> TraceResult:
        """Build the ranks into ``out_dir`` (atomically) and say what was built, and how."""

    def load(self, build, shape: BuildShape) -> RankRunner:
        """Load a ``pipeline.artifact.archive.VerifiedBuild`` (never a bare path: loading TorchScript runs code)."""


def graph_inputs(shape: BuildShape, *inputs: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """A call's inputs as the build's graphs take them: ``seq_ids`` (the last) at batch above 1, none at batch 1.
    Refuses either mistake before a rank is called (a batch graph called without its lines would fail inside it)."""
    *tensors, seq_ids = inputs
    if shape.batched != (seq_ids is not None):
        raise ValueError(f"a batch_size {shape.batch_size} build's graphs take seq_ids "
                         f"{'as a fifth input' if shape.batched else 'never'}: the caller passed "
                         f"{'none' if seq_ids is None else 'one'}")
    return (*tensors, seq_ids) if shape.batched else tuple(tensors)


def example_inputs(spec, tokens: int, rows: int = 1) -> tuple[torch.Tensor, ...]:
    """Example inputs of a call over ``tokens`` tokens of ``rows`` sequences: ``(embeds, per_layer_tokens, positions,
    last_index)``.

    Values never matter (the graph has no data-dependent control flow); shapes and dtypes do: they are what a
    compiled graph accepts, and what neuronx-distributed's NxDModel routes calls by.
    """
    embeds = torch.zeros(rows, tokens, spec.hidden_size)
    per_layer = torch.zeros(rows, tokens, spec.num_layers, spec.ple_dim) if spec.ple_dim else torch.zeros(0)
    # (torch 2.8 saves a trace's example inputs in the rank file: batch 1's are built as they always were)
    positions = torch.arange(tokens).view(1, tokens) if rows == 1 else torch.arange(tokens).repeat(rows, 1)
    return embeds, per_layer, positions, torch.tensor([tokens - 1])


def entry_inputs(spec, shape: BuildShape, entry: str) -> tuple[torch.Tensor, ...]:
    """Example inputs of ``entry`` (a prefill graph: a bucket of one sequence; ``decode``: one token of each of the
    batch's sequences) for a build of ``shape``. At batch above 1 both take ``seq_ids`` too, so that every graph of
    a build takes the same inputs: neuronx-distributed traces ModelBuilder's executor with one key's example inputs
    (NxD v2.28.0 trace/model_builder.py ~1091), and NxDI gives every graph the same inputs for this reason."""
    if entry != "decode":
        inputs = example_inputs(spec, shape.entry_rows(entry)[1])
        return (*inputs, torch.tensor([0])) if shape.batched else inputs
    inputs = example_inputs(spec, 1, shape.batch_size)
    return (*inputs, torch.arange(shape.batch_size)) if shape.batched else inputs


def check_request(request: TraceRequest):
    """Every check that needs no tracing: the variant's settings, the model's split, the checkpoint's tensors.

    Runs before any rank process starts or any output directory is created. Returns the model's spec.
    """
    from pipeline.core.errors import ConfigError
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.plan import ShardPlan
    from pipeline.recipe.spec import load_spec

    problems = request.shape.problems()
    if problems:
        raise ConfigError(problems)
    spec = load_spec(request.checkpoint.directory)
    problem = spec.positions_problem(request.shape.kv_max)
    if problem:
        raise ConfigError(problem)
    ShardPlan(spec, request.shape.tp_degree).check()
    with Checkpoint(request.checkpoint.directory, request.checkpoint.text_prefix, request.checkpoint.head_key) as ckpt:
        ckpt.verify(spec)
    return spec
