"""The recipe under neuronx-distributed: the modules, weights and entry points the Neuron compile runs.

Imported without the Neuron packages (everything touching them imports them inside a function), so what can be
computed without Inferentia is unit tested on any machine: the alias maps, the checkpoint the loader hands over, the
ModelBuilder plan.

- ``NeuronParallel`` gives the recipe neuronx-distributed's ``ColumnParallelLinear`` / ``RowParallelLinear`` (the
  only difference from the cpu backend): inputs cast to the weight dtype, row-parallel partial sums reduced in fp32,
  the vocabulary-split head all-gathered.
- ``AliasedRank`` (pipeline/backends/aliased_rank.py, which the xla backend lowers too) turns a rank's KV caches
  into ``nn.Parameter`` state returned as outputs 1.. and aliased back to themselves (``{cache: 1 + j}``), so they
  stay resident on the NeuronCore and each call updates them in place.
- Host prefill: ``parallel_model_trace`` calls ``host_prefill_rank(job)`` in each rank process; it slices that
  rank's weights straight from the safetensors files and returns ``(module, aliases)``. ``parallel_model_save``
  writes ``tp_0.pt``, ``tp_1.pt``.
- Device prefill: ``ModelBuilder`` with a ``prefill`` key (bucket tokens) and a ``decode`` key (one token) over one
  ``RankInstance``, so both graphs share one weight set and one KV state; ``full_checkpoint(job)`` reads the
  rank-side tensors at full size from the safetensors files (ModelBuilder cuts each rank's slice itself, along the
  same dimensions as ``ShardPlan``), the ``layer_scalar`` buffers among them, which are also copied in by hand when
  the module is built (``full_checkpoint`` says why both). The traced executor is saved as one file, ``model.pt``.

``python -m pipeline.backends.neuron_rank JOB.json RESULT.json`` runs one trace (the neuron backend starts it in its
own process group, so an out-of-memory kill or an interruption takes down the compiler with it and nothing else).
Reads its ``NeuronJob`` from JOB.json; writes the rank files into the job's ``out_dir`` and its ``CompileResult`` into
RESULT.json (both records: pipeline/backends/neuron_job.py).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from pipeline.backends.aliased_rank import AliasedRank
from pipeline.backends.base import entry_inputs
from pipeline.backends.neuron_job import CompileResult, NeuronJob
from pipeline.backends.torchscript import save as save_torchscript
from pipeline.core.fsutil import reporting_full_disk
from pipeline.core.shape import BuildShape
from pipeline.host.procinfo import die_with_parent
from pipeline.recipe.parallel import Parallel, ShardLinear

DEVICE_PREFILL_API = "neuronx_distributed.trace.model_builder.ModelBuilder"
HOST_PREFILL_API = "neuronx_distributed.trace.parallel_model_trace"
NXD_MODEL_FILE = "model.pt"
COMPILER_LOG = "log-neuron-cc.txt"  # neuronx-cc's log; NxD's LOG_FILE_DEFAULT_NAME (model_builder.py:79)
NEFF_FILE = "graph.neff"  # NxD's NEFF_FILE: each bucket's compiled graph in its work folder (v2.28.0 ~750)
MODEL_BUILDER_DIR = "model_builder"  # ModelBuilder's compiler_workdir, inside the compile's work directory


# -- the parallel primitives ------------------------------------------------------------------------------------------

@functools.cache
def nxd_linear_classes():
    """neuronx-distributed's parallel linear layers, adapted to the recipe's numerics (defined on first use)."""
    from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, RowParallelLinear
    from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region

    class Column(ColumnParallelLinear):
        """This rank's output rows; the fp32 residual stream is cast to the weight dtype first."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.to(self.weight.dtype))

    class Row(RowParallelLinear):
        """This rank's input columns; partial products summed across ranks in fp32 (built with reduce_output=False,
        so the sum is not rounded back to the weight dtype), as the cpu backend does."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            partial = super().forward(x.to(self.weight.dtype)).float()
            return reduce_from_tensor_model_parallel_region(partial, process_group=self.tensor_parallel_group)

    class Head(ColumnParallelLinear):
        """The vocabulary-split output head (gather_output=True): every rank ends with the full fp32 logits row."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x.to(self.weight.dtype)).float()

    return Column, Row, Head


