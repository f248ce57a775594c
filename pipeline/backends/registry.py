"""The one table of backends (``BACKENDS``): each name, the class that builds and loads its ranks, and every fact the
stages, the preflight and the scheduler ask of a backend: the packages and code that decide its rank files' bytes,
the host resources and NeuronCores a shape needs, how many graphs it compiles at once, what its trace request
carries, whether its builds are compiled for Inferentia.

Nothing outside ``pipeline/backends/`` compares a backend's name; it asks the backend's entry here
(tests/test_layers.py holds that). A new backend adds one entry (docs/design.md, "How to add a backend").

The facts live here, not on the classes in ``cpu.py``, ``neuron.py`` and ``xla.py``: reading this table imports no
backend (the neuron one imports the Neuron SDK, every one torch), and those modules are the build code a version's
inputs digest hashes (``build_code.py``), so a fact edited there would rename every version they make.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from pipeline.backends.build_code import BUILD_CODE
from pipeline.config import PipelineConfig, ResourceNeed
from pipeline.core.shape import BuildShape
from pipeline.host import preflight
from pipeline.host.preflight import Factors

# The packages whose versions decide each backend's rank files' bytes (the host's aws-neuronx-* driver and runtime do
# not; nor, for cpu and xla, the Neuron packages an inf2 host also has).
NEURON_BUILD_PACKAGES = ("torch", "neuronx-cc", "torch-neuronx", "neuronx-distributed", "libneuronxla")


@dataclass(frozen=True)
class BackendEntry:
    """A backend's facts; the defaults are the cpu backend's (every rank traced at once, in processes, on the host)."""

    name: str
    implementation: str
    """``module:Class`` of its ``Backend`` (pipeline/backends/base.py), imported only when it is used."""
    build_packages: tuple[str, ...]
    """What a version's inputs digest records of the toolchain."""
    factors: Factors
    """The preflight's measured factors (pipeline/host/preflight.py): what its processes take per byte of weights."""
    on_neuron_cores: bool = False
    """Traces and validates on NeuronCores (``tp_degree`` of them, ``backend.visible_cores``), leased per process."""
    neuronx_cc: bool = False
    """Compiles with neuronx-cc: takes ``backend.compiler_args``, ``compiler_workdir``, ``compile_cache_dir`` and the
    environment that changes the compiler's output."""
    for_inferentia: bool = False
    """Its builds are compiled for Inferentia: others reach the Hub only as demo builds (``publish.allow_demo``), and
    its validation needs a throughput floor for the hardware."""

    @property
    def build_code(self) -> tuple[str, ...]:
        """The code that makes its rank files (pipeline/backends/build_code.py), which the inputs digest hashes."""
        return BUILD_CODE[self.name]

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
        return self.for_inferentia

    def lease_cores(self, shape: BuildShape, visible_cores: str | None, what: str, host_cores: int | None):
        """The NeuronCores a validation process gets, held until it ends (None: it needs none)."""
        return None

    # -- what its trace request carries ------------------------------------------------------------------------------

    def compiler_args(self, cfg: PipelineConfig) -> list[str]:
        return list(cfg.backend.compiler_args.get(cfg.variant.dtype, [])) if self.neuronx_cc else []

    def compiler_env(self) -> dict:
        """Environment that changes what neuronx-cc produces (optimum-neuron#457: NEURON_CC_FLAGS changes the code)."""
        return {"NEURON_CC_FLAGS": os.environ.get("NEURON_CC_FLAGS")} if self.neuronx_cc else {}

    def work_folder_bytes(self, shape: BuildShape, weights: preflight.WeightBytes) -> int | None:
        """Bytes its trace writes in the compiler's work folder beyond ``resources.disk_gb`` (None: it writes none
        there)."""
        return None


@dataclass(frozen=True)
class NeuronEntry(BackendEntry):
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

    def work_folder_bytes(self, shape: BuildShape, weights: preflight.WeightBytes) -> int | None:
        # ModelBuilder writes every rank's slice of the weights into its work folder before loading them back
        # (tp{rank}_sharded_checkpoint.safetensors: NxD v2.28.0 trace/model_builder.py:764-773, 984): all ranks'
        # bytes again, on the work folder's file system, beside its compiler files.
        return weights.ranks if shape.prefill == "device" else None


@dataclass(frozen=True)
class XlaEntry(BackendEntry):
    def graphs_at_once(self, shape: BuildShape, max_parallel: int, resources: ResourceNeed) -> tuple[int, str]:
        return 1, ""  # one process lowers the ranks one after the other


BACKENDS: dict[str, BackendEntry] = {entry.name: entry for entry in (
    BackendEntry("cpu", "pipeline.backends.cpu:CpuBackend", ("torch",), preflight.CPU),
    NeuronEntry("neuron", "pipeline.backends.neuron:NeuronBackend", NEURON_BUILD_PACKAGES, preflight.NEURON,
                on_neuron_cores=True, neuronx_cc=True, for_inferentia=True),
    XlaEntry("xla", "pipeline.backends.xla:XlaBackend", ("torch", "torch-xla"), preflight.XLA),
)}


def backend_entry(name: str) -> BackendEntry:
    try:
        return BACKENDS[name]
    except KeyError:
        known = ", ".join(BACKENDS)
        raise ValueError(f"unknown backend {name!r} (pipeline/backends/registry.py has {known})") from None
