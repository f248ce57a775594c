"""Preflight: does this host have the memory, swap, disk and NeuronCores a stage needs? Checked before the work.

``measure()`` reads the host (``/proc/meminfo``, the cgroup's memory limits along its hierarchy, free disk at each
path that will be written, ``neuron-ls --json-output``); ``estimate()`` derives what a variant needs from its
checkpoint's own spec: the bytes of one rank's weights at the variant's dtype (and of the host's prefill model), times
factors measured per backend (its entry in pipeline/backends/registry.py holds them), with
``model.resources.<backend>.<key>`` overriding any figure;
``decide()`` compares the two and returns every shortfall with the exact numbers and the commands that fix it. All
are plain functions of their inputs, so every decision is tested with injected figures.

Memory counts RAM and swap together (a compile that spills to swap is slow but finishes; one killed by the
out-of-memory killer is lost), bounded by the cgroup limit when the process runs in a container. Swap is created only
when asked (``preflight.make_swap=64G``): that needs root, and a swap file on the wrong disk can hurt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pipeline.config import ResourceNeed
from pipeline.core.build_records import EstimateFigures, HostFigures, NeedFigures, WeightBytes
from pipeline.core.errors import PreflightError
from pipeline.core.units import GIB, parse_size

if TYPE_CHECKING:
    from pipeline.config import PreflightConfig
    from pipeline.core.shape import BuildShape
    from pipeline.recipe.spec import ModelSpec

SWAP_MARGIN_GIB = 4  # suggested swap beyond the exact shortfall: page cache and the OS need room too


@dataclass
class Disk:
    device: int  # st_dev: paths on one file system share its free space
    free: int


@dataclass
class Resources:
    """What the host offers, in bytes (None when unknown)."""

    mem_available: int
    swap_free: int
    swap_total: int
    cgroup_limit: int | None = None  # memory.max of the tightest enclosing cgroup
    cgroup_usage: int | None = None
    cgroup_swap_limit: int | None = None  # memory.swap.max; 0 means this cgroup cannot swap
    disks: dict[str, Disk] = field(default_factory=dict)  # path that will be written -> its file system
    neuron_cores: int | None = None  # None: neuron-ls absent
    neuron_cores_busy: int = 0

    @property
    def usable_swap(self) -> int:
        if self.cgroup_swap_limit == 0:
            return 0
        return min(self.swap_free, self.cgroup_swap_limit) if self.cgroup_swap_limit else self.swap_free

    @property
    def usable_memory(self) -> int:
        """RAM plus swap this process can actually use: the host's, capped by the cgroup's limit."""
        ram = self.mem_available
        if self.cgroup_limit is not None:
            ram = min(ram, max(0, self.cgroup_limit - (self.cgroup_usage or 0)))
        return ram + self.usable_swap

    @property
    def cgroup_binds(self) -> bool:
        return self.cgroup_limit is not None and self.cgroup_limit - (self.cgroup_usage or 0) < self.mem_available

    def summary(self) -> str:
        parts = [f"available RAM {self.mem_available / GIB:.1f} GiB", f"free swap {self.swap_free / GIB:.1f} GiB"]
        if self.cgroup_limit is not None:
            parts.append(f"cgroup limit {self.cgroup_limit / GIB:.1f} GiB (using {(self.cgroup_usage or 0) / GIB:.1f})")
        if self.cgroup_swap_limit is not None:
            parts.append(f"cgroup swap limit {self.cgroup_swap_limit / GIB:.1f} GiB")
        return ", ".join(parts)

    def figures(self) -> HostFigures:
        """The figures, as the records keep them."""
        return HostFigures(round(self.mem_available / GIB, 2), round(self.swap_free / GIB, 2),
                           None if self.cgroup_limit is None else round(self.cgroup_limit / GIB, 2),
                           round(self.usable_memory / GIB, 2),
                           {p: round(d.free / GIB, 2) for p, d in sorted(self.disks.items())},
                           self.neuron_cores, self.neuron_cores_busy)


@dataclass
class Need:
    """What a stage needs, in bytes."""

    memory: int
    disk: dict[str, int] = field(default_factory=dict)  # path -> bytes written there
    neuron_cores: int = 0
    what: str = "this stage"
    memory_hint: str = ""  # another way out of a memory shortfall, e.g. compiling fewer ranks at once

    def figures(self) -> NeedFigures:
        return NeedFigures(round(self.memory / GIB, 2), self.neuron_cores,
                           {p: round(b / GIB, 2) for p, b in sorted(self.disk.items())})


# -- reading the host ------------------------------------------------------------------------------------------------

def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes per field."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name.strip()] = int(fields[0]) * (1024 if len(fields) > 1 and fields[1] == "kB" else 1)
    return out


def _read_limit(path: Path) -> int | None:
    try:
        value = path.read_text().strip()
    except OSError:
        return None
    if value in ("max", "") or not value.isdigit():
        return None
    limit = int(value)
    return None if limit >= 1 << 60 else limit  # cgroup v1 writes a huge number for "no limit"


def cgroup_memory(proc_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> tuple[int | None, int | None, int | None]:
    """(limit, usage, swap limit) of the tightest cgroup on this process's path (v2, else v1)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":  # cgroup v2 unified hierarchy
            path = root / parts[2].lstrip("/")
            limits, swaps = [], []
            for p in [path, *path.parents]:
                if not str(p).startswith(str(root)):
                    break
                if (lim := _read_limit(p / "memory.max")) is not None:
                    limits.append(lim)
                if (swp := _read_limit(p / "memory.swap.max")) is not None:
                    swaps.append(swp)
            usage = _read_limit(path / "memory.current")
            return (min(limits) if limits else None), usage, (min(swaps) if swaps else None)
        if len(parts) == 3 and "memory" in parts[1].split(","):  # cgroup v1
            path = root / "memory" / parts[2].lstrip("/")
            return (_read_limit(path / "memory.limit_in_bytes"), _read_limit(path / "memory.usage_in_bytes"), None)
    return None, None, None


