"""Test stand-in for neuronx_distributed.trace's parallel_model_trace / save / load (tp_degree 1 only).

``func()`` returns ``(model, aliases)``; the model is traced with ``torch.jit.trace`` inside a wrapper whose first
parameters are the aliased ones, named ``states.N`` in output order, and written back in place after every call
(the real runtime keeps them on the NeuronCore). The wrapper returns output 0.
"""

import os
from pathlib import Path

import torch
from torch import nn

from neuronx_distributed.trace.model_builder import ModelBuilder, _states  # noqa: F401 - the real one exports it


class _StateWrapper(nn.Module):
    def __init__(self, model, aliases):
        super().__init__()
        order = sorted(aliases.items(), key=lambda item: item[1])
        self.states = nn.ParameterList([param for param, _ in order])  # registered first: named states.N
        self.indices = [index for _, index in order]
        self.model = model

    def forward(self, *inputs):
        outs = self.model(*inputs)
        for state, index in zip(self.states, self.indices):
            state.copy_(outs[index])
        return outs[0]


class TensorParallelNeuronModel:
    def __init__(self, models):
        self.models = list(models)
        self.tp_degree = len(self.models)

    def __call__(self, *tensors):
        return self.models[0](*tensors)


def _write_log(workdir, name, compiler_args):
    directory = Path(workdir or "/tmp/trace_compiler_workdir/") / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "log-neuron-cc.txt").write_text(f"stand-in compile, args: {compiler_args}\n")


def parallel_model_trace(func, example_inputs, states=None, compiler_workdir=None, compiler_args=None,
                         inline_weights_to_neff=True, bucket_config=None, tp_degree=1,
                         max_parallel_compilations=None, **kwargs):
    if tp_degree != 1:
        raise NotImplementedError("the test stand-in traces tp_degree 1 only")
    if os.environ.get("FAKE_NEURON_COMPILE_ERROR"):
        raise RuntimeError(os.environ["FAKE_NEURON_COMPILE_ERROR"])
    model, aliases = func()
    wrapper = _StateWrapper(model, aliases)
    initial = [state.detach().clone() for state in wrapper.states]
    with torch.no_grad():
        traced = torch.jit.trace(wrapper, tuple(example_inputs), check_trace=False)
        for state, value in zip(_states(traced), initial):
            state.copy_(value)  # tracing ran the example through the state
    _write_log(compiler_workdir, "_tp0", compiler_args)
    return TensorParallelNeuronModel([traced])


def parallel_model_save(model, save_dir):
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    for rank, rank_model in enumerate(model.models):
        torch.jit.save(rank_model, f"{save_dir}/tp_{rank}.pt")


def parallel_model_load(model_dir):
    # As the real loader: every file in the directory, ordered by the number in tp_<N>.pt (anything else crashes).
    names = sorted(os.listdir(model_dir), key=lambda name: int(name.replace(".pt", "").replace("tp_", "")))
    return TensorParallelNeuronModel([torch.jit.load(f"{model_dir}/{name}") for name in names])

