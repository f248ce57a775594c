"""The neuron backend: the recipe compiled with torch-neuronx / neuronx-distributed for Inferentia2, and loaded back
through neuronx-distributed's own loaders.

Trace. Everything that needs no compiler is checked first (the variant, the model's split, the checkpoint, that the
Neuron packages and the API the variant needs are installed). The compile then runs in its own process group
(``python -m pipeline.backends.neuron_rank``), writing into a temporary directory beside the build that is renamed
into place only when it holds exactly the expected files:

- ``prefill=host``: ``parallel_model_trace`` + ``parallel_model_save`` -> ``tp_0.pt``, ``tp_1.pt`` (layout
  ``per_rank``). The ranks compile concurrently, ``backend.max_parallel`` at a time. Neuron no longer supports this
  API from SDK 2.27 on: pipeline/backends/neuron_sdk.py decides, by the installed release, where it is built.
- ``prefill=device``: ``ModelBuilder`` with ``prefill`` and ``decode`` keys over one weight set -> one TorchScript
  file holding both graphs, every rank's weights and the KV state: ``model.pt`` (layout ``nxd_model``). It is
  packaged like the rank files (the archive holds one directory with ``model.pt``; the manifest says
  ``layout: nxd_model``), and loaded with ``torch.jit.load`` then ``nxd_model.initialize_with_saved_weights``.

Before any compile the installed Neuron packages must be exactly one SDK release (pipeline/backends/neuron_sdk.py),
and the compile holds a lease on ``tp_degree`` NeuronCores (and, for host prefill, on parallel_model_trace's fixed
rendezvous port) for its whole run, the compile process seeing only its cores (pipeline/backends/neuron_cores.py).

The compiler's scratch directory is ``<compiler_workdir or variant dir>/compile-<model>-<variant>``: ModelBuilder
deletes its workdir before it starts, so it is never a directory a user named, only one this backend owns. It is
removed after a successful compile and kept after a failure (its ``log-neuron-cc.txt`` files say why). A compile process
killed with SIGKILL (the kernel's out-of-memory killer) is reported as such with the preflight's memory figures.

Load. Only a ``VerifiedBuild``, in a process holding its NeuronCores: ``parallel_model_load`` for ``per_rank`` (host
prefill: before each prompt, each rank's KV state, the parameters named ``states.N`` read afresh from the loaded
model, is seeded with its heads of the host's caches), ``torch_neuronx`` imported then ``torch.jit.load`` +
``initialize_with_saved_weights`` for ``nxd_model``. The greedy token is the argmax of the returned logits.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from pipeline.artifact.archive import VerifiedBuild, require_verified
from pipeline.backends import neuron_memory, neuron_sdk
from pipeline.backends.aliased_rank import shape_problems
from pipeline.backends.base import RankRunner, TraceRequest, check_request, graph_inputs
from pipeline.backends.neuron_cores import VISIBLE_CORES_ENV, Lease, acquire, leased, trace_port
from pipeline.backends.neuron_job import CompileResult, make_job
from pipeline.backends.neuron_rank import COMPILER_LOG
from pipeline.backends.torchscript import strip_debug_records
from pipeline.core.build_records import Member, ToolchainRecord, TraceResult
from pipeline.core.choices import StrEnum
from pipeline.core.errors import BuildError, ConfigError, IntegrityError
from pipeline.core.fsutil import reporting_full_disk, sha256_file, staged_dir
from pipeline.core.log import log
from pipeline.core.shape import BuildShape, rank_members
from pipeline.core.units import visible_cores_problems
from pipeline.recipe.spec import load_spec

NEURON_EXTRA_HINT = "install the Neuron packages on an inf2 host: " + neuron_sdk.INSTALL.format(
    release=neuron_sdk.PINNED)
PER_RANK, NXD_MODEL = "per_rank", "nxd_model"
HOST_OOM_RE = re.compile(r"(returned|exit(?:ed)?(?: with)?(?: code| status)?)\s*:?\s*-9\b|signal\s*(?:9|SIGKILL)\b"
                         r"|\bSIGKILL\b|\bKilled\b", re.IGNORECASE)
DEVICE_OOM_RE = re.compile(r"NCC_EOOM\d*|Failed to alloc(?:ate)? DEVICE memory", re.IGNORECASE)
STATE_NAME_RE = re.compile(r"^states\.(\d+)$")
METANEFF = "metaneff.pb"  # each ModelBuilder bucket's traced inputs and outputs: torch-neuronx's MetaNeff message


# -- what can be decided without the hardware ------------------------------------------------------------------------

def layout(shape: BuildShape) -> str:
    return NXD_MODEL if shape.prefill == "device" else PER_RANK


def build_members(shape: BuildShape) -> list[str]:
    from pipeline.backends.neuron_rank import NXD_MODEL_FILE

    return [NXD_MODEL_FILE] if layout(shape) == NXD_MODEL else rank_members(shape.tp_degree)


def neuronx_cc_release(toolchain: ToolchainRecord) -> str | None:
    from pipeline.backends.neuron_sdk import release_part

    return release_part(toolchain.neuronx_cc.version) or toolchain.version("neuronx-cc")


class OutOfMemory(StrEnum):
    """Which memory a failed compile ran out of."""

    host_oom = "host_oom"
    """The compiler was killed, almost always by the out-of-memory killer."""
    device_oom = "device_oom"
    """The graph does not fit a NeuronCore's memory."""


