"""Test stand-in for ModelBuilder v1 (tp_degree 1, keys ``prefill`` and ``decode``).

As the real one: ``trace()`` wipes ``compiler_workdir``; every key's module comes from the same instance
(``load_module()`` then ``get(0)``); the checkpoint is loaded into **parameters only** (buffers keep the values
``load_module()`` gave them); weights and aliased state are shared by all keys; calls are routed by input shape; and a
model must be initialised (``initialize_with_saved_weights``) before it runs.
"""

import os
import shutil
from pathlib import Path

import torch
from torch import nn

KEYS = ("prefill", "decode")


class _Graphs(nn.Module):
    def __init__(self, model, aliases):
        super().__init__()
        order = sorted(aliases.items(), key=lambda item: item[1])
        self.states = nn.ParameterList([param for param, _ in order])
        self.indices = [index for _, index in order]
        self.model = model

    def _run(self, embeds, per_layer_tokens, positions, last_index):
        outs = self.model(embeds, per_layer_tokens, positions, last_index)
        for state, index in zip(self.states, self.indices):
            state.copy_(outs[index])
        return outs[0]

    def prefill(self, embeds, per_layer_tokens, positions, last_index):
        return self._run(embeds, per_layer_tokens, positions, last_index)

    def decode(self, embeds, per_layer_tokens, positions, last_index):
        return self._run(embeds, per_layer_tokens, positions, last_index)


class _NxDModel(nn.Module):
    def __init__(self, graphs, prefill_tokens: int):
        super().__init__()
        self.graphs = graphs
        self.prefill_tokens = prefill_tokens
        self.initialized = False

    @torch.jit.export
    def initialize_with_saved_weights(self, start_rank_tensor: torch.Tensor):
        self.initialized = True

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.initialized:
            raise RuntimeError("This model is not initialized, please call "
                               "traced_model.nxd_model.initialize_with_saved_weights()")
        tokens = inputs[0].size(1)
        if tokens == 1:
            return [self.graphs.decode(inputs[0], inputs[1], inputs[2], inputs[3])]
        if tokens == self.prefill_tokens:
            return [self.graphs.prefill(inputs[0], inputs[1], inputs[2], inputs[3])]
        raise RuntimeError("no graph for these input shapes")


class _Executor(nn.Module):
    def __init__(self, nxd_model):
        super().__init__()
        self.nxd_model = nxd_model

    def forward(self, embeds, per_layer_tokens, positions, last_index) -> list[torch.Tensor]:
        return self.nxd_model([embeds, per_layer_tokens, positions, last_index])


class ModelBuilder:
    def __init__(self, router, tp_degree, checkpoint_loader, compiler_workdir=None, **kwargs):
        if tp_degree != 1:
            raise NotImplementedError("the test stand-in builds tp_degree 1 only")
        self.checkpoint_loader = checkpoint_loader
        self.compiler_workdir = compiler_workdir or "/tmp/nxd_model/"
        self.models = {}

    def add(self, key, model_instance, example_inputs, compiler_args=None, bucket_config=None,
            priority_model_idx=None):
        if compiler_args is not None and not isinstance(compiler_args, str):
            raise TypeError("ModelBuilder v1 appends flags to compiler_args with +=: pass a string")
        if key not in KEYS or len(example_inputs) != 1:
            raise NotImplementedError(f"the test stand-in builds keys {KEYS}, one bucket each")
        self.models[key] = (model_instance, example_inputs[0], compiler_args)
        return self

    def trace(self, initialize_model_weights=True, dry_run=False):
        if os.path.exists(self.compiler_workdir):
            shutil.rmtree(self.compiler_workdir)
        if os.environ.get("FAKE_NEURON_COMPILE_ERROR"):
            raise RuntimeError(os.environ["FAKE_NEURON_COMPILE_ERROR"])
        for key, (instance, _, args) in self.models.items():
            instance.load_module()
            directory = Path(self.compiler_workdir) / key / "_tp0_bk0"
            directory.mkdir(parents=True)
            (directory / "log-neuron-cc.txt").write_text(f"stand-in compile, args: {args}\n")
        module, aliases = instance.get(0)
        checkpoint = self.checkpoint_loader()
        state_names = {id(param) for param in aliases}
        with torch.no_grad():
            for name, param in module.named_parameters():
                if id(param) in state_names:
                    param.zero_()  # the real StateInitializer starts every state at zero
                elif name in checkpoint:
                    param.copy_(checkpoint[name].to(param.dtype))
                else:
                    raise KeyError(f"checkpoint has no weight {name}")
        graphs = _Graphs(module, aliases)
        initial = [state.detach().clone() for state in graphs.states]
        examples = {key: tuple(example) for key, (_, example, _) in self.models.items()}
        with torch.no_grad():
            traced = torch.jit.trace_module(graphs, examples, check_trace=False)
            for state, value in zip(_states(traced), initial):
                state.copy_(value)
        prefill_tokens = int(examples["prefill"][0].shape[1])
        return torch.jit.script(_Executor(_NxDModel(traced, prefill_tokens)))


def _states(module):
    """The ``states.N`` parameters of a traced module, by N."""
    found = [(int(name.split(".")[1]), param) for name, param in module.named_parameters()
             if name.startswith("states.")]
    return [param for _, param in sorted(found, key=lambda item: item[0])]