class NeuronParallel(Parallel):
    """The recipe's layer factory on neuronx-distributed (inside its tensor-parallel context)."""

    def __init__(self, tp_degree: int):
        super().__init__(tp_degree, group="")

    def column(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        column, _, _ = nxd_linear_classes()
        return column(in_features, out_features, bias=False, gather_output=False, dtype=dtype)

    def row(self, in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
        _, row, _ = nxd_linear_classes()
        return row(in_features, out_features, bias=False, input_is_parallel=True, dtype=dtype, reduce_output=False)

    def head(self, in_features: int, vocab: int, dtype: torch.dtype, sharded: bool) -> nn.Module:
        if not sharded or self.tp_degree == 1:
            return ShardLinear(in_features, vocab, dtype)  # replicated: every rank computes the whole row
        _, _, head = nxd_linear_classes()
        return head(in_features, vocab, bias=False, gather_output=True, dtype=dtype)


def job_checkpoint(job: NeuronJob):
    from pipeline.recipe.checkpoint import Checkpoint

    return Checkpoint(job.checkpoint.directory, job.checkpoint.text_prefix, job.checkpoint.head_key)


def _layer_scalars(ckpt, spec) -> dict[int, torch.Tensor]:
    return {layer.index: ckpt.read(f"layers.{layer.index}.layer_scalar", spec).float() for layer in spec.layers}


def build_aliased_rank(job: NeuronJob, rank: int | None, entry: str = "decode") -> AliasedRank:
    """The rank module on neuronx-distributed's layers, for the graph of ``entry``.

    ``rank`` given (host prefill): every weight of that rank, sliced from the safetensors files, copied in.
    ``rank`` None (ModelBuilder): the structure only, its weights come from ``full_checkpoint``; ``layer_scalar`` is
    a buffer, which ModelBuilder's sharding does not modify, so it is also copied in here by hand (a graph that folds
    it as a constant takes this value).
    """
    from pipeline.recipe.model import RankDecoder
    from pipeline.recipe.plan import ShardPlan, load_rank_state
    from pipeline.recipe.spec import load_spec

    shape = job.shape
    spec = load_spec(job.checkpoint.directory)
    plan = ShardPlan(spec, shape.tp_degree)
    decoder = RankDecoder(spec, plan, NeuronParallel(shape.tp_degree), shape.kv_max, shape.torch_dtype,
                          shape.batch_size)
    with job_checkpoint(job) as ckpt:
        if rank is not None:
            copy_state(decoder, load_rank_state(ckpt, plan, rank, shape.torch_dtype))
        else:
            with torch.no_grad():
                for index, value in _layer_scalars(ckpt, spec).items():
                    scalar = decoder.layers[index].layer_scalar
                    if scalar.device.type != "meta":  # ModelBuilder also builds it on the meta device to shard
                        scalar.copy_(value.view_as(scalar))
    return AliasedRank(decoder.eval(), entry).eval()


def copy_state(decoder: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the module's existing tensors (keeping the parameter objects neuronx-distributed
    annotated), one tensor at a time so the rank's weights are never held twice. Missing or extra names are errors."""
    targets = decoder.state_dict(keep_vars=True)
    caches = set(decoder.cache_names())
    missing = sorted(n for n in targets if n not in state and n not in caches)
    unexpected = sorted(n for n in state if n not in targets)
    if missing or unexpected:
        raise RuntimeError(f"rank state does not fit the recipe: missing={missing} unexpected={unexpected}")
    with torch.no_grad():
        for name in list(state):
            tensor = state.pop(name)
            if targets[name].shape != tensor.shape:
                raise RuntimeError(f"{name}: rank state {list(tensor.shape)}, module {list(targets[name].shape)}")
            targets[name].copy_(tensor)


def full_checkpoint(job: NeuronJob) -> dict[str, torch.Tensor]:
    """ModelBuilder's checkpoint: every rank-side tensor of ``AliasedRank.state_dict()`` at full size and in its
    dtype, the ``layer_scalar`` buffers (fp32) included. NxD keeps every state_dict key it is given and passes a
    key it does not shard whole to each rank (v2.28.0 trace/trace.py ``preprocess_checkpoint`` ~628-644,
    ``shard_children`` ~773-774); whether torch-neuronx makes a read-only persistent buffer a weight input of the
    graph or folds it as a constant is closed source, and a weight input the checkpoint lacked would be skipped in
    silence at sharding. So the buffers are in the checkpoint (right either way: unused keys are tolerated, every graph
    of a ModelBuilder shares one weight set) and also copied in by hand when the module is built
    (``build_aliased_rank``: right for a folded constant). docs/inf2-host.md's first-run checklist asks which it is.

    Read straight from the safetensors files (``from_pretrained`` would trip ModelBuilder's meta-device parameter
    patching); the embedding tables stay on the host.
    """
    from pipeline.recipe.plan import ShardPlan, load_rank_state
    from pipeline.recipe.spec import load_spec

    shape = job.shape
    spec = load_spec(job.checkpoint.directory)
    with job_checkpoint(job) as ckpt:
        whole = load_rank_state(ckpt, ShardPlan(spec, 1), 0, shape.torch_dtype)
    plan = ShardPlan(spec, shape.tp_degree)  # KV heads fewer than ranks: each repeated, so that NxD's cut copies them
    return {"decoder." + name: plan.builder_tensor(name, tensor) for name, tensor in whole.items()}


def host_prefill_rank(job: NeuronJob) -> tuple[nn.Module, dict]:
    """``parallel_model_trace``'s ``func``: called in each rank process, under its tensor-parallel rank."""
    from neuronx_distributed.parallel_layers import parallel_state

    module = build_aliased_rank(job, parallel_state.get_tensor_model_parallel_rank())
    return module, module.aliases()


class RankInstance:
    """What ModelBuilder asks a model for (the ``BaseModelInstance`` interface: ``load_module()``, then
    ``get(bucket_rank) -> (module, input_output_aliases)``), for one key (``entry``). ModelBuilder builds the module
    for each key, and the aliases must name the parameters of the module just built; every key's module has the same
    weights and state (one weight set and one KV state on the NeuronCore)."""

    def __init__(self, job: NeuronJob, entry: str):
        self.job = job
        self.entry = entry
        self.module: AliasedRank | None = None

    def load_module(self) -> None:
        self.module = build_aliased_rank(self.job, rank=None, entry=self.entry)

    def get(self, bucket_rank: int, **kwargs) -> tuple[nn.Module, dict]:
        return self.module, self.module.aliases()


def model_builder_plan(shape: BuildShape) -> list[str]:
    """ModelBuilder's keys, one bucket each: the entry points (a prefill graph per bucket of the ladder, decode),
    whose example inputs ``entry_inputs`` makes. NxDModel routes a call to the graph whose example inputs had its
    shapes (``router_key``), so the ladder's prefill graphs, each of its own token count, never collide."""
    return list(shape.entries)


def router_key(inputs: tuple[torch.Tensor, ...]) -> str:
    """How NxDModel picks the graph for a call: the list of input shapes, as a string. Keys must differ."""
    return str([list(t.shape) for t in inputs])


def compiler_arg_string(args: list[str]) -> str:
    """ModelBuilder takes the compiler arguments as one string (it appends its own flags to it)."""
    return shlex.join(args)


def model_builder_flags(args: list[str], nxd_version: str | None = None) -> str:
    """The flags neuronx-cc gets from ``ModelBuilder.add(compiler_args=compiler_arg_string(args))``: ModelBuilder's
    ``append_default_compiler_flags``, re-implemented from neuronx-distributed v2.28.0 trace/model_builder.py
    (~104-124; unchanged in 0.18; 0.12 substituted the defaults only for None): no flags at all get its defaults;
    ``--auto-cast=none`` is appended when no ``--auto-cast`` is given, ``-O1`` when no ``-O<n>`` is, and, from NxD
    0.16 (SDK 2.27; absent at 2.25.0, c63420c ~92-108), ``--verbose=35`` when no ``--verbose`` is; NxD 0.12 (SDK
    2.23) has no such function and passes a given string as it is. ``nxd_version``: the installed
    neuronx-distributed's (None, or a version that does not parse: the pinned release's). (``trace`` then adds
    ``--logfile=<workdir>/<key>/...`` unless one is given.)"""
    flags = compiler_arg_string(args)
    if not release_at_least(nxd_version, "0.13"):
        return flags  # 0.12 (SDK 2.23, e834945 ~442-444): defaults only for None, and the backend passes a string
    if not flags:
        flags = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
    if "--auto-cast" not in flags:
        flags += " --auto-cast=none "
    if not re.search(r"-O\d+", flags):
        flags += " -O1 "
    if "--verbose" not in flags and release_at_least(nxd_version, "0.16"):
        flags += " --verbose=35"
    return flags


def release_at_least(nxd_version: str | None, first: str) -> bool:
    """Whether neuronx-distributed ``nxd_version`` (None: the pinned release's) is ``first`` or later."""
    from packaging.version import InvalidVersion, Version

    from pipeline.backends import neuron_sdk

    pinned = neuron_sdk.release(neuron_sdk.PINNED).neuronx_distributed
    try:
        version = Version(nxd_version or pinned)
    except InvalidVersion:  # an SDK outside the table (backend.check_sdk_release=false)
        version = Version(pinned)
    return version.release >= Version(first).release  # 0.16.0.dev1 is a 0.16


def effective_compiler_args(shape: BuildShape, args: list[str], nxd_version: str | None = None) -> list[str]:
    """What neuronx-cc is given for this variant: ModelBuilder's flags (device prefill), or the arguments as they are
    (``parallel_model_trace`` passes them through unchanged)."""
    return shlex.split(model_builder_flags(args, nxd_version)) if shape.prefill == "device" else list(args)


def takes_flag_hook(builder_class) -> bool:
    """Whether this ModelBuilder takes ``compiler_flag_hook``: from SDK 2.26 (NxD 0.15, commit fecfe75), not before
    (2.25.0, c63420c model_builder.py:1291-1308), where passing it is a ``TypeError``."""
    return "compiler_flag_hook" in inspect.signature(builder_class.__init__).parameters


def logfile_of(flags: str) -> Path | None:
    """The ``--logfile`` a compile was given (``--logfile=PATH`` or ``--logfile PATH``; the last one, as an argument
    parser takes it), or None."""
    words, found = shlex.split(flags), None
    for i, word in enumerate(words):
        if word.startswith("--logfile="):
            found = Path(word.split("=", 1)[1])
        elif word == "--logfile" and i + 1 < len(words):
            found = Path(words[i + 1])
    return found


def stored_flags(builder, workdir: str) -> dict[str, str]:
    """Per bucket, the flags ModelBuilder compiles it with, where it takes no ``compiler_flag_hook`` (SDK 2.23-2.25):
    what ``add`` stored (its defaults applied) plus the ``--logfile`` that ``trace`` appends when none is given,
    exactly as ``trace`` builds them before the compile (2.25.0 c63420c model_builder.py:1566-1567; the hook gets
    this very string from 2.26 on)."""
    flags = {}
    for key, container in builder.model_collection.items():
        args = container.compiler_args
        if "--logfile" not in args:
            args += f" --logfile={(Path(workdir) / key / '_tp0_bk0' / COMPILER_LOG).absolute()}"
        flags[f"{key}/_tp0_bk0"] = args
    return flags


# -- the two trace paths ----------------------------------------------------------------------------------------------

def trace_host_prefill(job: NeuronJob) -> None:
    from neuronx_distributed.trace import parallel_model_save, parallel_model_trace

    from pipeline.recipe.spec import load_spec

    shape = job.shape
    spec = load_spec(job.checkpoint.directory)
    model = parallel_model_trace(
        functools.partial(host_prefill_rank, job),
        entry_inputs(spec, shape, "decode"),
        compiler_workdir=job.workdir,
        compiler_args=list(job.compiler_args),
        tp_degree=shape.tp_degree,
        max_parallel_compilations=job.max_parallel or None,
    )
    parallel_model_save(model, job.out_dir)


def trace_device_prefill(job: NeuronJob) -> dict[str, str]:
    """ModelBuilder's build of both graphs, saved as ``model.pt``; returns the compiler flags NxD passed per bucket."""
    from neuronx_distributed.trace.model_builder import ModelBuilder

    from pipeline.recipe.spec import load_spec

    shape = job.shape
    spec = load_spec(job.checkpoint.directory)
    # A folder of its own inside the work directory, never the work directory itself: ModelBuilder.trace deletes its
    # compiler_workdir first (NxD v2.28.0 trace/model_builder.py:543-545), and the work directory is this process's
    # current directory, where the compiler processes it starts run (they inherit it).
    passed: dict[str, str] = {}

    def record_flags(key, model_artifacts, bucket_rank, flags):
        # What NxD hands the compiler for each bucket, its defaults and --logfile included; called on a compile-cache
        # hit too (v2.28.0 model_builder.py ~720-733: after --logfile is added, before the cache lookup), where
        # neuronx-cc does not run and writes no log to read them from. Returned unchanged.
        passed[f"{key}/_tp0_bk{bucket_rank}"] = flags
        return flags

    loader, workdir = functools.partial(full_checkpoint, job), str(Path(job.workdir) / MODEL_BUILDER_DIR)
    hooked = takes_flag_hook(ModelBuilder)
    if hooked:
        builder = ModelBuilder(router=None, tp_degree=shape.tp_degree, checkpoint_loader=loader,
                               compiler_workdir=workdir, compiler_flag_hook=record_flags)
    else:  # SDK 2.23-2.25: the same flags, read from what add() stored
        builder = ModelBuilder(router=None, tp_degree=shape.tp_degree, checkpoint_loader=loader,
                               compiler_workdir=workdir)
    for key in model_builder_plan(shape):
        builder.add(key, RankInstance(job, key), [entry_inputs(spec, shape, key)],
                    compiler_args=compiler_arg_string(list(job.compiler_args)))
    if not hooked:
        passed.update(stored_flags(builder, workdir))
    traced = builder.trace(initialize_model_weights=True)
    path = Path(job.out_dir) / NXD_MODEL_FILE
    # Record by record (to a file object, torch.jit.save builds the whole archive in memory first: both ranks'
    # weights, 9.4 GB at E4B's bf16), after checking the disk can hold it; the stage strips its debug records once
    # the work files are gone.
    with reporting_full_disk(path, "trace: saving the ModelBuilder model"):
        save_torchscript(traced, path, strip=False, held=nxd_held_tensors(traced))
    return passed


def nxd_held_tensors(traced) -> list[torch.Tensor]:
    """What ModelBuilder's traced model holds outside its parameters (a few MiB), which ``torch.jit.save`` writes into
    ``model.pt``: every rank's weights, ``nxd_model.weights`` (about 9.4 GB at E4B's bf16), and its state (the KV
    caches), ``nxd_model.state``, one ``{name: tensor}`` per rank each (NxD v2.28.0 trace/spmd.py:166-168, filled
    by ``initialize`` and ``initialize_with_saved_weights`` ~170-193, which a trace with
    ``initialize_model_weights=True`` calls)."""
    return [tensor for held in (traced.nxd_model.weights, traced.nxd_model.state)
            for rank in held for tensor in rank.values()]


def stop_with_parent() -> None:
    """If the stage process dies (even by SIGKILL), stop this process and the compiler processes it started: this
    process leads their process group (run_isolated starts it in a new session)."""
    def stop(signum, frame):
        os.killpg(os.getpgrp(), signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    die_with_parent(signal.SIGTERM)


def main(argv: list[str]) -> int:
    from pipeline.core.log import setup
    from pipeline.host.procinfo import peak_rss_bytes

    setup()  # the SDK's own log lines in the pipeline's format, beside the stage's on its standard error
    stop_with_parent()
    started = time.monotonic()
    try:
        job = NeuronJob.read(argv[0])  # a refused job is reported like any failure: in RESULT.json
        if job.compile_cache_dir:
            os.environ["NEURON_COMPILE_CACHE_URL"] = job.compile_cache_dir
        if job.shape.prefill == "host":
            trace_host_prefill(job)
            passed = {}  # parallel_model_trace takes no flag hook: its flags are read from the compiler's log alone
        else:
            passed = trace_device_prefill(job)
        result = CompileResult.succeeded(round(time.monotonic() - started, 3), peak_rss_bytes(), passed)
    except BaseException as exc:  # noqa: BLE001 - reported to the stage process, which raises
        result = CompileResult.failed(exc)
    result.write(argv[1])
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