def classify_failure(text: str) -> OutOfMemory | None:
    """The memory a compile's failure ``text`` shows it ran out of, or None."""
    if DEVICE_OOM_RE.search(text):
        return OutOfMemory.device_oom
    if HOST_OOM_RE.search(text):
        return OutOfMemory.host_oom
    return None


def missing_api(prefill: str, check_release: bool = True, allow_unsupported_host_prefill: bool = False) -> str | None:
    """Why this host cannot compile the variant (None when it can): a Neuron package missing, an installed mix that
    is not one SDK release, or host prefill on a release where it is not known to work (pipeline/backends/neuron_sdk.py
    says which, and why)."""
    for module in ("torch_neuronx", "neuronx_distributed"):
        if importlib.util.find_spec(module) is None:
            return f"backend=neuron needs the Python package {module!r}: {NEURON_EXTRA_HINT}"
    installed = neuron_sdk.installed_versions()
    row = neuron_sdk.identify(installed)
    if row is None and check_release:
        return neuron_sdk.mix_problem(installed)
    if prefill == "host" and row is None and not allow_unsupported_host_prefill:
        return ("prefill=host on Neuron packages that are not one known SDK release (backend.check_sdk_release=false): "
                "whether parallel_model_trace works there is unknown; set backend.allow_unsupported_host_prefill=true "
                "to try it, or build the device-prefill variants")
    if prefill == "host" and row is not None:
        problem = neuron_sdk.host_prefill_problem(row, allow_unsupported_host_prefill)
        if problem:
            return problem
        if row.host_prefill != neuron_sdk.SUPPORTED:
            log.warning("prefill=host on Neuron SDK %s: parallel_model_trace is %s (pipeline/backends/neuron_sdk.py)",
                        row.release, row.host_prefill)
    # Every release of the table has both APIs; an SDK the table does not know (backend.check_sdk_release=false) may
    # lack one, as a module that is not there or a name it does not export: both are refused here, not mid-compile.
    module, name = ("neuronx_distributed.trace", "parallel_model_trace") if prefill == "host" else (
        "neuronx_distributed.trace.model_builder", "ModelBuilder")
    try:
        found = hasattr(importlib.import_module(module), name)
    except ImportError:
        found = False
    if not found:
        return (f"prefill={prefill} variants are compiled with {module}.{name}, which the installed Neuron SDK "
                f"lacks: {NEURON_EXTRA_HINT}")
    return None


def host_neuron_cores() -> int:
    """How many NeuronCores this host has (``neuron-ls``); refuses a host without the Neuron tools."""
    from pipeline.core.errors import PreflightError
    from pipeline.host.preflight import neuron_cores

    total, _ = neuron_cores()
    if total is None:
        raise PreflightError("backend=neuron needs NeuronCores, but neuron-ls is not available: run on an inf2 host "
                             "with the Neuron driver and tools (aws-neuronx-dkms, aws-neuronx-tools)")
    return total


def core_lease(tp_degree: int, spec: str | None, what: str, host_cores: int | None = None,
               fix: str = "give this run other cores with backend.visible_cores=A-B") -> Lease:
    """This process's NeuronCores for ``what`` (pipeline/backends/neuron_cores.py)."""
    return acquire(tp_degree, host_neuron_cores() if host_cores is None else host_cores, spec, what, fix)


