"""The one table of backends (``BACKENDS``): each name, the class that builds and loads its ranks, and every fact the
stages, the preflight and the scheduler ask of a backend: the packages and code that decide its rank files' bytes,
the host resources and NeuronCores a shape needs, how many graphs it compiles at once, what its trace request
carries, and the rules its builds follow (Hub releases, throughput floors, how a host's fit is judged).

Nothing outside ``pipeline/backends/`` names a backend; it asks the backend's entry here (tests/test_layers.py holds
that). A new backend is its module, its ``conf/backend/<name>.yaml`` (which makes its name a choice of the schema's
``Backend``) and its entry here (docs/design.md, "How to add a backend"; tests/test_backends.py adds one).

The facts live here, not on the classes in ``cpu.py``, ``neuron.py`` and ``xla.py``: reading this table imports no
backend (the neuron one imports the Neuron SDK, every one torch), and those modules are the build code a version's
inputs digest hashes, so a fact edited there would rename every version they make.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, replace

from pipeline.backends.packages import NEURON_MODULES, XLA_MISSING
from pipeline.config import PipelineConfig, ResourceNeed
from pipeline.core.build_records import WeightBytes
from pipeline.core.shape import BuildShape
from pipeline.core.units import GIB
from pipeline.host.preflight import Factors

# The packages whose versions decide each backend's rank files' bytes (the host's aws-neuronx-* driver and runtime do
# not; nor, for cpu and xla, the Neuron packages an inf2 host also has).
NEURON_BUILD_PACKAGES = ("torch", "neuronx-cc", "torch-neuronx", "neuronx-distributed", "libneuronxla")


# The seed recipe's figures for google/gemma-4-E4B-it at tp_degree 2 are scaled by E4B's own weights, so that E4B's
# needs come out as the seed measured them and any other checkpoint's in proportion to its size: ShardPlan.rank_bytes
# of E4B's config.json at bf16 and tp_degree 2 (one rank; two make all ranks').
E4B_BF16_RANK_GB = 4_728_697_000 / GIB
E4B_BF16_RANKS_GB = 2 * E4B_BF16_RANK_GB

# cpu: each term is what the code holds (pipeline/backends/cpu.py, pipeline/validation/worker.py), at factors measured
# here (torch 2.13, 2 cores, tp_degree 2) on the tiny model (weights ~1 MiB: the fixed parts) and at full size on an
# E4B-shaped checkpoint (make rehearse-e4b, docs/full-size.md: ranks of 4.40 GiB, the largest tensor 0.63 GiB), from
# the figures build.json and validation.json record. Each factor is the measurement rounded up.
CPU_FACTORS = Factors(
    trace_fixed_gb=0.5,  # the trace stage's process: 0.30 GiB for either model
    trace_base_per_byte=0.0,  # it reads the spec only; the ranks read their own weights
    # a rank's trace process with the tiny model's weights: 0.36 GiB here, 0.44 GiB on CI's fresh machine (same
    # versions; the allocator's arenas differ), and 0.69-0.73 GiB under torch 2.8, the production pin (make
    # test-production, tests/test_preflight.py), so the fixed parts carry a fifth more than the largest seen (1.0,
    # a third more, judged E2B's two ranks 1.16x what they used: make rehearse-e2b, docs/full-size.md)
    graph_fixed_gb=0.9,
    # Its weights once: sliced from the checkpoint and assigned to the module (load_state_dict(assign=True)); the
    # trace shares them, and the save writes record by record (pipeline/backends/torchscript.py)
    graph_per_byte=1.0,
    # the rewrite without debug records holds one record at a time: the largest tensor (E4B's head shard)
    graph_largest_copies=1.0,
    # the tracer keeps every intermediate of the traced prefill alive until it ends: E4B's device-prefill rank peaked
    # 0.42 GiB above its host-prefill twin (5.96 against 5.54 GiB at bucket 128), 7.5e-4 of its weights per token
    graph_per_prefill_token=8e-4,
    # the rank's caches, and the tracer keeping the one-hot writes' temporaries over every line alive: the tiny model
    # at 4096 positions, fp32, traced at batch 1, 8 and 32 (caches of 6.0, 48 and 192 MiB a rank) peaked 0.37, 0.55
    # and 1.12 GiB, 4.2-4.6 bytes per byte of the caches added
    graph_per_kv_byte=5.0,
    # the validate stage's process (0.32-0.63 GiB) and the validation process (0.31-0.64 GiB; the most under torch
    # 2.8, and at E4B's 262,144-token tokenizer)
    validate_fixed_gb=1.3,
    load_rank_gb=0.75,  # a rank's load process, beyond its weights: 0.27-0.30 GiB with the tiny model, 0.52 GiB under
    # torch 2.8, 0.65 GiB at E4B's size (5.05 GiB for 4.40 GiB of weights)
    validate_per_byte=1.0,  # torch.jit.load holds each rank's weights once
    # a rank's load process holds its caches (the rank file's zeros, loaded) and a decode step's temporaries over
    # every line (the write, the expanded keys and values): the same builds decoding full batches peaked 0.30, 0.48
    # and 1.27 GiB per rank process, 4.4-5.3 bytes per byte of the caches added
    validate_per_kv_byte=6.0,
    host_prefill_per_byte=1.05,  # HostPrefill holds the decoder once, at the variant's dtype (pipeline/recipe/host.py)
    # 512_bf16 at full size, its prefill graph in fp32 (AVX2-limited): a rank's peak 7.37 GB against 5.43 GB through
    # the bf16 kernels, +1.94 GB over its 0.67 GB vocabulary-head shard (the largest tensor): 2.9 of it
    fp32_route_largest_copies=3.0,
    disk_fixed_gb=0.1,  # records and logs
    # the rank files 1.00x, the archive 0.78x (zstd of random bf16 weights; trained ones compress alike) and the
    # validation's unpacked ranks 1.00x: 2.78x of both ranks' bytes at E4B's size; the trace's rewrite of the rank
    # files (2.00x) comes before the archive. A local publish adds git's copy of the archive once the unpacked
    # ranks are gone (2.56x)
    disk_per_byte=3.0,
)

# neuron: the seed's E4B figures (/work/shared/reference/neuron-and-prior-art.md, "the seed recipe": E4B at
# tp_degree 2 on inf2), over E4B's bf16 bytes. An fp32 variant has twice the bytes and is judged twice as big, which
# errs on the side of refusing. The fixed parts are the cpu backend's processes (the Neuron packages' own imports were
# not measured); the host's prefill model is the same code on the host as on cpu.
NEURON_FACTORS = Factors(
    trace_fixed_gb=CPU_FACTORS.trace_fixed_gb,
    # Both ranks compiling at once peaked past 128 GiB of RAM and needed a 55 GiB swap file: ~180 GiB, split as E4B's
    # conf declared it, 20 GiB for the compile driver and 80 GiB per rank compiled at once (100 GiB one at a time).
    trace_base_per_byte=(20 - CPU_FACTORS.trace_fixed_gb) / E4B_BF16_RANKS_GB,
    graph_fixed_gb=CPU_FACTORS.graph_fixed_gb,
    graph_per_byte=(80 - CPU_FACTORS.graph_fixed_gb) / E4B_BF16_RANK_GB,
    graph_largest_copies=0.0,  # in the seed's figure
    graph_per_prefill_token=0.0,
    graph_per_kv_byte=CPU_FACTORS.graph_per_kv_byte,  # the module is traced on the host as the cpu backend's is
    # (UNVERIFIED: the compile's own use of a batch's caches has not been measured)
    # Loading a build on an inf2.xlarge peaks at ~14.5 GB (so 16 GiB RAM + a 16 GiB swap file): 15 GiB. The ranks
    # are threads of the validation process: no process per rank.
    validate_fixed_gb=CPU_FACTORS.validate_fixed_gb,
    load_rank_gb=0.0,
    validate_per_byte=(15 - CPU_FACTORS.validate_fixed_gb) / E4B_BF16_RANKS_GB,
    # the caches live on the NeuronCores; the host holds one rank's copy while seeding a host prefill's line
    # (pipeline/backends/neuron.py write_states: a state read back whole, changed in one line, written whole)
    validate_per_kv_byte=1.0,
    host_prefill_per_byte=CPU_FACTORS.host_prefill_per_byte,
    # 120 GiB for E4B as its conf declared it (compiler work files, rank files, archive; not measured by the seed).
    disk_fixed_gb=CPU_FACTORS.disk_fixed_gb,
    disk_per_byte=(120 - CPU_FACTORS.disk_fixed_gb) / E4B_BF16_RANKS_GB,
)

# xla: the cpu backend's figures, plus torch-xla's runtime in the one process that lowers the ranks (one after the
# other) and a second copy of a rank's weights on the XLA device (its CPU client holds its own buffers). Measured on
# the tiny model only, from build.json and validation.json: the trace's rank process 1.02 GiB, the validation's rank
# process 1.00 GiB (torch 2.8 and torch-xla imported), a third added; the per-byte factors are the cpu backend's plus
# one copy, not measured.
XLA_FIXED_GB = 1.4
XLA_FACTORS = replace(CPU_FACTORS, graph_fixed_gb=XLA_FIXED_GB, graph_per_byte=CPU_FACTORS.graph_per_byte + 1.0,
                      load_rank_gb=XLA_FIXED_GB, validate_per_byte=CPU_FACTORS.validate_per_byte + 1.0,
                      fp32_route_largest_copies=0.0)  # its ranks compile on torch-xla, never rewritten



# The code that makes each backend's rank files, as paths under pipeline/ (files or folders): a version's inputs digest
# hashes it (stages/trace.py), so only an edit here can make other bytes; xla also checks a loaded rank against it (its
# rank files hold weights, not code). The shape, the recipe, the backend's own modules and what it shares with another
# (``aliased_rank.py``, the graphs a Neuron compile is handed). Not the rank runtime (``ranks.py``): it carries jobs and
# tensors between processes and decides no byte, so a fix there renames nothing.
COMMON_BUILD_CODE = ("core/shape.py", "recipe", "backends/base.py")


@dataclass(frozen=True)
class BackendEntry:
    """A backend's facts; the defaults are the cpu backend's (every rank traced at once, in processes, on the host)."""

    name: str
    implementation: str
    """``module:Class`` of its ``Backend`` (pipeline/backends/base.py), imported only when it is used."""
    build_packages: tuple[str, ...]
    """What a version's inputs digest records of the toolchain."""
    build_code: tuple[str, ...]
    """The code that makes its rank files (``COMMON_BUILD_CODE`` and its own), which the inputs digest hashes."""
    factors: Factors
    """The preflight's measured factors (pipeline/host/preflight.py): what its processes take per byte of weights."""
    on_neuron_cores: bool = False
    """Traces and validates on NeuronCores (``tp_degree`` of them, ``backend.visible_cores``), leased per process."""
    neuronx_cc: bool = False
    """Compiles with neuronx-cc: takes ``backend.compiler_args``, ``compiler_workdir``, ``compile_cache_dir`` and the
    environment that changes the compiler's output."""
    hub_releases: bool = False
    """Its builds of a Hub checkpoint are releases; any other backend's reach the Hub only as demo builds
    (``publish.allow_demo``): they are not compiled for Inferentia."""
    needs_throughput_floor: bool = False
    """Validated against ``validate.throughput.floors.<name>.<hardware>`` or not at all: a release ships measured."""
    fits_by_neuron_release: bool = False
    """A host runs its builds when it has their Neuron SDK release (pipeline/backends/compatibility.py); any other
    backend's, when it has their torch minor version."""
    timings_compare: bool = False
    """Its timings are steady enough to compare across builds: the regression gate compares them (unless
    ``publish.regression.throughput_backends`` names others), and ``schedule`` validates its builds with nothing else
    running."""

    def package_problem(self) -> str | None:
        """Why it cannot run in this environment for want of its packages (None when it can), told from the import
        system alone: the toolchain stage asks it on every run (every `dvc repro`), so it must stay cheap."""
        return None

    def create(self):
        module, _, cls = self.implementation.partition(":")
        return getattr(importlib.import_module(module), cls)()

    # -- what a shape needs of the host ------------------------------------------------------------------------------

    def neuron_cores(self, shape: BuildShape) -> int:
        """NeuronCores its trace and its validation hold."""
        return shape.tp_degree if self.on_neuron_cores else 0

    def graphs_at_once(self, shape: BuildShape, max_parallel: int, resources: ResourceNeed) -> tuple[int, str]:
        """Graphs traced at once, and another way out of a memory shortfall ('' when none)."""
        return shape.tp_degree, ""

    def build_group(self, shape: BuildShape) -> str | None:
        """The scheduler's exclusive group for its build task (pipeline/cli/schedule.py Task.exclusive)."""
        return None

    def quiet_validate(self) -> bool:
        """``schedule --quiet-validate``'s default: whether its throughput figures are compared across builds."""
        return self.timings_compare

    def lease_cores(self, shape: BuildShape, visible_cores: str | None, what: str, host_cores: int | None):
        """The NeuronCores a validation process gets, held until it ends (None: it needs none)."""
        return None

    # -- what its trace request carries ------------------------------------------------------------------------------

    def compiler_args(self, cfg: PipelineConfig) -> list[str]:
        return list(cfg.backend.compiler_args.get(cfg.variant.dtype, [])) if self.neuronx_cc else []

    def compiler_env(self) -> dict:
        """Environment that changes what neuronx-cc produces (optimum-neuron#457: NEURON_CC_FLAGS changes the code)."""
        return {"NEURON_CC_FLAGS": os.environ.get("NEURON_CC_FLAGS")} if self.neuronx_cc else {}

    def work_folder_bytes(self, shape: BuildShape, weights: WeightBytes) -> int | None:
        """Bytes its trace writes in the compiler's work folder beyond ``resources.disk_gb`` (None: it writes none
        there)."""
        return None


