"""Test stand-in for neuronx_distributed/trace/trace.py: ``parallel_model_trace``, ``parallel_model_save``,
``parallel_model_load`` and ``TensorParallelNeuronModel``, with the signatures and the behaviour of NxD v2.28.0 that
the pipeline depends on:

- ``parallel_model_trace`` sets ``MASTER_ADDR=localhost`` and ``MASTER_PORT=2022`` in its own environment, spawns one
  process per rank (``multiprocessing`` spawn context: ``func`` and the example inputs must pickle), initialises
  torch.distributed and ``parallel_state.initialize_model_parallel(tp_degree)`` there, calls ``func()`` with
  ``NXD_SKIP_RENDEZVOUS`` set, and traces the returned module with its ``{parameter: output index}`` aliases. The
  stand-in's process group is gloo on that port, so collectives run for real while tracing, and two traces at once
  collide on the port as the real ones do.
- Aliased parameters become the rank's ``states.N`` parameters in the alias dict's insertion order; after each call
  the aliased outputs are written back into them (the runtime's input-output aliasing), and still returned: every
  output of the graph, aliased or not, is in its metaneff and the packer returns them all (the only public copy of
  torch-neuronx's trace, 1.x: ``hlo_metaneff`` lists every result, ``forward`` returns ``self.packer(result)``).
- The compiler (``_fake_runtime.compile_graph``) runs in the current directory, which must exist, and logs its command
  there (issue #13; the 1.x copy runs neuronx-cc without ``--logfile``); the rank's graph goes under
  ``compiler_workdir/_tp<rank>/``.
- ``TensorParallelNeuronModel`` loads itself on its first forward (``_load``: the cores, then
  ``torch_neuronx.move_trace_to_device`` per rank, which replaces the ``states.N`` parameters), runs every rank in a
  thread pool and returns the result of the rank that finished first (``results[0]`` of ``as_completed``).
- ``parallel_model_save`` writes ``tp_<rank>.pt``; ``parallel_model_load`` loads every file of the directory, sorted
  by the number in ``tp_<N>.pt`` (any other file name crashes it).
"""

import concurrent.futures
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch_neuronx
from torch_neuronx import _fake_runtime

from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.trace.spmd import StateGraph

NXD_SKIP_RENDEZVOUS = "NXD_SKIP_RENDEZVOUS"
LOG_NAME = "log-neuron-cc.txt"


class ParallelModel(torch.nn.Module):
    def __init__(self):
        super().__init__()


class TensorParallelNeuronModel(ParallelModel):
    def __init__(self, models):
        super().__init__()
        self.models = torch.nn.ModuleList(models)
        self.load = False
        self.tp_degree = len(models)
        self.executor = None  # Initialized with the first forward call

    def _load(self):
        _fake_runtime.claim_cores(self.tp_degree)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=self.tp_degree)
        for i, model in enumerate(self.models):
            torch_neuronx.move_trace_to_device(model, i)
        self.load = True

    def forward(self, *tensors):
        if not self.load:
            self._load()
        futures = [self.executor.submit(model, *tensors) for model in self.models]
        results = [future.result() for future in concurrent.futures.as_completed(futures)]
        return results[0]

    def __del__(self):
        if self.executor:
            self.executor.shutdown()


def _get_model_shard(func, func_kwargs=None):
    if func_kwargs is None:
        func_kwargs = {}
    if NXD_SKIP_RENDEZVOUS in os.environ:
        raise ValueError("NXD_SKIP_RENDEZVOUS is a reserved environment variable. Its should not be set outside "
                         "parallel_model_trace")
    os.environ[NXD_SKIP_RENDEZVOUS] = "1"
    try:
        return func(**func_kwargs)
    finally:
        del os.environ[NXD_SKIP_RENDEZVOUS]