_process_lease: Lease | None = None


def lease_for_this_process(tp_degree: int) -> None:
    """Give this process NeuronCores before the runtime initialises. A process that was given its cores (a validation
    its stage leased them for, or a user's NEURON_RT_VISIBLE_CORES) keeps them; otherwise it leases some and sets
    NEURON_RT_VISIBLE_CORES, holding the lease until it exits (the runtime keeps the cores until then too)."""
    global _process_lease
    given = os.environ.get(VISIBLE_CORES_ENV)
    if given:
        problems = visible_cores_problems(given, tp_degree, None)
        if problems:
            raise ConfigError([p.replace("backend.visible_cores", VISIBLE_CORES_ENV) for p in problems])
        return
    _process_lease = core_lease(tp_degree, None, f"loading a build in process {os.getpid()}",
                                fix=f"set {VISIBLE_CORES_ENV}=A-B for this process")
    os.environ.update(_process_lease.env())


def compile_env(lease: Lease) -> dict[str, str]:
    """The compile process's environment: its NeuronCores, and this package importable from any directory."""
    package_root = str(Path(__file__).resolve().parents[2])
    inherited = [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path = os.pathsep.join([package_root, *inherited])
    return {**os.environ, **lease.env(), "PYTHONPATH": path}


def host_cores(request: TraceRequest) -> int:
    """The host's NeuronCores as the preflight measured them, else asked of neuron-ls now."""
    measured = request.host.neuron_cores if request.host is not None else None
    return measured if measured is not None else host_neuron_cores()


def compile_workdir(request: TraceRequest, out_dir: Path) -> Path:
    """The compiler's scratch directory: always a subdirectory this backend owns (ModelBuilder wipes it)."""
    base = request.workdir if request.workdir is not None else out_dir.parent
    return (Path(base) / f"compile-{out_dir.parent.parent.name}-{out_dir.parent.name}").resolve()


def compiler_commands(workdir: Path) -> dict[str, list[str]]:
    """Each compile's neuronx-cc arguments, where its log holds its command line (a line naming ``neuronx-cc
    compile``, e.g. ``... INFO ... [root]: /.../neuronx-cc compile <hlo> --framework XLA --target ... <flags>``), by
    the log's path in ``workdir``; paths inside ``workdir`` written as ``<workdir>/...``. What the SDK passes is closed
    source for torch-neuronx 2.x and libneuronxla, and so is how neuronx-cc starts its log: a log without such a line
    is left out (``compile_cache`` does not depend on it)."""
    found = {}
    for log_file in sorted(Path(workdir).rglob(COMPILER_LOG)):
        for line in log_file.read_text(errors="replace").splitlines():
            if "neuronx-cc" not in line or " compile" not in line:
                continue
            try:
                words = shlex.split(line.split("]: ", 1)[-1])
            except ValueError:
                continue
            start = next((i for i, w in enumerate(words) if w.endswith("neuronx-cc")), None)
            if start is not None:
                found[str(log_file.relative_to(workdir))] = [w.replace(str(workdir), "<workdir>")
                                                             for w in words[start + 1:]]
                break
    return found


def passed_flags(passed: dict[str, str], workdir: Path) -> dict[str, list[str]]:
    """The flags ModelBuilder passed per bucket (its ``compiler_flag_hook``: the same on a compile-cache hit and a
    miss), split like a shell, paths inside ``workdir`` written as ``<workdir>/...``."""
    return {bucket: [w.replace(str(workdir), "<workdir>") for w in shlex.split(flags)]
            for bucket, flags in sorted(passed.items())}


def compile_cache(passed: dict[str, str], workdir: Path) -> dict[str, str]:
    """Per bucket, whether neuronx-cc ran: ``compiled`` when its log is in the bucket's folder, ``cache hit`` when
    the folder holds the bucket's NEFF and no log (NxD compiles with ``use_cache=True``, v2.28.0 model_builder.py
    ~603-624, and writes the NEFF it gets back, compiled or cached, to ``<key>/_tp0_bk<N>/graph.neff``, ~747-750; on
    a hit the compiler does not run and writes no log), else ``unknown`` (neither file, or a ``--logfile`` of the
    user's elsewhere, where every bucket logs). Decided by the files, not by parsing the log, whose format is
    neuronx-cc's (closed source): a log ``compiler_commands`` cannot read still means the bucket compiled."""
    from pipeline.backends.neuron_rank import MODEL_BUILDER_DIR, NEFF_FILE, logfile_of

    found = {}
    for bucket, flags in sorted(passed.items()):
        folder = Path(os.path.realpath(Path(workdir) / MODEL_BUILDER_DIR / bucket))
        log_file = logfile_of(flags)
        if log_file is None or Path(os.path.realpath(log_file.parent)) != folder:
            found[bucket] = "unknown"
        elif log_file.is_file():
            found[bucket] = "compiled"
        else:
            found[bucket] = "cache hit" if (folder / NEFF_FILE).is_file() else "unknown"
    return found


def traced_inputs(passed: dict[str, str], workdir: Path) -> dict[str, dict[str, int] | str]:
    """Per bucket, its graph's inputs by kind (``USER_INPUT``, ``INPUT_STATE``, ``INPUT_WEIGHT``) and how many of
    the weights are ``layer_scalar`` buffers (none: torch-neuronx folded them as constants), read from the
    ``metaneff.pb`` NxD writes into each bucket's folder (v2.28.0 model_builder.py ~753-758) with torch-neuronx's
    own message class, as NxDI's utils/snapshot.py (~361-372) reads it. A bucket without the file or the class: a
    sentence saying so."""
    from pipeline.backends.neuron_rank import MODEL_BUILDER_DIR

    # A record, never a reason to fail: the compile it describes has succeeded (hours of it, on E4B).
    try:
        from torch_neuronx.proto import metaneff_pb2
    except Exception as exc:  # noqa: BLE001 - torch_neuronx imports torch_xla, which can fail in many ways
        return {bucket: f"unknown: {type(exc).__name__}: {exc}" for bucket in sorted(passed)}
    found: dict[str, dict[str, int] | str] = {}
    for bucket in sorted(passed):
        path = Path(workdir) / MODEL_BUILDER_DIR / bucket / METANEFF
        if not path.is_file():
            found[bucket] = f"unknown: no {METANEFF} in the bucket's folder"
            continue
        try:
            meta = metaneff_pb2.MetaNeff()
            meta.ParseFromString(path.read_bytes())
            kinds = Counter(metaneff_pb2.MetaTensor.Type.Name(t.type) for t in meta.input_tensors)
            weights = [t.checkpoint_key.decode() for t in meta.input_tensors
                       if t.type == metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT]
        except Exception as exc:  # noqa: BLE001 - a message of another SDK's layout: said, not raised
            found[bucket] = f"unknown: {METANEFF} unreadable ({type(exc).__name__}: {exc})"
            continue
        found[bucket] = {**dict(sorted(kinds.items())),
                         "layer_scalar_weights": sum(key.endswith("layer_scalar") for key in weights)}
    return found


def sdk_added_args(commands: dict[str, list[str]], ours: list[str]) -> list[str]:
    """The options the SDK added to ours in any compile (``--framework XLA``, ``--target inf2``, ``--logfile=...``,
    ModelBuilder's defaults ...), each with its value, in their first order of appearance."""
    given = set(ours)
    added: list[str] = []
    for words in commands.values():
        i = 2  # after "compile <hlo>"
        while i < len(words):
            option, i = words[i], i + 1
            if not option.startswith("-"):
                continue
            if "=" not in option and i < len(words) and not words[i].startswith("-"):
                option, i = f"{option} {words[i]}", i + 1
            if option.split(" ")[0] not in given and option not in added:
                added.append(option)
    return added


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())


