"""Test stand-in for neuronx_distributed/trace/spmd.py: ``NxDModel`` (routing, initialisation) and
``NxDModelExecutor`` as the real ones behave at NxD v2.28.0, over the stand-in's SPMD graphs (one per key, run by
every rank with that rank's weights and state, which only ``NxDModel`` holds).

- ``NxDModel.router``: the key is ``str`` of the list of input shapes; a miss raises ``ValueError("Input shape ...
  not found in input_shape_map: ...")`` (~216), which reaches Python as ``torch.jit.Error``.
- ``forward`` before ``initialize_with_saved_weights`` raises the real "This model is not initialized" ``ValueError``
  (``SPMDBucketModelScript.forward`` ~35). Initialisation lives in the process (the stand-in runtime), not in the
  saved file, as the real ``SPMDModel`` objects' does.
- Every rank runs at once (``torch.jit.fork``), sharing collectives through the stand-in runtime; the result is
  rank 0's list of non-aliased outputs (ModelBuilder's packer's list).
- ``StateGraph``: ``parallel_model_trace``'s per-rank graphs, which do hold their weights and state.
"""


import contextlib

import torch
import torch_neuronx  # noqa: F401 - registers torch.ops.neuron, as the real module imports it

from neuronx_distributed.parallel_layers import parallel_state


def aliased(model: torch.nn.Module, aliases) -> dict[str, int]:
    """``aliases`` (``{parameter: output index}``) by the parameters' names, in the dict's insertion order
    (torch-neuronx takes ``tuple(input_output_aliases.keys())``); refused unless every key is a parameter of
    ``model``."""
    names = {id(p): n for n, p in model.named_parameters()}
    for param in aliases:
        if not isinstance(param, torch.nn.Parameter) or id(param) not in names:
            raise ValueError("input_output_aliases keys must be parameters of the module get() returned")
    return {names[id(p)]: i for p, i in aliases.items()}