def _trace_rank(rank, func, example_inputs, compiler_workdir, compiler_args, tp_degree, group, queue):
    try:
        os.environ["RANK"] = str(rank)
        os.environ["FAKE_NXD_GROUP"] = group
        torch.distributed.init_process_group("gloo", init_method="env://", rank=rank, world_size=tp_degree,
                                             timeout=datetime.timedelta(seconds=120))
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_degree)
        out = pathlib.Path(compiler_workdir) / f"_tp{rank}"
        _fake_runtime.compile_graph(out / "graph.hlo", out / "graph.neff", compiler_args)  # the log: cwd, no --logfile
        if os.environ.get("FAKE_NEURON_COMPILE_ERROR"):
            with open(LOG_NAME, "a") as log:
                log.write(f"ERROR: {os.environ['FAKE_NEURON_COMPILE_ERROR']}\n")
            raise RuntimeError(os.environ["FAKE_NEURON_COMPILE_ERROR"])
        model, aliases = _get_model_shard(func)
        wrapper = StateGraph(model, aliases, return_aliased=True)
        initial = [state.detach().clone() for state in wrapper.states]
        with torch.no_grad():
            traced = torch.jit.trace(wrapper, tuple(example_inputs), check_trace=False)
            for (_, state), value in zip(sorted(((int(n.split(".")[1]), p) for n, p in traced.named_parameters()
                                                 if n.startswith("states.")), key=lambda item: item[0]), initial):
                state.copy_(value)  # tracing ran the example through the state; the compiled graph starts clean
        out.mkdir(parents=True, exist_ok=True)
        torch.jit.save(traced, str(out / "graph.pt"))
        queue.put(("ok", rank, str(out / "graph.pt")))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, as xmp.spawn re-raises a child's failure
        queue.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def parallel_model_trace(
    func: Callable | torch.nn.Module,
    example_inputs: Any,
    states=None,
    compiler_workdir: str | pathlib.Path | None = None,
    compiler_args: list[str] | str | None = None,
    inline_weights_to_neff: bool = True,
    bucket_config=None,
    tp_degree: int = 1,
    max_parallel_compilations: int | None = None,
    spmd_mode: bool = False,
    checkpoint_loader_callable: Callable | None = None,
    force_custom_init_on_device: bool = False,
    serialization_path: str | None = None,
) -> ParallelModel:
    if bucket_config is not None or spmd_mode or states is not None:
        raise NotImplementedError("the stand-in traces non-SPMD models without buckets or external states")
    ctx = multiprocessing.get_context("spawn")
    os.environ["MASTER_ADDR"] = "localhost"
    # 2022 as in the real one; the tests' harness moves it per pytest-xdist worker (tests/fake_sdk.py:trace_port)
    os.environ["MASTER_PORT"] = os.environ.get("FAKE_NEURON_TRACE_PORT", "2022")
    os.environ["WORLD_SIZE"] = str(tp_degree)
    workdir = compiler_workdir if compiler_workdir is not None else "/tmp/trace_compiler_workdir/"
    logging.warning("Using non SPMD mode. Set spmd_mode=True if the workload is SPMD for a faster trace. Tracing in "
                    "non SPMD mode for large models can run into OOM errors as we compile all ranks")
    queue = ctx.SimpleQueue()
    group = uuid.uuid4().hex
    procs = [ctx.Process(target=_trace_rank, args=(rank, func, example_inputs, str(workdir), compiler_args,
                                                    tp_degree, group, queue)) for rank in range(tp_degree)]
    for proc in procs:
        proc.start()
    _join_or_stop_all(procs)
    results = {}
    while not queue.empty():
        status, rank, payload = queue.get()
        if status == "error":
            raise RuntimeError(f"process {rank} terminated with an error: {payload}")
        results[rank] = payload
    failed = [rank for rank, proc in enumerate(procs) if proc.exitcode != 0]
    if failed or len(results) != tp_degree:
        raise RuntimeError(f"process {failed} terminated with exit codes {[p.exitcode for p in procs]}")
    return TensorParallelNeuronModel([torch.jit.load(results[rank]) for rank in range(tp_degree)])


def _join_or_stop_all(procs) -> None:
    """Wait for every rank; when one fails, stop the others (as torch.multiprocessing.spawn, under xmp.spawn, does)."""
    pending = list(procs)
    while pending:
        ready = multiprocessing.connection.wait([p.sentinel for p in pending])
        for proc in [p for p in pending if p.sentinel in ready]:
            proc.join()
            pending.remove(proc)
            if proc.exitcode != 0:
                for other in pending:
                    other.terminate()
                for other in pending:
                    other.join()
                return  # every rank has ended (two failing at once must not be removed twice)


def parallel_model_save(model: ParallelModel, save_dir: str) -> None:
    pathlib.Path(save_dir).mkdir(parents=True, exist_ok=True)
    for i, rank_model in enumerate(model.models):
        torch.jit.save(rank_model, f"{save_dir}/tp_{i}.pt")


def parallel_model_load(model_dir: str) -> ParallelModel:
    models = []
    with torch_neuronx.contexts.disable_nrt_load():
        names = sorted(os.listdir(model_dir), key=lambda x: int(x.replace(".pt", "").replace("tp_", "")))
        for name in names:
            models.append(torch.jit.load(f"{model_dir}/{name}"))
    return TensorParallelNeuronModel(models)