def state_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """A loaded rank's KV state in output order: the parameters named ``states.N``, by N (numerically: 10 after 9)."""
    found = []
    for name, param in module.named_parameters():
        match = STATE_NAME_RE.match(name)
        if match:
            found.append((int(match.group(1)), param))
    return [param for _, param in sorted(found, key=lambda item: item[0])]


# -- running the compile in its own process group ----------------------------------------------------------------------

def run_isolated(argv: list[str], result_path: Path, what: str, request: TraceRequest,
                 env: dict | None = None, cwd: Path | None = None) -> tuple[CompileResult, int]:
    """Run ``argv`` in a new session; return ``(the CompileResult it wrote, the peak RSS of its largest process)``.

    An interruption of this process kills the whole group (the compiler processes included). A SIGKILL of the child
    becomes an out-of-memory report with the preflight's figures; a failure whose text shows a killed compiler too.
    """
    from pipeline.host.preflight import oom_message

    # Its standard output to standard error: the command's standard output is for its results, and the compiler
    # and gloo print there. Raw, not relayed (core/log.relay_output): a compiler's message must not need DEBUG.
    proc = subprocess.Popen(argv, start_new_session=True, env=env, cwd=cwd, stdout=2)
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # compiler processes the child left behind
    peak = usage.ru_maxrss * 1024
    if code == -signal.SIGKILL:
        raise BuildError(oom_message(what, request.host, request.need))
    if not Path(result_path).is_file():
        raise BuildError(f"{what} exited with code {code} without a result")
    result = CompileResult.read(result_path)
    if not result.ok:
        raise_failure(result, what, request, cwd)
    return result, peak