def parse_neuron_ls(text: str) -> tuple[int, int]:
    """(NeuronCores, NeuronCores of devices another process holds) from ``neuron-ls --json-output``."""
    devices = json.loads(text)
    total = busy = 0
    for device in devices:
        cores = int(device.get("nc_count", len(device.get("neuroncore_ids", []))))
        total += cores
        processes = device.get("neuron_processes") or []
        if any(not str(p.get("command", "")).startswith("neuron-ls") for p in processes):
            busy += cores
    return total, busy


def neuron_cores() -> tuple[int | None, int]:
    exe = shutil.which("neuron-ls")
    if exe is None:
        return None, 0
    try:
        out = subprocess.run([exe, "--json-output"], capture_output=True, text=True, timeout=60, check=True).stdout
        return parse_neuron_ls(out)
    except (subprocess.SubprocessError, ValueError, OSError):
        return None, 0


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def measure(paths: list[Path], with_neuron: bool = False) -> Resources:
    info = parse_meminfo(Path("/proc/meminfo").read_text())
    try:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        proc_cgroup = ""
    limit, usage, swap_limit = cgroup_memory(proc_cgroup)
    cores, busy = neuron_cores() if with_neuron else (None, 0)
    return Resources(
        mem_available=info.get("MemAvailable", info.get("MemFree", 0)),
        swap_free=info.get("SwapFree", 0),
        swap_total=info.get("SwapTotal", 0),
        cgroup_limit=limit, cgroup_usage=usage, cgroup_swap_limit=swap_limit,
        disks={str(p): Disk(os.stat(_existing_parent(p)).st_dev, shutil.disk_usage(_existing_parent(p)).free)
               for p in paths},
        neuron_cores=cores, neuron_cores_busy=busy,
    )


DMI_PRODUCT_NAME = Path("/sys/class/dmi/id/product_name")
DMI_OVERRIDE_ENV = "GEMMA4_DMI_PRODUCT_NAME_FILE"  # tests point it at a file standing in for an instance's


