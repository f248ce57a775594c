"""Test stand-in for neuronx_distributed/trace/spmd.py: ``NxDModel`` (routing, initialisation) and
``NxDModelExecutor`` as the real ones behave at NxD v2.28.0, over the stand-in's per-rank graphs.

- ``NxDModel.router``: the key is ``str`` of the list of input shapes; a miss raises ``ValueError("Input shape ...
  not found in input_shape_map: ...")`` (~216), which reaches Python as ``torch.jit.Error``.
- ``forward`` before ``initialize_with_saved_weights`` raises the real "This model is not initialized" ``ValueError``
  (``SPMDBucketModelScript.forward`` ~35). Initialisation lives in the process (the stand-in runtime), not in the
  saved file, as the real ``SPMDModel`` objects' does.
- Every rank runs at once (``torch.jit.fork``), sharing collectives through the stand-in runtime; the result is
  rank 0's list of non-aliased outputs (ModelBuilder's packer's list).
"""


import torch
import torch_neuronx  # noqa: F401 - registers torch.ops.neuron, as the real module imports it


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
        own = {id(p) for p in model.parameters()}
        for param in aliases:
            if not isinstance(param, torch.nn.Parameter) or id(param) not in own:
                raise ValueError("input_output_aliases keys must be parameters of the module get() returned")
        self.states = torch.nn.ParameterList(list(aliases))
        self.indices = list(aliases.values())
        self.model = model
        self.return_aliased = return_aliased

    def forward(self, *inputs):
        outs = self.model(*inputs)
        for state, index in zip(self.states, self.indices):
            state.copy_(outs[index])
        if self.return_aliased:
            return tuple(out if i not in self.indices else out.clone() for i, out in enumerate(outs))
        kept = [out for i, out in enumerate(outs) if i not in self.indices]
        return kept[0] if len(kept) == 1 else tuple(kept)


class RankGraphs(torch.nn.Module):
    """One rank's graph per key (sharing weights and state), each taking four inputs."""

    def __init__(self, graphs: dict[str, torch.nn.Module]):
        super().__init__()
        self.graphs = torch.nn.ModuleDict(graphs)

    def forward(self, key: str, inputs: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(0)
        for name, graph in self.graphs.items():  # TorchScript cannot index a ModuleDict by a variable
            if name == key:
                out = graph(inputs[0], inputs[1], inputs[2], inputs[3])
        return out


class RankGraphs5(RankGraphs):
    """The same, each graph taking five inputs (TorchScript checks a call's arity against each graph's signature)."""

    def forward(self, key: str, inputs: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(0)
        for name, graph in self.graphs.items():
            if name == key:
                out = graph(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4])
        return out


def rank_graphs(graphs: dict[str, torch.nn.Module], inputs: int) -> torch.nn.Module:
    """``RankGraphs`` for graphs of ``inputs`` inputs (the stand-in builds graphs of four or five)."""
    kinds = {4: RankGraphs, 5: RankGraphs5}
    if inputs not in kinds:
        raise NotImplementedError(f"the stand-in builds graphs of 4 or 5 inputs, not {inputs}")
    return kinds[inputs](graphs)


class NxDModel(torch.nn.Module):
    def __init__(self, ranks: torch.nn.ModuleList, input_shape_map: dict[str, tuple[str, int]], model_id: str,
                 world_size: int, input_dtypes: dict[str, list[torch.Tensor]]):
        super().__init__()
        self.ranks = ranks
        self.input_shape_map = input_shape_map
        # Per route, an empty tensor of each traced input's dtype. NxD routes by shape alone (~215-219) and converts
        # nothing; the SPMDModel and the runtime are closed source, and the metaneff they are given holds every
        # input's data type ("used by the runtime to validate input tensor shapes, names, and types", torch-neuronx
        # 1.x hlo_metaneff): a call with another dtype is refused here, never cast.
        self.input_dtypes = input_dtypes
        self.model_id = model_id
        self.world_size = world_size
        # Every rank's weights, {checkpoint key: tensor} per rank, as the real one keeps them (~167: the placeholder
        # until initialize() fills it); ModelBuilder.trace(initialize_model_weights=True) fills it here, and
        # torch.jit.save writes it with the model. (The stand-in's rank graphs also hold them as their parameters,
        # the same storages, which the real SPMDModels do not.)
        self.weights = [{'__neuronprivatetensor__': torch.tensor(0)}]  # List[Dict[str, Tensor]], TorchScript infers

    @torch.jit.export
    def initialize_with_saved_weights(self, start_rank_tensor: torch.Tensor):
        start_rank = torch.ops.aten.Int(start_rank_tensor)
        if torch.ops.neuron.fake_claim_cores(self.model_id, start_rank, self.world_size) != self.world_size:
            raise ValueError("could not load the model onto its NeuronCores")

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
        for i, rank in enumerate(self.ranks):
            if i > 0:
                futures.append(torch.jit.fork(rank, model_name, inputs))
        result = torch.zeros(0)
        for i, rank in enumerate(self.ranks):
            if i == 0:
                result = rank(model_name, inputs)
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