def slot(model: torch.nn.Module, name: str) -> tuple[dict, str]:
    """Where ``model``'s parameter or buffer ``name`` is held: its owner's table and its key there."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    return (owner._parameters if attr in owner._parameters else owner._buffers), attr


def written_back(outs, states, indices: list[int]):
    """The runtime's input-output aliasing: each aliased output copied into its state; the other outputs, one
    tensor or a tuple."""
    for state, index in zip(states, indices):
        state.copy_(outs[index])
    kept = [out for i, out in enumerate(outs) if i not in indices]
    return kept[0] if len(kept) == 1 else tuple(kept)


class StateGraph(torch.nn.Module):
    """What the stand-in's compiler makes of a module and its ``{parameter: output index}`` aliases (both trace
    paths): the aliased parameters become ``states.N`` in the alias dict's insertion order (torch-neuronx takes
    ``tuple(input_output_aliases.keys())``), written back after each call as the runtime's input-output aliasing
    does. ``return_aliased``: the aliased outputs are returned too, each a tensor of its own (the runtime hands back
    every output buffer): ``parallel_model_trace``'s graphs, whose metaneff lists every output (torch-neuronx 1.x
    ``hlo_metaneff``). ModelBuilder's packer leaves them out (NxD v2.28.0 model_builder.py ~1026-1032: only outputs
    not in ``metaneff.output_aliases_to``; it traces with ``output_aliased_tensor=False``, ~889-896)."""

    def __init__(self, model, aliases, return_aliased: bool):
        super().__init__()
        aliased(model, aliases)
        self.states = torch.nn.ParameterList(list(aliases))
        self.indices = list(aliases.values())
        self.model = model
        self.return_aliased = return_aliased

    def forward(self, *inputs):
        outs = self.model(*inputs)
        kept = written_back(outs, self.states, self.indices)
        if self.return_aliased:
            return tuple(out if i not in self.indices else out.clone() for i, out in enumerate(outs))
        return kept


@contextlib.contextmanager
def _bound(model: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """``model``'s parameters and buffers of these names replaced by these tensors for the duration (what
    ``torch.func.functional_call`` does, which refuses to run under ``torch.jit.trace``)."""
    saved = []
    for name, tensor in tensors.items():
        table, attr = slot(model, name)
        saved.append((table, attr, table[attr]))
        table[attr] = tensor
    try:
        yield
    finally:
        for table, attr, tensor in saved:
            table[attr] = tensor


class SpmdGraph(torch.nn.Module):
    """What the stand-in's compiler makes of one key's module for ModelBuilder: a graph taking the user inputs, then
    one list of the rank's weights, its state (``weight_names`` then ``state_names``) and its rank, the input its
    collectives are given (NxD's ``SPMDRank`` is a weight holding each rank's number), as an SPMDModel is given
    ``initialize(states, weights, ...)`` and holds neither in the NEFF (trace/spmd.py ~167-191 at v2.28.0). The
    aliased outputs are written into the state in place (the runtime's input-output aliasing) and left out of the
    result (ModelBuilder's packer, model_builder.py ~1026-1032)."""

    def __init__(self, model, weight_names: list[str], states: dict[str, int]):
        super().__init__()
        self.model = model
        self.weight_names, self.state_names = weight_names, list(states)  # states: ``aliased``'s
        self.indices = list(states.values())

    def forward(self, *inputs):
        *user, bound = inputs  # one list (torch.jit.trace refuses an empty one: a model may have no state)
        *tensors, rank = bound
        parallel_state._set_rank_input(rank)
        try:
            with _bound(self.model, dict(zip(self.weight_names + self.state_names, tensors))):
                outs = self.model(*user)
        finally:
            parallel_state._set_rank_input(None)
        return written_back(outs, tensors[len(self.weight_names):], self.indices)


class SpmdGraphs(torch.nn.Module):
    """Every key's graph, traced once and run by every rank (SPMD: one NEFF per bucket, ``_tp0_bk0``), each call with
    that rank's weights and state; its four-input form (``SpmdGraphs5``: five). ``weight_shapes``/``state_shapes``
    and the dtypes of the empty ``*_dtypes`` tensors are what was traced."""

    weight_names: list[str]
    weight_shapes: list[list[int]]
    weight_dtypes: list[torch.Tensor]
    state_names: list[str]
    state_shapes: list[list[int]]
    state_dtypes: list[torch.Tensor]

    def __init__(self, graphs: dict[str, torch.nn.Module], weights: dict[str, torch.Tensor],
                 state: dict[str, torch.Tensor]):
        super().__init__()
        self.graphs = torch.nn.ModuleDict(graphs)
        self.weight_names = list(weights)
        self.weight_shapes = [list(t.shape) for t in weights.values()]
        self.weight_dtypes = [torch.empty(0, dtype=t.dtype) for t in weights.values()]
        self.state_names = list(state)
        self.state_shapes = [list(t.shape) for t in state.values()]
        self.state_dtypes = [torch.empty(0, dtype=t.dtype) for t in state.values()]

    @torch.jit.export
    def unfit(self, weights: dict[str, torch.Tensor]) -> list[str]:
        """The traced weights ``weights`` lacks or holds in another shape or dtype, each said."""
        said: list[str] = []
        for i in range(len(self.weight_names)):
            name = self.weight_names[i]
            if name not in weights:
                said.append("the checkpoint has no weight " + name)
            elif (list(weights[name].shape) != self.weight_shapes[i]
                  or weights[name].dtype != self.weight_dtypes[i].dtype):
                said.append(name + " is " + str(weights[name].dtype) + str(list(weights[name].shape)) + ", traced as "
                            + str(self.weight_dtypes[i].dtype) + str(self.weight_shapes[i]))
        return said

    @torch.jit.export
    def new_state(self) -> dict[str, torch.Tensor]:
        """One rank's state at zero (StateInitializer, spmd.py ~71-140)."""
        state: dict[str, torch.Tensor] = {}
        for i in range(len(self.state_names)):
            state[self.state_names[i]] = torch.zeros(self.state_shapes[i], dtype=self.state_dtypes[i].dtype)
        return state

    def bound(self, rank: int, weights: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [weights[n] for n in self.weight_names] + [state[n] for n in self.state_names] + [torch.tensor(rank)]

    def forward(self, rank: int, key: str, inputs: list[torch.Tensor], weights: dict[str, torch.Tensor],
                state: dict[str, torch.Tensor]) -> torch.Tensor:
        bound = self.bound(rank, weights, state)
        out = torch.zeros(0)
        for name, graph in self.graphs.items():  # TorchScript cannot index a ModuleDict by a variable
            if name == key:
                out = graph(inputs[0], inputs[1], inputs[2], inputs[3], bound)
        return out


class SpmdGraphs5(SpmdGraphs):
    """The same, each graph taking five inputs (TorchScript checks a call's arity against each graph's signature)."""

    def forward(self, rank: int, key: str, inputs: list[torch.Tensor], weights: dict[str, torch.Tensor],
                state: dict[str, torch.Tensor]) -> torch.Tensor:
        bound = self.bound(rank, weights, state)
        out = torch.zeros(0)
        for name, graph in self.graphs.items():
            if name == key:
                out = graph(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], bound)
        return out


def spmd_graphs(graphs, weights, state, inputs: int) -> torch.nn.Module:
    """``SpmdGraphs`` for graphs of ``inputs`` user inputs (the stand-in builds graphs of four or five)."""
    kinds = {4: SpmdGraphs, 5: SpmdGraphs5}
    if inputs not in kinds:
        raise NotImplementedError(f"the stand-in builds graphs of 4 or 5 inputs, not {inputs}")
    return kinds[inputs](graphs, weights, state)


class NxDModel(torch.nn.Module):
    def __init__(self, graphs: torch.nn.Module, input_shape_map: dict[str, tuple[str, int]], model_id: str,
                 world_size: int, input_dtypes: dict[str, list[torch.Tensor]]):
        super().__init__()
        self.graphs = graphs
        self.input_shape_map = input_shape_map
        # Per route, an empty tensor of each traced input's dtype. NxD routes by shape alone (~215-219) and converts
        # nothing; the SPMDModel and the runtime are closed source, and the metaneff they are given holds every
        # input's data type ("used by the runtime to validate input tensor shapes, names, and types", torch-neuronx
        # 1.x hlo_metaneff): a call with another dtype is refused here, never cast.
        self.input_dtypes = input_dtypes
        self.model_id = model_id
        self.world_size = world_size
        # Every rank's weights and state, {name: tensor} per rank, as the real one keeps them (~166-168: placeholders
        # until initialize() fills them); torch.jit.save writes them with the model. The graphs hold neither.
        self.weights = [{'__neuronprivatetensor__': torch.tensor(0)}]  # List[Dict[str, Tensor]], TorchScript infers
        self.state = [{'__neuronprivatetensor__': torch.tensor(0)}]

    @torch.jit.export
    def initialize(self, checkpoint: list[dict[str, torch.Tensor]], start_rank_tensor: torch.Tensor):
        """Each rank's sharded checkpoint becomes its weights (~170-180; the real one lays them out on the device
        through its weight loader), then as ``initialize_with_saved_weights``."""
        self.weights = checkpoint
        self.initialize_with_saved_weights(start_rank_tensor)

    @torch.jit.export
    def initialize_with_saved_weights(self, start_rank_tensor: torch.Tensor):
        """The saved weights and a new state (StateInitializer) to every rank's SPMDModel (~182-193), which holds
        them for the process. The SPMDModel is closed source: the stand-in refuses weights that do not match what
        was traced (missing, another shape or dtype: the placeholder of a model traced without
        ``initialize_model_weights`` among them), which a NEFF cannot run with."""
        if len(self.weights) != self.world_size:
            raise ValueError("the model has weights for " + str(len(self.weights)) + " ranks, not its "
                             + str(self.world_size) + ": trace with initialize_model_weights=True or call "
                             "nxd_model.initialize(sharded_checkpoints, start_rank)")
        for rank in range(self.world_size):
            unfit = self.graphs.unfit(self.weights[rank])
            if len(unfit) > 0:
                raise ValueError("rank " + str(rank) + ": " + "; ".join(unfit))
        start_rank = torch.ops.aten.Int(start_rank_tensor)
        if torch.ops.neuron.fake_claim_cores(self.model_id, start_rank, self.world_size) != self.world_size:
            raise ValueError("could not load the model onto its NeuronCores")
        self.state = [self.graphs.new_state() for _ in range(self.world_size)]

    def router(self, inputs: list[torch.Tensor]) -> tuple[str, int]:
        actual_shape = str([tensor.shape for tensor in inputs])
        if actual_shape not in self.input_shape_map:
            raise ValueError(f"Input shape {actual_shape} not found in input_shape_map: {self.input_shape_map.keys()}")
        return self.input_shape_map[actual_shape]

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if not torch.ops.neuron.fake_is_initialized(self.model_id):
            raise ValueError("This model is not initialized, please call traced_model.nxd_model.initialize("
                             "sharded_checkpoint) or traced_model.nxd_model.initialize_with_saved_weights()")
        model_name, bucket_idx = self.router(inputs)
        traced = self.input_dtypes[str([tensor.shape for tensor in inputs])]
        for i in range(len(inputs)):
            if inputs[i].dtype != traced[i].dtype:
                raise ValueError("input " + str(i) + " of " + model_name + " is " + str(inputs[i].dtype)
                                 + ", the graph was traced with " + str(traced[i].dtype))
        futures: list[torch.jit.Future[torch.Tensor]] = []
        for rank in range(1, self.world_size):
            futures.append(torch.jit.fork(self.graphs, rank, model_name, inputs, self.weights[rank],
                                          self.state[rank]))
        result = self.graphs(0, model_name, inputs, self.weights[0], self.state[0])
        for future in futures:
            torch.jit.wait(future)
        return [result]


class NxDModelExecutor(torch.nn.Module):
    """Called like the traced model, ``model(*inputs)``. The real one's ``forward(self, *inputs)`` passes
    ``list(inputs)`` on (spmd.py ~290-291), and ModelBuilder ``torch.jit.trace``s it with the last key's example inputs
    (model_builder.py ~1064-1069, ~1091), so the saved executor takes exactly that many: the stand-in's executor is
    scripted for that count (four here, five in ``NxDModelExecutor5``), and a call with another count is refused."""

    def __init__(self, nxd_model):
        super().__init__()
        self.nxd_model = nxd_model

    def forward(self, a, b, c, d) -> list[torch.Tensor]:
        return self.nxd_model([a, b, c, d])


class NxDModelExecutor5(NxDModelExecutor):
    def forward(self, a, b, c, d, e) -> list[torch.Tensor]:
        return self.nxd_model([a, b, c, d, e])


def executor(nxd_model, inputs: int) -> torch.nn.Module:
    """The executor of ``nxd_model`` taking ``inputs`` tensors (the last key's count)."""
    kinds = {4: NxDModelExecutor, 5: NxDModelExecutor5}
    if inputs not in kinds:
        raise NotImplementedError(f"the stand-in builds executors of 4 or 5 inputs, not {inputs}")
    return kinds[inputs](nxd_model)