def raise_failure(result: CompileResult, what: str, request: TraceRequest, cwd: Path | None) -> None:
    """The compile's failure as the ``BuildError`` that says what it was: the host's memory, a NeuronCore's, or
    anything else (with the traceback, and where the compiler's logs are kept)."""
    from pipeline.host.preflight import oom_message

    error, trace = result.error, result.traceback or ""
    kind = classify_failure(error + "\n" + trace)
    if kind is OutOfMemory.host_oom:
        raise BuildError(oom_message(what, request.host, request.need) + f"\nThe compiler said: {error}")
    if kind is OutOfMemory.device_oom:
        raise BuildError(f"{what}: the graph does not fit a NeuronCore's memory ({error}); this is device memory, "
                         "not host RAM: lower variant.kv_max or variant.bucket, or raise variant.tp_degree")
    kept = f"\nThe compiler's work files and logs (log-neuron-cc.txt) are kept under {cwd}" if cwd else ""
    raise BuildError(f"{what} failed: {error}\n{trace}{kept}")


# -- the backend ------------------------------------------------------------------------------------------------------

class NeuronBackend:
    name = "neuron"

    def members(self, shape: BuildShape) -> list[str]:
        return build_members(shape)

    def compiler_id(self, toolchain: ToolchainRecord) -> str:
        version = neuronx_cc_release(toolchain)
        if not version:
            raise BuildError(f"backend=neuron but artifacts/toolchain.json records no neuronx-cc: {NEURON_EXTRA_HINT}, "
                             "then run stage=toolchain")
        return "ncc" + version

    def check_installed(self, request: TraceRequest | None = None) -> None:
        """The Neuron packages, one SDK release of them, and the API ``request``'s variant compiles with; before any
        stage writes anything (a refused run must not rewrite toolchain.json and so mark every build stale)."""
        if request is None:
            reason = missing_api("device", check_release=False)  # the packages, whatever the variant
        else:
            reason = missing_api(request.shape.prefill, request.check_sdk_release,
                                 request.allow_unsupported_host_prefill)
        if reason:
            raise BuildError(reason)

    def check_load(self, shape: BuildShape) -> None:
        """Every shape a neuron build was compiled for runs (its NeuronCores are leased when it loads)."""

    def check(self, request: TraceRequest) -> None:
        """Every refusal that needs no compile, before anything is written."""
        problems = shape_problems(request.shape)
        if problems:
            raise ConfigError(problems)
        spec = check_request(request)
        problem = neuron_memory.fit_problem(spec, request.shape)  # before any compile: hours, on E4B
        if problem:
            raise ConfigError(problem)
        reason = missing_api(request.shape.prefill, request.check_sdk_release, request.allow_unsupported_host_prefill)
        if reason:
            raise BuildError(reason)

    def trace(self, request: TraceRequest, out_dir: Path) -> TraceResult:
        from pipeline.backends.neuron_rank import effective_compiler_args

        shape = request.shape
        self.check(request)
        out_dir = Path(out_dir)
        workdir = compile_workdir(request, out_dir)
        started = time.monotonic()
        effective = effective_compiler_args(shape, list(request.compiler_args),
                                            neuron_sdk.installed_versions()["neuronx-distributed"])
        with staged_dir(out_dir) as tmp, tempfile.TemporaryDirectory(prefix="gemma4-neuron-trace-") as scratch:
            job_path, result_path = Path(scratch) / "job.json", Path(scratch) / "result.json"
            make_job(request.checkpoint, shape, list(request.compiler_args), tmp, workdir, request.max_parallel,
                     request.compile_cache_dir).write(job_path)
            what = f"the neuron compile of {out_dir.parent.name}"
            with contextlib.ExitStack() as held:
                if shape.prefill == "host":
                    held.enter_context(trace_port(what))
                lease = held.enter_context(leased(shape.tp_degree, host_cores(request), request.visible_cores, what))
                shutil.rmtree(workdir, ignore_errors=True)  # ours alone; a failed compile's files are stale now
                workdir.mkdir(parents=True)
                log.info("trace: compiling with neuronx-cc (%s), work files in %s", " ".join(request.compiler_args),
                         workdir)
                # The compile runs in its work directory: whatever the SDK writes to the current directory (the
                # compiler's log on the parallel_model_trace path) stays with the files a failure keeps.
                result, peak = run_isolated([sys.executable, "-m", "pipeline.backends.neuron_rank", str(job_path),
                                             str(result_path)], result_path, what, request,
                                            env=compile_env(lease), cwd=workdir)
            commands = compiler_commands(workdir)  # these three read the work files, before they go
            cache, inputs = compile_cache(result.compiler_flags, workdir), traced_inputs(result.compiler_flags, workdir)
            workdir_bytes = tree_bytes(workdir)  # the sharded checkpoints and compiler files at their largest
            found = sorted(p.name for p in tmp.iterdir())
            if found != sorted(self.members(shape)):
                raise BuildError(f"the neuron compile wrote {found}, expected exactly {self.members(shape)} "
                                 f"(work files kept in {workdir})")
            # The work files go before the rewrite below writes its copy: ModelBuilder's sharded checkpoints (all
            # ranks' bytes), the model file and its copy were 3x the ranks' bytes on disk at once; now 2x.
            shutil.rmtree(workdir, ignore_errors=True)
            for name in found:  # the same bytes from any checkout, environment or host
                with reporting_full_disk(tmp / name, f"trace: rewriting {name} without its debug records"):
                    strip_debug_records(tmp / name)
            members = tuple(Member(name, (tmp / name).stat().st_size, sha256_file(tmp / name)) for name in found)
        shutil.rmtree(workdir, ignore_errors=True)
        return TraceResult(members=members, layout=layout(shape), peak_rss_bytes=peak, details={
            "api": "ModelBuilder" if shape.prefill == "device" else "parallel_model_trace",
            "entries": list(shape.entries),
            "wall_s": round(time.monotonic() - started, 3),
            "compile_s": result.seconds,
            "max_parallel": request.max_parallel,
            "compile_cache_dir": request.compile_cache_dir,
            "compiler": "neuronx-cc",
            "effective_compiler_args": effective,
            "compiler_flags": passed_flags(result.compiler_flags, workdir),
            "compile_cache": cache,
            "traced_inputs": inputs,
            "compiler_commands": commands,
            "sdk_added_args": sdk_added_args(commands, list(request.compiler_args)),
            "workdir_bytes": workdir_bytes,
            "device_memory_estimate": neuron_memory.estimate(load_spec(request.checkpoint.directory), shape).record(),
        })

    def load(self, build: VerifiedBuild, shape: BuildShape) -> NeuronRunner:
        return NeuronRunner(require_verified(build), shape)


