"""The recipe on torch-xla's CPU device: the graphs the Neuron compiler would receive, lowered, checked and run here.

torch-neuronx compiles what torch-xla lowers (neuronx-distributed's ``ModelBuilder`` hands the HLO module torch-xla
builds for each bucket to neuronx-cc), so lowering here shows what that compiler would see. The module lowered is the
one the neuron backend compiles: ``AliasedRank`` (``aliased_rank.py``), whose outputs are the logits and every
updated KV cache (the greedy token is taken on the host). Runs in its own process (torch-xla reads its settings when
it is imported), started by ``pipeline/backends/xla.py`` through the rank runtime (``ranks.py``).

Trace, per rank: build the rank with ``XlaParallel`` (torch-xla's collectives), move it to the XLA device, lower each
entry point (a prefill graph per bucket of the ladder, ``decode`` over one token, which is also host prefill's
decode-with-state) to its HLO module without running it (anything that would run part of it on the way is refused),
record it (``hlo.GraphRecord``), and refuse an operator the compiler does not list or, with two ranks, a graph
without its collectives. With one rank the graphs then run: after a warm-up, more decode steps and each prefill graph
again must compile nothing new, call no host fallback, and alias every KV cache to its update (torch-xla's
metrics). Two ranks' collectives do not execute on torch-xla 2.8's CPU client (``TP_LIMIT``): their graphs are
lowered, not run.

Writes ``tp_<rank>.pt`` per rank: the rank's weights in the build's dtype, the checkpoint's config (what the module
is built from), the digest of the code that builds the module, and the records of its graphs (``torch.save`` of
tensors and strings, read back with ``weights_only=True``: loading runs no code). A loaded rank refuses other code than
the build's, lowers each graph again and refuses to run one whose hash differs from the one recorded.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.artifact.archive import VerifiedBuild
from pipeline.backends import hlo
from pipeline.backends.base import entry_inputs as example_entry_inputs
from pipeline.backends.ranks import ServeJob, Traced, TracedRank, TraceJob, report_failure, serve_commands
from pipeline.core.errors import BuildError, IntegrityError
from pipeline.core.fsutil import reporting_full_disk, sha256_file
from pipeline.core.records import code_digest
from pipeline.core.shape import BuildShape
from pipeline.host.procinfo import peak_rss_bytes
from pipeline.recipe.parallel import Parallel, RowLinear, ShardLinear, VocabHead

RANK_FORMAT = "gemma4-xla-rank/1"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout: recipe lines are named relative to it
CONFIG_FILES = ("config.json", "generation_config.json")  # what recipe.spec.load_spec reads
WARM_DECODE_STEPS = 8  # decode steps after the warm-up that must compile nothing new
TP_LIMIT = ("torch-xla 2.8's CPU client does not execute two ranks' collectives: its process launcher runs one "
            "process per host on CPU, and two virtual devices in one process (CPU_NUM_DEVICES=2) compile one "
            "executable per device whose all-reduce rendezvous never meets (it aborts after 10 s)")


def set_environment(tp_degree: int, debug: bool) -> None:
    """What torch-xla reads when it is imported: the CPU device, one virtual device per rank, and (``debug``) the
    recipe line of each HLO instruction (hlo.unsupported). Every other ``XLA_*`` setting inherited from the caller is
    dropped: flags such as XLA_USE_32BIT_LONG or XLA_FLAGS would change the graphs under the same version."""
    for name in [n for n in os.environ if n.startswith("XLA_")]:
        del os.environ[name]
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ["CPU_NUM_DEVICES"] = str(tp_degree)
    if debug:
        os.environ["XLA_HLO_DEBUG"] = "1"
        os.environ["XLA_IR_DEBUG"] = "1"


def build_code_digest() -> str:
    from pipeline.backends.registry import backend_entry  # the table imports the schema: only when a rank is loaded

    return code_digest(*backend_entry("xla").build_code)


# -- the parallel primitives ------------------------------------------------------------------------------------------

class XlaRowLinear(RowLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ShardLinear.forward(self, x).float()
        if self.tp_degree > 1:
            import torch_xla.core.xla_model as xm

            y = xm.all_reduce(xm.REDUCE_SUM, y)
        return y


class XlaVocabHead(VocabHead):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ShardLinear.forward(self, x).float()
        if self.tp_degree > 1:
            import torch_xla.core.xla_model as xm

            rows, part = y.shape
            # pin_layout=False: a real all-gather (pinned, torch-xla lowers it as an all-reduce of a padded tensor)
            gathered = xm.all_gather(y, dim=0, pin_layout=False)
            y = gathered.view(self.tp_degree, rows, part).transpose(0, 1).reshape(rows, self.tp_degree * part)
        return y


class XlaParallel(Parallel):
    """The recipe's linear layers with torch-xla's collectives (the recipe's own primitives otherwise)."""

    def row(self, in_features: int, out_features: int, dtype: torch.dtype):
        return XlaRowLinear(in_features, out_features, dtype, self.tp_degree, self.group)

    def head(self, in_features: int, vocab: int, dtype: torch.dtype, sharded: bool):
        return XlaVocabHead(in_features, vocab, dtype, self.tp_degree, self.group, sharded)


# -- lowering ---------------------------------------------------------------------------------------------------------

def device():
    import torch_xla

    return torch_xla.device()


def sync() -> None:
    import torch_xla

    torch_xla.sync()


def counter(name: str) -> int:
    import torch_xla.debug.metrics as met

    return met.counter_value(name) or 0


def counters() -> dict:
    """What running anything on the device leaves behind: executions, transfers to the host, host fallbacks."""
    import torch_xla.debug.metrics as met

    transfers = met.metric_data("TransferFromDeviceTime")
    return {"executions": counter("ExecuteComputation"), "transfers": transfers[0] if transfers else 0,
            "fallbacks": sorted(met.executed_fallback_ops())}


def rank_module(spec, shape: BuildShape, state: dict[str, torch.Tensor]):
    """The ``AliasedRank`` the neuron backend compiles, of this rank, with torch-xla's collectives, on the XLA
    device."""
    from pipeline.backends.aliased_rank import AliasedRank
    from pipeline.recipe.model import build_rank
    from pipeline.recipe.plan import ShardPlan

    rank = build_rank(spec, ShardPlan(spec, shape.tp_degree), XlaParallel(shape.tp_degree), shape.kv_max,
                      shape.torch_dtype, state, shape.batch_size)
    return AliasedRank(rank.decoder).to(device())


def entry_inputs(spec, shape: BuildShape, entry: str, start: int = 0) -> tuple[torch.Tensor, ...]:
    """An entry point's inputs on the device, the positions as device tensors: a Python int would be a constant of
    the graph, and every new value a new compile."""
    embeds, per_layer, positions, last, *seq_ids = example_entry_inputs(spec, shape, entry)
    return tuple(t.to(device()) for t in (embeds, per_layer, positions + start, last, *seq_ids))


def call(module, entry: str, inputs):
    """Run ``entry``'s graph of ``module`` (an ``AliasedRank``) on ``inputs``: the entry fixes its rows."""
    module.entry = entry
    return module(*inputs)


def graph_hlo(outputs) -> str:
    """The HLO module text of the pending graph that computes ``outputs``."""
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo(list(outputs))


def write_back(module, caches) -> None:
    """Each updated cache into its parameter, in place: torch-xla then aliases the parameter's buffer to the graph's
    output, as the neuron runtime does with the aliases ``AliasedRank.aliases`` declares."""
    for cache, new in zip(module.caches(), caches, strict=True):
        cache.copy_(new)


def replicate(tp_degree: int) -> None:
    """Make the world ``tp_degree`` devices, so the collectives are lowered (on one device torch-xla skips them).
    Also starts a new chain of collectives: torch-xla threads one token through every collective on a device, so
    without this a graph would hold the collectives of the graphs lowered before it."""
    import torch_xla.core.xla_model as xm

    xm.set_replication(device(), xm.get_xla_supported_devices()[:tp_degree] if tp_degree > 1 else [])


def lower(module, spec, shape: BuildShape, entry: str) -> str:
    """The HLO module text of one entry point, traced and not run. Nothing may run on the way: a value read back to
    Python, or an operator torch-xla runs on the host, would split the graph the compiler receives."""
    replicate(shape.tp_degree)
    before = counters()
    with torch.no_grad():
        outputs = call(module, entry, entry_inputs(spec, shape, entry))
    text = graph_hlo(outputs)
    ran = {k: v for k, v in counters().items() if v != before[k]}
    if ran:
        raise BuildError(f"lowering the {entry} graph ran part of it ({ran}): a value is read back to Python or an "
                         "operator falls back to the host inside the step, so the compiler would not receive one "
                         "whole graph")
    return text


def collective_problems(module, graphs: dict[str, hlo.GraphRecord]) -> list[str]:
    """Each graph must hold one all-reduce per row-parallel layer and, with a vocabulary-split head, one
    all-gather: fewer, and the ranks would not combine their shards."""
    want = {"all-reduce": sum(isinstance(m, XlaRowLinear) for m in module.modules()),
            "all-gather": sum(isinstance(m, XlaVocabHead) and m.tp_degree > 1 for m in module.modules())}
    found = []
    for entry, graph in graphs.items():
        have = {op: graph.opcodes.get(op, 0) for op in want}
        if have != want:
            found.append(f"the {entry} graph holds {have}, the rank's layers need {want}")
    return found


def check_operators(graph: str, text: str) -> None:
    problems = hlo.unsupported(text, PACKAGE_ROOT)
    if problems:
        raise BuildError(hlo.describe(graph, problems))


# -- what running the graphs shows (one rank) -------------------------------------------------------------------------

@dataclass(frozen=True)
class GraphChecks:
    """What running a rank's graphs showed (``run_checks``), or why they were not run (``executed`` false, ``why``)."""

    executed: bool
    why: str | None = None
    compiles_at_warm_up: int | None = None
    compiles_after_warm_up: int | None = None
    steps_after_warm_up: int | None = None
    host_fallbacks: list[str] | None = None
    aliased_inputs_per_graph: list[int] | None = None
    """One per compiled graph: how many of its inputs it updates in place."""
    caches: int | None = None
    steady_s: float | None = None


def run_checks(module, spec, shape: BuildShape) -> GraphChecks:
    """Warm up every graph, then run more steps and another prefill: none may compile, fall back to the host, or copy
    a KV cache instead of updating it in place."""
    import torch_xla.debug.metrics as met

    def step(entry: str, start: int):
        with torch.no_grad():
            write_back(module, call(module, entry, entry_inputs(spec, shape, entry, start))[1:])
        sync()

    met.clear_all()
    for entry in shape.entries:
        step(entry, 0)
    warm = counter("UncachedCompile")
    aliased = met.metric_data("InputOutputAliasCount")
    started = time.perf_counter()
    for i in range(WARM_DECODE_STEPS):
        step("decode", shape.bucket + i)
    for entry in shape.prefill_entries:  # each bucket of the ladder again
        step(entry, 0)
    steady_s = time.perf_counter() - started
    caches = len(module.caches())
    found = GraphChecks(
        executed=True,
        compiles_at_warm_up=warm,
        compiles_after_warm_up=counter("UncachedCompile") - warm,
        steps_after_warm_up=WARM_DECODE_STEPS + len(shape.prefill_entries),
        host_fallbacks=sorted(met.executed_fallback_ops()),
        # one sample per compiled graph
        aliased_inputs_per_graph=[int(v) for _, v in aliased[2]] if aliased else [],
        caches=caches,
        steady_s=round(steady_s, 3),
    )
    problems = []
    if found.compiles_after_warm_up:
        problems.append(f"{found.compiles_after_warm_up} compilation(s) after the warm-up: a shape or a Python "
                        "scalar changes from step to step, so the compiler would build a graph per step")
    if found.host_fallbacks:
        problems.append(f"operators run on the host instead of in the graph: {found.host_fallbacks}")
    if found.aliased_inputs_per_graph != [caches] * len(shape.entries):
        problems.append(f"each graph must update the {caches} KV caches in place (aliased to its outputs), found "
                        f"{found.aliased_inputs_per_graph} per graph: a cache is copied on every step")
    if problems:
        raise BuildError("the lowered graphs " + "; ".join(problems))
    return found


# -- trace ------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class XlaTracedRank(TracedRank):
    """A rank this backend traced: also its graphs' records, how long each took to lower, and what running them
    showed."""

    graphs: dict[str, hlo.GraphRecord]
    lower_s: dict[str, float]
    checks: GraphChecks


def trace_ranks(checkpoint, shape: BuildShape, out_dir: Path) -> list[XlaTracedRank]:
    """Lower (and with one rank, run) every rank's graphs; write ``tp_<rank>.pt``. One process, rank after rank."""
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.plan import ShardPlan, load_rank_state
    from pipeline.recipe.spec import load_spec

    spec = load_spec(checkpoint.directory)
    plan = ShardPlan(spec, shape.tp_degree)
    ranks = []
    for rank in range(shape.tp_degree):
        started = time.monotonic()
        with Checkpoint(checkpoint.directory, checkpoint.text_prefix, checkpoint.head_key) as ckpt:
            state = load_rank_state(ckpt, plan, rank, shape.torch_dtype)
        module = rank_module(spec, shape, state)
        graphs, lower_s = {}, {}
        for entry in shape.entries:
            began = time.perf_counter()
            text = lower(module, spec, shape, entry)
            lower_s[entry] = round(time.perf_counter() - began, 3)
            check_operators(entry, text)
            graphs[entry] = hlo.record(text)
        if shape.tp_degree > 1:
            problems = collective_problems(module, graphs)
            if problems:
                raise BuildError(f"rank {rank} at tp_degree {shape.tp_degree}: " + "; ".join(problems))
            checks = GraphChecks(executed=False, why=TP_LIMIT)
        else:
            checks = run_checks(module, spec, shape)
        path = out_dir / f"tp_{rank}.pt"
        with reporting_full_disk(path, f"trace: rank {rank}"), open(path, "wb") as f:
            torch.save({"format": RANK_FORMAT, "config": configs(checkpoint.directory), "code": build_code_digest(),
                        "graphs": {e: g.to_json() for e, g in graphs.items()}, "state": state}, f)
            f.flush()
            os.fsync(f.fileno())
        del module, state
        gc.collect()
        ranks.append(XlaTracedRank(rank=rank, file=path.name, size=path.stat().st_size, sha256=sha256_file(path),
                                   peak_rss_bytes=peak_rss_bytes(), trace_s=round(time.monotonic() - started, 3),
                                   graphs=graphs, lower_s=lower_s, checks=checks))
    return ranks


def configs(checkpoint_dir: Path) -> dict[str, str]:
    """The checkpoint's config files, as text: what the loaded rank builds its module from."""
    return {name: (Path(checkpoint_dir) / name).read_text() for name in CONFIG_FILES
            if (Path(checkpoint_dir) / name).is_file()}


# -- load -------------------------------------------------------------------------------------------------------------

def read_rank(build: VerifiedBuild, rank: int) -> dict:
    """A rank file of a verified build: checked against the manifest and unchanged since, then read as tensors,
    strings and numbers only (no code runs)."""
    build.recheck()
    path = build.directory / f"tp_{rank}.pt"
    saved = torch.load(path, weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != RANK_FORMAT:
        raise IntegrityError(f"{path} is not a rank file of backend=xla ({RANK_FORMAT}): rebuild it with stage=trace")
    return saved


class LoadedRank:
    """One rank on the XLA device. A rank file holds weights, not code: it runs only under the code it was built
    from (the HLO hash alone would not notice, say, another norm epsilon: torch-xla passes such Python scalars as
    graph parameters). Each entry point is lowered on its first call and checked against the graph the trace
    recorded before it runs."""

    def __init__(self, saved: dict, shape: BuildShape):
        """``saved``: what ``read_rank`` read from a verified build."""
        from pipeline.recipe.spec import spec_from_config

        if saved.get("code") != build_code_digest():
            raise IntegrityError("this rank file was built by other code than this checkout's (backend=xla's build "
                                 "code digest differs): run it with the pipeline version that built it, or rebuild "
                                 "it with stage=trace")
        spec = spec_from_config(*(json.loads(saved["config"].get(name, "{}")) for name in CONFIG_FILES))
        self.spec, self.shape, self.graphs = spec, shape, saved["graphs"]
        self.module = rank_module(spec, shape, saved["state"])
        self.checked: set[str] = set()

    def step(self, entry: str, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            outputs = call(self.module, entry, [t.to(device()) for t in inputs])
        if entry not in self.checked:
            found = hlo.record(graph_hlo(outputs)).hlo_sha256
            if found != self.graphs[entry]["hlo_sha256"]:
                raise IntegrityError(f"the {entry} graph lowered at load (HLO sha256 {found[:12]}) is not the one "
                                     f"traced ({self.graphs[entry]['hlo_sha256'][:12]}): torch-xla or the shape "
                                     "changed since the build; rebuild it with stage=trace")
            self.checked.add(entry)
        write_back(self.module, outputs[1:])
        sync()
        logits = outputs[0].cpu()
        return logits, torch.argmax(logits, dim=-1)  # the greedy token on the host, as the neuron backend takes it

    def seed(self, caches: list[torch.Tensor], line: int = 0) -> None:
        """One sequence's caches into cache line ``line``: the whole cache is read back, changed there and placed on
        the device again (whole tensors only, as the neuron backend writes its state)."""
        for cache, value in zip(self.module.caches(), caches, strict=True):
            whole = value.to(cache.dtype)
            if cache.shape[0] > 1:  # a batch's caches: the other lines are in use
                whole = cache.data.cpu()
                whole[line:line + 1] = value.to(cache.dtype)
            cache.data = whole.to(device())

    def reset(self) -> None:
        for cache in self.module.caches():
            cache.data = torch.zeros(cache.shape, dtype=cache.dtype).to(device())


# -- the process ------------------------------------------------------------------------------------------------------

def serve(build, shape: BuildShape, conn) -> None:
    """Load the build's one rank and answer the runner (the rank runtime's protocol) until it says close."""
    rank = LoadedRank(read_rank(build, 0), shape)
    serve_commands(conn, 0, rank.step, rank.seed, rank.reset)


def main(rank: int, processes: int, init_file: str, job: TraceJob | ServeJob, conn) -> None:
    """The process's entry (``ranks.RankGroup``'s target), given a ``TraceJob`` or a ``ServeJob``. One process holds
    every rank (it lowers them one after the other)."""
    import multiprocessing as mp

    from pipeline.core.log import relay_output, setup
    from pipeline.host.procinfo import die_with_parent

    die_with_parent(parent=mp.parent_process().pid)  # never outlive a parent killed with SIGKILL
    setup()
    relay_output("pipeline.xla_ranks")  # the command's standard output is for its results
    try:
        tracing = isinstance(job, TraceJob)
        shape = job.request.shape if tracing else job.shape
        set_environment(shape.tp_degree, debug=tracing)  # the recipe lines are for the operator check
        if tracing:
            conn.send(Traced(tuple(trace_ranks(job.request.checkpoint, shape, Path(job.out_dir)))))
        else:
            serve(job.build, shape, conn)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        report_failure(conn, exc)
