"""Preflight: does this host have the memory, swap, disk and NeuronCores a stage needs? Checked before the work.

``measure()`` reads the host (``/proc/meminfo``, the cgroup's memory limits along its hierarchy, free disk at each
path that will be written, ``neuron-ls --json-output``); ``decide()`` compares those figures with what the model
declares it needs (``model.resources.<backend>``) and returns every shortfall with the exact numbers and the commands
that fix it. Both are plain functions of their inputs, so every decision is tested with injected figures.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.errors import PreflightError
from pipeline.core.units import GIB, parse_size

if TYPE_CHECKING:
    from pipeline.config import PreflightConfig, ResourceNeed
    from pipeline.core.shape import BuildShape

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

    def record(self) -> dict:
        """The figures, for build.json and error reports."""
        return {"mem_available_gib": round(self.mem_available / GIB, 2),
                "swap_free_gib": round(self.swap_free / GIB, 2),
                "cgroup_limit_gib": None if self.cgroup_limit is None else round(self.cgroup_limit / GIB, 2),
                "usable_memory_gib": round(self.usable_memory / GIB, 2),
                "disk_free_gib": {p: round(d.free / GIB, 2) for p, d in sorted(self.disks.items())},
                "neuron_cores": self.neuron_cores, "neuron_cores_busy": self.neuron_cores_busy}


@dataclass
class Need:
    """What a stage needs, in bytes."""

    memory: int
    disk: dict[str, int] = field(default_factory=dict)  # path -> bytes written there
    neuron_cores: int = 0
    what: str = "this stage"
    memory_hint: str = ""  # another way out of a memory shortfall, e.g. compiling fewer ranks at once

    def record(self) -> dict:
        return {"memory_gib": round(self.memory / GIB, 2), "neuron_cores": self.neuron_cores,
                "disk_gib": {p: round(b / GIB, 2) for p, b in sorted(self.disk.items())}}


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


def trace_need(resources: ResourceNeed | None, backend: str, shape: BuildShape, max_parallel: int,
               disk_paths: list[Path]) -> Need:
    """What tracing one variant needs: the tracing process plus every graph compiled at the same time.

    cpu: every rank traces at once. neuron, host prefill: ``parallel_model_trace`` compiles ``max_parallel`` ranks at
    once (all when 0). neuron, device prefill: ModelBuilder compiles one SPMD graph per entry point (prefill, decode),
    concurrently, whatever ``max_parallel`` says.
    """
    cores = shape.tp_degree if backend == "neuron" else 0
    what = f"tracing {shape.kv_max}/{shape.bucket} {shape.dtype} {shape.prefill}-prefill on {backend}"
    if resources is None:
        return Need(0, {}, cores, what)
    if backend == "neuron" and shape.prefill == "device":
        graphs, hint = len(shape.entries), ""
    elif backend == "neuron":
        graphs = min(shape.tp_degree, max_parallel) if max_parallel else shape.tp_degree
        one = resources.trace_base_gb + resources.trace_per_graph_gb
        hint = f"or compile one rank at a time with backend.max_parallel=1 (needs {one:.0f} GiB)" if graphs > 1 else ""
    else:
        graphs, hint = shape.tp_degree, ""
    memory = resources.trace_base_gb + graphs * resources.trace_per_graph_gb
    return Need(int(memory * GIB), {str(p): int(resources.disk_gb * GIB) for p in disk_paths}, cores, what, hint)


def validate_need(resources: ResourceNeed | None, backend: str, shape: BuildShape) -> Need:
    """What loading a build and decoding with it needs (plus the host's float model for host prefill)."""
    cores = shape.tp_degree if backend == "neuron" else 0
    what = f"validating {shape.kv_max}/{shape.bucket} {shape.dtype} {shape.prefill}-prefill on {backend}"
    if resources is None:
        return Need(0, {}, cores, what)
    memory = resources.validate_gb + (resources.host_prefill_gb if shape.prefill == "host" else 0.0)
    return Need(int(memory * GIB), {}, cores, what)


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


def oom_message(what: str, res: Resources | None, need: Need | None = None) -> str:
    """The report for a process killed with SIGKILL: almost always the kernel's out-of-memory killer."""
    figures = res.summary() if res else "memory figures unavailable"
    needed = f"; the model's declared need was {need.memory / GIB:.1f} GiB" if need and need.memory else ""
    return (f"{what} was killed by SIGKILL (exit -9): most likely the out-of-memory killer (see `dmesg | grep -i "
            f"oom`). At the preflight: {figures}{needed}. Add swap (preflight.make_swap=SIZE), compile fewer ranks "
            "at once (backend.max_parallel=1), or use a host with more memory; then raise model.resources so the "
            "preflight catches it next time")