def instance_type() -> str | None:
    """The EC2 instance type, as the DMI product name states it on Nitro instances (``inf2.8xlarge``), read offline;
    None elsewhere."""
    path = Path(os.environ.get(DMI_OVERRIDE_ENV) or DMI_PRODUCT_NAME)
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text if re.fullmatch(r"[a-z][a-z0-9-]*\.[a-z0-9-]+", text) else None


def resolve_hardware(name: str) -> str:
    """``hardware=auto`` becomes the detected instance type in conf/hardware's spelling (``inf2_8xlarge``), else
    ``local``; any other name stays as given."""
    if name != "auto":
        return name
    detected = instance_type()
    return detected.replace(".", "_").replace("-", "_") if detected else "local"


# -- deciding ---------------------------------------------------------------------------------------------------------

def swap_commands(size_gib: int, swap_file: str) -> str:
    return (f"sudo fallocate -l {size_gib}G {swap_file} && sudo chmod 600 {swap_file} && sudo mkswap {swap_file} && "
            f"sudo swapon {swap_file}   (or rerun with preflight.make_swap={size_gib}G)")


def decide(need: Need, res: Resources, swap_file: str = "/swapfile") -> list[str]:
    """Every shortfall of ``res`` against ``need``, each with its numbers and its fix."""
    problems = []
    if need.memory > res.usable_memory:
        short = need.memory - res.usable_memory
        msg = (f"{need.what} needs {need.memory / GIB:.1f} GiB of RAM + swap; this host offers "
               f"{res.usable_memory / GIB:.1f} GiB ({res.summary()}), {short / GIB:.1f} GiB short")
        if res.cgroup_binds:
            msg += ": the container's memory limit is the binding one; raise it (e.g. docker run --memory)"
        elif res.cgroup_swap_limit == 0:
            msg += ": this cgroup may not swap (memory.swap.max is 0); raise its limits or run outside it"
        else:
            msg += f". Add swap: {swap_commands(-(-short // GIB) + SWAP_MARGIN_GIB, swap_file)}"
        problems.append(msg + (f"; {need.memory_hint}" if need.memory_hint else ""))
    by_device: dict[int, list[str]] = {}
    for path in need.disk:
        if path in res.disks:
            by_device.setdefault(res.disks[path].device, []).append(path)
    for paths in by_device.values():
        size = max(need.disk[p] for p in paths)
        free = res.disks[paths[0]].free
        if size > free:
            problems.append(f"{need.what} writes up to {size / GIB:.1f} GiB under {', '.join(sorted(paths))}, whose "
                            f"file system has {free / GIB:.1f} GiB free: free space there, or move the outputs "
                            "(artifacts_dir=..., backend.compiler_workdir=...)")
    if need.neuron_cores:
        if res.neuron_cores is None:
            problems.append(f"{need.what} needs {need.neuron_cores} NeuronCores but neuron-ls is not available: run on "
                            "an inf2 host with the Neuron driver and tools (aws-neuronx-dkms, aws-neuronx-tools)")
        elif res.neuron_cores - res.neuron_cores_busy < need.neuron_cores:
            problems.append(f"{need.what} needs {need.neuron_cores} free NeuronCores; this host has "
                            f"{res.neuron_cores}, {res.neuron_cores_busy} of them held by other processes "
                            "(neuron-ls lists them): stop those, or use an instance with more NeuronCores")
    return problems