@dataclass(frozen=True)
class NeuronEntry(BackendEntry):
    def package_problem(self) -> str | None:
        missing = [m for m in NEURON_MODULES if importlib.util.find_spec(m) is None]
        if not missing:
            return None
        from pipeline.backends.neuron_sdk import INSTALL, PINNED

        return f"backend=neuron needs the Python package {missing[0]!r}: install it on an inf2 host: " + \
            INSTALL.format(release=PINNED)

    def graphs_at_once(self, shape: BuildShape, max_parallel: int, resources: ResourceNeed) -> tuple[int, str]:
        """Device prefill: ModelBuilder compiles one SPMD graph per entry point (prefill, decode), concurrently,
        whatever ``max_parallel`` says. Host prefill: ``parallel_model_trace`` compiles ``max_parallel`` ranks at once
        (all when 0)."""
        if shape.prefill == "device":
            return len(shape.entries), ""
        graphs = min(shape.tp_degree, max_parallel) if max_parallel else shape.tp_degree
        one = resources.trace_base_gb + resources.trace_per_graph_gb
        return graphs, (f"or compile one rank at a time with backend.max_parallel=1 (needs {one:.0f} GiB)"
                        if graphs > 1 else "")

    def build_group(self, shape: BuildShape) -> str | None:
        # parallel_model_trace always rendezvous on port 2022 (pipeline/backends/neuron_cores.py): one at a time.
        return "trace-port" if shape.prefill == "host" else None

    def lease_cores(self, shape: BuildShape, visible_cores: str | None, what: str, host_cores: int | None):
        from pipeline.backends.neuron import core_lease

        return core_lease(shape.tp_degree, visible_cores, what, host_cores)

    def work_folder_bytes(self, shape: BuildShape, weights: WeightBytes) -> int | None:
        # ModelBuilder writes every rank's slice of the weights into its work folder before loading them back
        # (tp{rank}_sharded_checkpoint.safetensors: NxD v2.28.0 trace/model_builder.py:764-773, 984): all ranks'
        # bytes again, on the work folder's file system, beside its compiler files.
        return weights.ranks if shape.prefill == "device" else None


