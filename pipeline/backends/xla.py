"""The xla backend: the recipe lowered by torch-xla, the front end torch-neuronx compiles from, on its CPU device.

What it builds is what the Neuron compiler would be handed: for each rank, each entry point's HLO module, recorded in
build.json (hash, opcode histogram, parameter and output shapes) so two builds can be compared by what the compiler
would see, and checked (operators the compiler lists; with one rank: no compile after warm-up, no host fallback, KV
caches updated in place). With one rank the build also runs, so ``validate`` checks its numerics token for token like
any other backend's. Two ranks are lowered with their collectives and not run (``xla_rank.TP_LIMIT``).

Needs torch-xla, which pins its own torch (2.8, as torch-neuronx does): the ``[xla]`` extra, installed by
``make test-xla`` into the production-version environment. The work runs in one child process
(``pipeline/backends/xla_rank.py``). Writes ``<out_dir>/tp_<rank>.pt`` for every rank, and nothing else.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import time
from pathlib import Path

import torch

from pipeline.artifact.archive import VerifiedBuild, require_verified
from pipeline.backends.aliased_rank import shape_problems
from pipeline.backends.base import TraceRequest, check_request
from pipeline.backends.packages import XLA_EXTRA, XLA_MAKE_TARGET, XLA_MISSING
from pipeline.backends.ranks import ProcessRunner, trace_in_processes, trace_result
from pipeline.core.build_records import ToolchainRecord, TraceResult
from pipeline.core.errors import ConfigError
from pipeline.core.shape import BuildShape, rank_members

EXTRA, MAKE_TARGET = XLA_EXTRA, XLA_MAKE_TARGET


def torch_xla_version() -> str | None:
    if importlib.util.find_spec("torch_xla") is None:
        return None
    return importlib.metadata.version("torch-xla")


def require_torch_xla() -> str:
    version = torch_xla_version()
    if version is None:
        raise ConfigError(XLA_MISSING)
    return version


class XlaBackend:
    name = "xla"

    def members(self, shape: BuildShape) -> list[str]:
        return rank_members(shape.tp_degree)

    def compiler_id(self, toolchain: ToolchainRecord) -> str:
        version = toolchain.version("torch-xla")
        if not version:
            raise ConfigError("artifacts/toolchain.json records no torch-xla: run stage=toolchain with backend=xla "
                              f"in an environment with the [{EXTRA}] extra")
        return "xla-torch_xla" + version.split("+")[0]

    def check_installed(self, request: TraceRequest | None = None) -> None:
        require_torch_xla()

    def check(self, request: TraceRequest) -> None:
        """Every refusal that needs no lowering, before anything is written: the package, the variant (the neuron
        backend's rules too: these are its graphs), the checkpoint."""
        require_torch_xla()
        problems = shape_problems(request.shape)
        if problems:
            raise ConfigError(problems)
        check_request(request)

    def compiler_info(self) -> dict:
        return {"compiler": "torch_xla (HLO for neuronx-cc)", "torch": torch.__version__,
                "torch_xla": torch_xla_version(), "python": platform.python_version()}

    def trace(self, request: TraceRequest, out_dir: Path) -> TraceResult:
        from pipeline.backends import xla_rank

        self.check(request)
        started = time.monotonic()
        ranks = trace_in_processes(1, request, Path(out_dir), self.members(request.shape), target=xla_rank.main)
        return trace_result(ranks, request.shape, started, self.compiler_info())

    def check_load(self, shape: BuildShape) -> None:
        if shape.tp_degree != 1:
            from pipeline.backends.xla_rank import TP_LIMIT

            raise ConfigError(f"backend=xla runs builds of tp_degree 1 only (this one has variant.tp_degree="
                              f"{shape.tp_degree}): {TP_LIMIT}. Its graphs were lowered and checked by the trace "
                              "stage (build.json); validate the same variant at variant.tp_degree=1 on backend=xla, "
                              "or at tp_degree 2 on backend=cpu")
        require_torch_xla()

    def load(self, build: VerifiedBuild, shape: BuildShape) -> ProcessRunner:
        """One rank on the XLA device, in a child process the rank runtime drives (pipeline/backends/ranks.py)."""
        from pipeline.backends import xla_rank

        self.check_load(shape)
        return ProcessRunner(require_verified(build), shape, target=xla_rank.main)