def make_swap(size: int, swap_file: str, runner=subprocess.run, is_root: bool | None = None) -> None:
    """Create and enable a swap file (root only). Refuses to touch an existing file."""
    if not (os.geteuid() == 0 if is_root is None else is_root):
        raise PreflightError(f"preflight.make_swap needs root to create {swap_file}: run as root, or add swap "
                             f"yourself: {swap_commands(max(1, size // GIB), swap_file)}")
    if Path(swap_file).exists():
        raise PreflightError(f"preflight.swap_file={swap_file} already exists: choose another path, or enable it "
                             f"with: sudo swapon {swap_file}")
    for cmd in (["fallocate", "-l", str(size), swap_file], ["chmod", "600", swap_file], ["mkswap", swap_file],
                ["swapon", swap_file]):
        proc = runner(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise PreflightError(f"preflight.make_swap: {' '.join(cmd)} failed: {(proc.stderr or '').strip()} "
                                 f"({swap_file} may need removing)")


# -- what a variant needs, from its checkpoint --------------------------------------------------------------------

def weight_bytes(spec: ModelSpec, shape: BuildShape) -> WeightBytes:
    import torch

    from pipeline.recipe.plan import ShardPlan

    plan = ShardPlan(spec, shape.tp_degree)
    return WeightBytes(plan.rank_bytes(shape.torch_dtype), shape.tp_degree,
                       plan.largest_tensor_bytes(shape.torch_dtype),
                       decoder_bytes(spec, shape.torch_dtype), decoder_bytes(spec, torch.float32),
                       plan.rank_kv_bytes(shape.kv_max, shape.batch_size - 1, shape.torch_dtype))


def decoder_bytes(spec: ModelSpec, dtype) -> int:
    """The whole decoder as one rank at ``dtype`` (the host's prefill model; in fp32, the float reference's)."""
    from pipeline.recipe.plan import ShardPlan

    return ShardPlan(spec, 1).rank_bytes(dtype)


@dataclass(frozen=True)
class Factors:
    """How one backend's needs grow with the weights: GiB any model costs, plus multiples of the weights' bytes."""

    trace_fixed_gb: float
    """The stage process (and on neuron the compile driver), whatever the model."""
    trace_base_per_byte: float
    """... plus this many bytes per byte of all ranks' weights."""
    graph_fixed_gb: float
    """Each graph compiled at once: its process's interpreter and imports."""
    graph_per_byte: float
    """... plus this many bytes per byte of one rank's weights."""
    graph_largest_copies: float
    """... plus this many copies of its largest tensor (the cpu backend's rewrite of the rank file)."""
    graph_per_prefill_token: float
    """... plus this many bytes per byte of its weights for each token of a traced prefill bucket."""
    graph_per_kv_byte: float
    """... plus this many bytes per byte of its KV caches beyond a batch-1 build's (``WeightBytes.batch_kv``)."""
    validate_fixed_gb: float
    """The stage and validation processes, whatever the model."""
    load_rank_gb: float
    """Each rank loaded for validation, whatever the model (a process of its own on cpu; threads on neuron)."""
    validate_per_byte: float
    """... plus this many bytes per byte of all ranks' weights."""
    validate_per_kv_byte: float
    """... plus this many bytes per byte of all ranks' KV caches beyond a batch-1 build's: the caches and a decode
    step's temporaries over them, where the ranks run on the host."""
    host_prefill_per_byte: float
    """The host's prefill model of a host-prefill variant, per byte of its weights (at the variant's dtype)."""
    disk_fixed_gb: float
    disk_per_byte: float
    """Written per variant, per byte of all ranks' weights: the rank files, the archive (and compiler work files)."""
    fp32_route_largest_copies: float = 0.0
    """Validating a bf16 build where its rank graphs run bf16 matmuls in fp32 (pipeline/host/bf16_matmul.py, a CPU
    without bf16 instructions): each rank's extra, in bytes of its largest tensor (the weight widened for one
    matmul, its output, what the allocator keeps). 0 where the ranks do not run on this host."""


class BackendNeeds(Protocol):
    """What the preflight asks of a backend; its entry in pipeline/backends/registry.py answers."""

    name: str
    factors: Factors

    def neuron_cores(self, shape: BuildShape) -> int: ...

    def graphs_at_once(self, shape: BuildShape, max_parallel: int, resources: ResourceNeed) -> tuple[int, str]: ...


def derive(weights: WeightBytes, f: Factors, prefill_tokens: int = 0, fp32_route: bool = False) -> ResourceNeed:
    """Every figure of ``ResourceNeed`` from the weights' bytes and a backend's factors (``prefill_tokens``: the
    bucket of a traced prefill graph, 0 for host prefill; ``fp32_route``: the ranks' bf16 matmuls of many rows run in
    fp32 on this host)."""
    rank, ranks, host = weights.rank / GIB, weights.ranks / GIB, weights.host_prefill / GIB
    kv = weights.batch_kv / GIB
    return ResourceNeed(
        trace_base_gb=f.trace_fixed_gb + f.trace_base_per_byte * ranks,
        trace_per_graph_gb=(f.graph_fixed_gb + f.graph_per_byte * rank + f.graph_largest_copies * weights.largest / GIB
                            + f.graph_per_prefill_token * prefill_tokens * rank + f.graph_per_kv_byte * kv),
        validate_gb=(f.validate_fixed_gb + weights.tp_degree * f.load_rank_gb + f.validate_per_byte * ranks
                     + f.validate_per_kv_byte * weights.tp_degree * kv
                     + fp32_route * weights.tp_degree * f.fp32_route_largest_copies * weights.largest / GIB),
        host_prefill_gb=f.host_prefill_per_byte * host,
        disk_gb=f.disk_fixed_gb + f.disk_per_byte * (ranks + weights.tp_degree * kv),  # rank files hold the caches
    )


@dataclass(frozen=True)
class Estimate:
    """What a variant needs on one backend: derived from its weights, with the configured overrides applied."""

    resources: ResourceNeed
    weights: WeightBytes
    overridden: tuple[str, ...]  # the ResourceNeed keys model.resources.<backend> set
    backend: str

    def describe(self) -> str:
        """The basis of the figures, for the preflight's messages."""
        text = f"{self.weights.tp_degree} rank(s) of {self.weights.rank / GIB:.2f} GiB of weights"
        return text + "".join(f"; model.resources.{self.backend}.{key} is set" for key in self.overridden)

    def figures(self) -> EstimateFigures:
        """For build.json: with each trace's measured peaks, what the factors can be derived again from."""
        return EstimateFigures(self.weights, {k: round(v, 3) for k, v in asdict(self.resources).items()},
                               self.overridden)


def estimate(spec: ModelSpec, shape: BuildShape, backend: BackendNeeds, overrides: ResourceNeed | None,
             fp32_route: bool = False) -> Estimate:
    """What ``shape`` of the checkpoint ``spec`` describes needs on ``backend``: derived, then every key the conf sets
    (``model.resources.<backend>.<key>``, not null) taking its place. ``fp32_route``: validated on a host that runs
    the ranks' bf16 matmuls of many rows in fp32 (``bf16_matmul.rank_graphs_widened``)."""
    weights = weight_bytes(spec, shape)
    given = {f.name: getattr(overrides, f.name) for f in fields(ResourceNeed)} if overrides else {}
    chosen = {k: v for k, v in given.items() if v is not None}
    prefill_tokens = shape.bucket if "prefill" in shape.entries else 0
    return Estimate(replace(derive(weights, backend.factors, prefill_tokens, fp32_route), **chosen), weights,
                    tuple(chosen), backend.name)


def trace_need(resources: ResourceNeed, backend: BackendNeeds, shape: BuildShape, max_parallel: int,
               disk_paths: list[Path], basis: str = "", extra_disk: dict[Path, int] | None = None) -> Need:
    """What tracing one variant needs: the tracing process plus every graph ``backend`` compiles at the same time
    (``basis``: where the figures come from, quoted in refusals); ``extra_disk``: bytes written on a path's file
    system beyond ``resources.disk_gb`` (ModelBuilder's sharded checkpoints in its work folder)."""
    what = f"tracing {shape.kv_max}/{shape.bucket} {shape.dtype} {shape.prefill}-prefill on {backend.name}" + (
        f" ({basis})" if basis else "")
    graphs, hint = backend.graphs_at_once(shape, max_parallel, resources)
    memory = resources.trace_base_gb + graphs * resources.trace_per_graph_gb
    disk = {str(p): int(resources.disk_gb * GIB) for p in disk_paths}
    for path, size in (extra_disk or {}).items():
        disk[str(path)] = disk.get(str(path), 0) + size
    return Need(int(memory * GIB), disk, backend.neuron_cores(shape), what, hint)


def validate_need(resources: ResourceNeed, backend: BackendNeeds, shape: BuildShape, basis: str = "") -> Need:
    """What loading a build and decoding with it needs (plus the host's prefill model for host prefill)."""
    what = f"validating {shape.kv_max}/{shape.bucket} {shape.dtype} {shape.prefill}-prefill on {backend.name}" + (
        f" ({basis})" if basis else "")
    memory = resources.validate_gb + (resources.host_prefill_gb if shape.prefill == "host" else 0.0)
    return Need(int(memory * GIB), {}, backend.neuron_cores(shape), what)


# The float reference (pipeline/stages/reference.py), whatever the backend: transformers' model with its decoder in
# fp32 (WeightBytes.host_float), and what any model costs (interpreter, transformers, the tokenizer, generate's
# buffers). Measured with make rehearse-e4b (docs/full-size.md).
REFERENCE_FIXED_GB = 2.5
REFERENCE_PER_BYTE = 1.0


def reference_need(spec: ModelSpec) -> Need:
    """What the float reference needs: a model of its own on the host, the largest process of a build at E4B's
    size (its decoder in fp32 is 17.6 GiB)."""
    import torch

    decoder = decoder_bytes(spec, torch.float32)  # WeightBytes.host_float
    memory = REFERENCE_FIXED_GB * GIB + REFERENCE_PER_BYTE * decoder
    return Need(int(memory), {}, 0, f"the float reference (its decoder in fp32: {decoder / GIB:.1f} GiB)")


def check(need: Need, settings: PreflightConfig) -> Resources:
    """Measure the host and refuse (``PreflightError``) unless it can do what ``need`` says, creating swap first
    when ``settings.make_swap`` asks for it. With ``settings.check`` off, only measures (the figures still go into
    the build record and any out-of-memory report)."""
    paths = [Path(p) for p in need.disk]
    res = measure(paths, with_neuron=need.neuron_cores > 0)
    if not settings.check:
        return res
    problems = decide(need, res, settings.swap_file)
    if problems and settings.make_swap and need.memory > res.usable_memory:
        make_swap(parse_size(settings.make_swap), settings.swap_file)
        res = measure(paths, with_neuron=need.neuron_cores > 0)
        problems = decide(need, res, settings.swap_file)
    if problems:
        raise PreflightError("preflight refused (set preflight.check=false to skip at your own risk):\n  - "
                             + "\n  - ".join(problems))
    return res


@dataclass(frozen=True)
class Passed:
    """A preflight that passed: the estimate, the need derived from it and the host's figures. The trace stage's
    build record and the validate stage's validation.json both record their ``figures``."""

    estimate: Estimate
    need: Need
    host: Resources

    def figures(self) -> tuple[NeedFigures, HostFigures, EstimateFigures]:
        return self.need.figures(), self.host.figures(), self.estimate.figures()


def run(est: Estimate, need: Need, settings: PreflightConfig) -> Passed:
    """The stages' one entry point: the host checked against ``need`` (derived from ``est`` by ``trace_need`` or
    ``validate_need``), refused or given swap as ``check`` says."""
    return Passed(est, need, check(need, settings))


def oom_message(what: str, res: Resources | None, need: Need | None = None) -> str:
    """The report for a process killed with SIGKILL: almost always the kernel's out-of-memory killer."""
    figures = res.summary() if res else "memory figures unavailable"
    needed = f"; the preflight's estimate was {need.memory / GIB:.1f} GiB" if need and need.memory else ""
    return (f"{what} was killed by SIGKILL (exit -9): most likely the out-of-memory killer (see `dmesg | grep -i "
            f"oom`). At the preflight: {figures}{needed}. Add swap (preflight.make_swap=SIZE), compile fewer ranks "
            "at once (backend.max_parallel=1), or use a host with more memory; then set the figure the estimate got "
            "wrong (model.resources.<backend>.<key>, GiB) so the preflight catches it next time")