@dataclass(frozen=True)
class XlaEntry(BackendEntry):
    def package_problem(self) -> str | None:
        return XLA_MISSING if importlib.util.find_spec("torch_xla") is None else None

    def graphs_at_once(self, shape: BuildShape, max_parallel: int, resources: ResourceNeed) -> tuple[int, str]:
        return 1, ""  # one process lowers the ranks one after the other


BACKENDS: dict[str, BackendEntry] = {entry.name: entry for entry in (
    BackendEntry("cpu", "pipeline.backends.cpu:CpuBackend", ("torch",),
                 (*COMMON_BUILD_CODE, "backends/torchscript.py", "backends/cpu.py"), CPU_FACTORS),
    NeuronEntry("neuron", "pipeline.backends.neuron:NeuronBackend", NEURON_BUILD_PACKAGES,
                (*COMMON_BUILD_CODE, "backends/torchscript.py", "backends/aliased_rank.py", "backends/neuron.py",
                 "backends/neuron_job.py", "backends/neuron_rank.py"), NEURON_FACTORS,
                on_neuron_cores=True, neuronx_cc=True, hub_releases=True, needs_throughput_floor=True,
                fits_by_neuron_release=True, timings_compare=True),
    XlaEntry("xla", "pipeline.backends.xla:XlaBackend", ("torch", "torch-xla"),
             (*COMMON_BUILD_CODE, "backends/aliased_rank.py", "backends/hlo.py", "backends/neuronx_cc_xla_operators.py",
              "backends/xla.py", "backends/xla_rank.py"), XLA_FACTORS),
)}


def backend_entry(name: str) -> BackendEntry:
    try:
        return BACKENDS[name]
    except KeyError:
        known = ", ".join(BACKENDS)
        raise ValueError(f"unknown backend {name!r} (pipeline/backends/registry.py has {known})") from None