class NeuronRunner(RankRunner):
    """A loaded build on the NeuronCores of this host. Every call runs all ranks (threads of this process)."""

    def __init__(self, build: VerifiedBuild, shape: BuildShape):
        self.shape = shape
        names = sorted(m.path for m in build.members)
        expected = build_members(shape)
        if names != sorted(expected):
            raise IntegrityError(f"{build.directory} holds {names}, a {shape.prefill}-prefill tp_degree "
                                 f"{shape.tp_degree} neuron build needs {expected}")
        started = time.monotonic()
        lease_for_this_process(shape.tp_degree)
        build.recheck()  # loading TorchScript runs code: only the verified, unchanged files
        if layout(shape) == NXD_MODEL:
            # model.pt holds torch.classes.neuron objects made by ModelBuilder; they exist only once torch_neuronx is
            # imported (NxD's own test imports neuronx_distributed.trace.model_builder, which imports it, before
            # torch.jit.load; the seed's optb_server_mb.py imports torch_neuronx "to register the ops").
            importlib.import_module("torch_neuronx")
            self.model = torch.jit.load(str(build.directory / expected[0]))
            self.model.nxd_model.initialize_with_saved_weights(torch.tensor(0))
        else:
            from neuronx_distributed.trace import parallel_model_load

            self.model = parallel_model_load(str(build.directory))
        self.load_s = time.monotonic() - started

    def _call(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(*inputs)
        rows = inputs[0].shape[0]  # one logits row per sequence of the call
        logits = (out[0] if isinstance(out, (tuple, list)) else out).to("cpu").float().reshape(rows, -1)
        return logits, torch.argmax(logits, dim=-1)

    def prefill(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None):
        if "prefill" not in self.shape.entries:
            raise RuntimeError("this build decodes only (prefill=host): seed the KV with seed_kv instead")
        return self._call(*graph_inputs(self.shape, embeds, per_layer_tokens, positions, last_index, seq_ids))

    def decode(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None):
        return self._call(*graph_inputs(self.shape, embeds, per_layer_tokens, positions, last_index, seq_ids))

    def seed_kv(self, per_rank: list[list[torch.Tensor]], line: int = 0) -> None:
        if layout(self.shape) != PER_RANK:
            raise RuntimeError("only prefill=host builds take host-computed caches")
        # Read the state parameters afresh on every call, never once after loading: the loaded model moves itself to
        # the NeuronCores on its first forward and replaces them with new tensors (NxD v2.28.0 trace/trace.py,
        # TensorParallelNeuronModel._load -> torch_neuronx.move_trace_to_device), so parameters captured earlier
        # are orphaned host copies and every prompt after the first would decode over a stale cache (the seed's
        # optb_server_tp.py "KV-leak fix" re-reads them per request for this reason).
        ranks = list(self.model.models)
        for rank, (module, caches) in enumerate(zip(ranks, per_rank, strict=True)):
            write_states(rank, state_parameters(module), caches, line)

    def reset(self) -> None:
        """Nothing to do: a prompt's prefill (or seeding) rewrites every cache slot it will attend to, and the masks,
        computed from positions, hide every slot beyond the current one. (NxD offers no cheap device-side zeroing.)"""

    def peak_rss_bytes(self) -> list[int]:
        from pipeline.host.procinfo import peak_rss_bytes

        return [peak_rss_bytes()]  # the ranks run as threads of this process

    def close(self) -> None:
        self.model = None

    def __enter__(self) -> NeuronRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_states(rank: int, params: list[torch.nn.Parameter], caches: list[torch.Tensor], line: int = 0) -> None:
    """Copy one sequence's host caches into cache line ``line`` of one rank's KV state, refusing any count or shape
    mismatch (which would decode garbage).

    Whole tensors only: a batch's state is read back, changed in that line and written whole, the other lines as the
    device holds them. NxD's own host writes are whole-tensor copies (v2 ``NxDModel.write_to_neuron_buffer`` refuses
    any other shape, nxd_model/nxd_model.py ~383-418); whether torch-neuronx takes a write into a slice of a device
    tensor is closed source, and only hardware can say (docs/inf2-host.md, first-run checklist)."""
    if len(params) != len(caches):
        raise IntegrityError(f"rank {rank} has {len(params)} KV state tensors (states.N), the host computed "
                             f"{len(caches)} caches: the build and the model do not match")
    for j, (param, cache) in enumerate(zip(params, caches)):
        lines = param.shape[0]
        if tuple(param.shape[1:]) != tuple(cache.shape[1:]) or cache.shape[0] != 1 or not 0 <= line < lines:
            raise IntegrityError(f"rank {rank} states.{j} has shape {list(param.shape)}; the host cache "
                                 f"{list(cache.shape)} for line {line}: the build and the model do not match")
        whole = cache.to(param.dtype)
        if lines > 1:
            whole = param.data.to("cpu").clone()
            whole[line:line + 1] = cache.to(param.dtype)
        param.data.copy_(whole)
