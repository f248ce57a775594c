"""Test stand-in for ModelBuilder v1 (neuronx_distributed/trace/model_builder.py at NxD v2.28.0), tp_degree 1 or more.

What it does as the real one does (line numbers at v2.28.0):
- ``__init__``, ``add`` and ``trace`` take exactly the real parameters (no ``**kwargs``); ``__init__`` refuses a
  torch-neuronx that is not 2.x (~457).
- ``add`` passes ``compiler_args`` through ``append_default_compiler_flags`` (~104-124): a string, the seed's flags
  kept, ``--auto-cast=none`` / ``-O1`` / ``--verbose=35`` appended when absent; a list raises ``TypeError``. The
  installed release decides (``neuronx_distributed.__version__``): ``--verbose=35`` from 0.16 (SDK 2.27), the
  function from 0.13 (0.12 fills in defaults only for None), ``compiler_flag_hook`` from 0.15 (SDK 2.26).
- ``trace`` deletes ``compiler_workdir`` first (~545), gives each graph's final flags to ``compiler_flag_hook`` (~724,
  on a cache hit too) and compiles it through the compile cache, always on (``_fake_runtime.compile_cached``: a hit
  runs no compiler and writes no log; a miss runs it in the current directory, which must still exist, its log under
  ``<workdir>/<key>/_tp0_bk0/`` with the ``--logfile`` the real one adds, ~720), builds every key's module from its
  instance (``load_module()`` then ``get(0)``) as rank 0 of the world (the real one builds under ``mock_distributed``
  after ``init_process_group(rank=0)``, ~551-556) and traces it once: the SPMD graph every rank runs, taking that
  rank's weights, state and rank as inputs and holding none of them (collectives only produce shapes while it is
  traced). With ``initialize_model_weights`` it writes every rank's slice of the checkpoint (cut along each parallel
  weight's ``partition_dim``, its parameters cast to the module's dtypes, ``cast_weights`` ~786-800) into
  ``<workdir>/tp{rank}_sharded_checkpoint.safetensors`` and gives them, loaded back, to ``nxd_model.initialize``
  (~764-781, ~984); without it the checkpoint loader is never called. The weights are the module's ``state_dict()``
  keys but its states: parameters and persistent buffers alike (NxD trims the checkpoint to ``model.state_dict()``
  keys, trace/trace.py ~628-644, and torch-neuronx's closed ``generate_hlo`` decides whether a read-only buffer is a
  weight input or a constant: the stand-in takes the stricter reading, a weight the checkpoint must hold, refused at
  initialisation when it lacks one); the state (aliased parameters) starts at zero (``StateInitializer``).
- Every key shares one weight set and one state (the keys' modules must have the same weights and state); calls are
  routed by the list of input shapes, a miss is a TorchScript ``ValueError`` (``spmd.py`` ~216); the model must be
  initialised (``initialize_with_saved_weights``) in the process that runs it, which takes the NeuronCores;
  ``trace(initialize_model_weights=True)`` does so itself (~776-781).
- The returned executor is TorchScript that calls ``torch.ops.neuron`` ops: loading it saved needs ``torch_neuronx``
  imported first (the real file holds ``torch.classes.neuron.SPMDModel`` objects, registered by torch_neuronx).
"""

import contextlib
import logging
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch_neuronx
from safetensors.torch import load_file, save_file
from torch_neuronx import _fake_runtime

from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.trace.spmd import NxDModel, SpmdGraph, aliased, executor, slot, spmd_graphs

logger = logging.getLogger("Neuron")
LOG_FILE_DEFAULT_NAME = "log-neuron-cc.txt"


def _nxd_version() -> tuple[int, ...]:
    import neuronx_distributed

    return tuple(int(part) for part in neuronx_distributed.__version__.split(".")[:2])


def append_default_compiler_flags(compiler_args: str | None = "") -> str:
    if not compiler_args:
        compiler_args = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
    if "--auto-cast" not in compiler_args:
        compiler_args += " --auto-cast=none "
    elif "--auto-cast=none" not in compiler_args:
        logger.warning(
            "Compiler argument ``--auto-cast=none`` not detected. Other values might result in lower accuracy"
        )
    if not re.search(r"-O\d+", compiler_args):
        compiler_args += " -O1 "
    if "--verbose" not in compiler_args:
        compiler_args += " --verbose=35"
    return compiler_args


def append_default_compiler_flags_before_0_16(compiler_args: str | None = "") -> str:
    """The same function before NxD 0.16 (SDK 2.27), e.g. at 2.25.0 (c63420c model_builder.py:92-108): no
    ``--verbose=35``."""
    if not compiler_args:
        compiler_args = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
    if "--auto-cast" not in compiler_args:
        compiler_args += " --auto-cast=none "
    elif "--auto-cast=none" not in compiler_args:
        logger.warning(
            "Compiler argument ``--auto-cast=none`` not detected. Other values might result in lower accuracy"
        )
    if not re.search(r'-O\d+', compiler_args):
        compiler_args += " -O1 "
    return compiler_args


class BaseModelInstance:
    def __init__(self, module_cls, input_output_aliases):
        self.module_cls = module_cls
        self.module = None
        self.input_output_aliases = [input_output_aliases]

    def load_module(self):
        self.module = self.module_cls()

    # The real signature takes **kwargs too, and ModelBuilder passes its func_kwargs through them (NxD v2.28.0
    # trace/model_builder.py:390, called at :832, :884, :968): refusing them would refuse the real call.
    def get(self, bucket_rank, **kwargs):
        return self.module, self.input_output_aliases[0]


class ModelContainer:
    """What ``add`` keeps per key (v2.28.0 model_builder.py ~406-420; 2.25.0 c63420c ~1255-1269): the hook gets it,
    and before the hook (SDK 2.23-2.25) its ``compiler_args`` are where a caller reads the flags."""

    def __init__(self, model_instance, example_inputs, compiler_args, bucket_config, priority_model_idx):
        self.model_instance = model_instance
        self.example_inputs = example_inputs
        self.compiler_args = compiler_args
        self.bucket_config = bucket_config
        self.priority_model_idx = priority_model_idx


class ModelBuilder:
    def __init__(
            self,
            router,
            tp_degree,
            checkpoint_loader,
            start_rank_id=0,
            pp_degree=1,
            ep_degree=1,
            local_ranks_size=None,
            world_size=None,
            compiler_workdir=None,
            master_proc_env_vars=None,
            debug=False,
            num_cores_per_group=1,
            init_custom_process_group_fn=None,
            logical_nc_config=1,
            weights_to_skip_layout_optimization=set(),  # noqa: B006 - the real default
            compiler_flag_hook=None,
    ):
        if not torch_neuronx.__version__.startswith("2"):
            raise AssertionError(
                f"ModelBuilder requires torch-neuronx>=2.* but found torch-neuronx=={torch_neuronx.__version__}.")
        if pp_degree != 1 or ep_degree != 1 or world_size is not None or start_rank_id != 0:
            raise NotImplementedError("the stand-in builds tensor parallelism on one host only")
        self.router = router
        self.tp_degree = tp_degree
        self.checkpoint_loader = checkpoint_loader
        self.compiler_workdir = compiler_workdir if compiler_workdir else "/tmp/nxd_model/"
        self.compiler_flag_hook = compiler_flag_hook
        self.model_collection = {}

    def add(
            self,
            key: str,
            model_instance: BaseModelInstance,
            example_inputs,
            compiler_args: str | None = None,
            bucket_config=None,
            priority_model_idx: int | None = None,
    ) -> "ModelBuilder":
        if _nxd_version() >= (0, 16):
            compiler_args = append_default_compiler_flags(compiler_args)
        elif _nxd_version() >= (0, 13):
            compiler_args = append_default_compiler_flags_before_0_16(compiler_args)
        elif compiler_args is None:  # 0.12 (SDK 2.23, e834945 ~442-444): no default-flag function yet
            compiler_args = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
        warnings.warn("'bucket_config' will be deprecated in a future release.Bucket routing will be automatically "
                      "determined by inputs.", category=DeprecationWarning, stacklevel=2)
        if bucket_config is not None or len(example_inputs) != 1:
            raise NotImplementedError("the stand-in builds one bucket per key")
        self.model_collection[key] = ModelContainer(model_instance, example_inputs, compiler_args, bucket_config,
                                                    priority_model_idx)
        return self

    def trace(self, initialize_model_weights=True, dry_run=False):
        if os.path.exists(self.compiler_workdir):
            shutil.rmtree(self.compiler_workdir)  # ~543-545: the whole folder, whatever it holds, even on a dry run
        if os.environ.get("FAKE_NEURON_COMPILE_ERROR"):
            raise RuntimeError(os.environ["FAKE_NEURON_COMPILE_ERROR"])
        model_id = uuid.uuid4().hex
        jobs = []
        for key, container in self.model_collection.items():
            example, compiler_args = container.example_inputs, container.compiler_args
            out = Path(self.compiler_workdir) / key / "_tp0_bk0"
            out.mkdir(parents=True, exist_ok=True)  # _create_output_dir (~1096-1099): made again as needed
            flags = compiler_args
            if "--logfile" not in flags:  # ~720-722
                flags += f" --logfile={(out / LOG_FILE_DEFAULT_NAME).absolute()}"
            if self.compiler_flag_hook is not None:  # ~724-725: the final flags, before the cache lookup
                flags = self.compiler_flag_hook(key, self.model_collection[key], 0, flags)
            # ~603-624: use_cache=True, always; the HLO text's stand-in is the key and its inputs' shapes and dtypes
            graph = f"{key}:{[(tuple(t.shape), str(t.dtype)) for t in example[0]]}"
            jobs.append((graph, out / "model" / "graph.hlo", out / "graph.neff", flags))
        # The real one compiles every bucket at once in a thread pool (~708-751), after the hook has seen them all;
        # nothing of the pipeline runs during the compiles, so the stand-in compiles in turn (its thread pool made
        # the process abort at exit under load: "terminate called without an active exception").
        for job in jobs:
            _fake_runtime.compile_cached(*job)
        graphs = self._trace_graphs(model_id)
        shapes, dtypes = {}, {}  # per route (the list of input shapes): its key, and its inputs' dtypes
        for key, container in self.model_collection.items():
            inputs = container.example_inputs[0]
            route = str([list(t.shape) for t in inputs])
            shapes[route], dtypes[route] = (key, 0), [torch.empty(0, dtype=t.dtype) for t in inputs]
        # ~1064-1069, ~1091: the executor is traced with the last key's example inputs, so it takes that many
        nxd_model = NxDModel(graphs, shapes, model_id, self.tp_degree, dtypes)
        traced = torch.jit.script(executor(torch.jit.script(nxd_model), len(inputs)))
        if initialize_model_weights:  # ~764-781: each rank's slice written, loaded back, and given to initialize()
            self._shard_checkpoint()
            weights = [load_file(os.path.join(self.compiler_workdir, f"tp{rank}_sharded_checkpoint.safetensors"))
                       for rank in range(self.tp_degree)]
            traced.nxd_model.initialize(weights, torch.tensor([0], dtype=torch.int32))
            traced.nxd_model.initialize_with_saved_weights(torch.tensor(0))
        return traced

    def _shard_checkpoint(self):
        """``shard_checkpoint(serialize_path)`` (~802-843): the first key's module built and the checkpoint loaded
        under ``init_on_device(meta)`` (the module's parameters on the meta device; ~813-833, where the real one also
        mocks torch.distributed), the checkpoint's parameters cast to the module's dtypes (``cast_weights``,
        ~786-800: parameters only), then every rank's weights cut as the layers are (equal contiguous chunks along
        ``partition_dim``), in ``tp{rank}_sharded_checkpoint.safetensors`` (NxD's own file names). A weight the
        checkpoint lacks is skipped without a word (trace.py shard_children ~773-774); initialising is what fails."""
        instance = next(iter(self.model_collection.values())).model_instance
        parallel_state._set_aot_rank(0, self.tp_degree, None)
        try:
            with _parameters_on_meta():
                instance.load_module()
                module, aliases = instance.get(0)
                checkpoint = self.checkpoint_loader()
        finally:
            parallel_state._set_aot_rank(None, None, None)
        params = dict(module.named_parameters())  # cast_weights casts to these; buffers keep the checkpoint's dtype
        for rank in range(self.tp_degree):
            sliced = {name: _slice(checkpoint, name, tensor, rank, self.tp_degree).to(
                params[name].dtype if name in params else checkpoint[name].dtype).contiguous()
                for name, tensor in _weights(module, aliases) if name in checkpoint}
            save_file(sliced, os.path.join(self.compiler_workdir, f"tp{rank}_sharded_checkpoint.safetensors"))

    def _trace_graphs(self, model_id):
        """Every key's graph, traced once for every rank (SPMD) from its own module (``load_module()`` then
        ``get(0)``, ~832-884), built as rank 0 of the world (``mock_distributed``: parallel_state); each takes the
        rank's weights and state as inputs, so that the graphs hold neither. Writes each bucket's metaneff."""
        parallel_state._set_aot_rank(0, self.tp_degree, model_id)
        _fake_runtime.set_aot(True)
        try:
            graphs, first = {}, None
            for key, container in self.model_collection.items():
                instance, example = container.model_instance, container.example_inputs[0]
                instance.load_module()
                module, aliases = instance.get(0)
                _write_metaneff(Path(self.compiler_workdir) / key / "_tp0_bk0" / "metaneff.pb", example, module,
                                aliases)
                states = aliased(module, aliases)
                weights, state = dict(_weights(module, aliases)), {n: module.get_parameter(n) for n in states}
                if first is None:
                    first = (_layout(weights), _layout(state))
                elif (_layout(weights), _layout(state)) != first:
                    raise ValueError(f"key {key!r}: the models of one ModelBuilder must share their weights and state")
                graph = SpmdGraph(module, list(weights), states)
                _empty(module, [*weights, *state])  # the traced graph keeps the module: it holds no weight
                with torch.no_grad():
                    for tensor in [*weights.values(), *state.values()]:
                        tensor.zero_()  # the example values: the graph is traced without the checkpoint
                    bound = [*weights.values(), *state.values(), torch.tensor(0)]
                    graphs[key] = torch.jit.trace(graph, (*example, bound), check_trace=False)
            counts = {len(c.example_inputs[0]) for c in self.model_collection.values()}
            if len(counts) != 1:  # the graphs are called through one executor of one arity (see above)
                raise TypeError(f"the keys' example inputs have {sorted(counts)} tensors: the traced executor takes "
                                "the last key's count")
            return torch.jit.script(spmd_graphs(graphs, weights, state, counts.pop()))
        finally:
            _fake_runtime.set_aot(False)
            parallel_state._set_aot_rank(None, None, None)


@contextlib.contextmanager
def _parameters_on_meta():
    """NxD's ``init_on_device(torch.device("meta"), force_custom_init_on_device=True)`` (utils/model_utils.py
    ~257-330 at v2.28.0): every parameter a module registers is moved to the meta device (buffers are not); a
    checkpoint loader that builds a module (``from_pretrained``) gets meta tensors."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            param_cls = type(module._parameters[name])
            kwargs = module._parameters[name].__dict__
            kwargs["requires_grad"] = module._parameters[name].requires_grad
            module._parameters[name] = (param if param.device == torch.device("meta") else
                                        param_cls(module._parameters[name].to("meta"), **kwargs))

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def init_before_0_15(
        self,
        router,
        tp_degree,
        checkpoint_loader,
        start_rank_id=0,
        pp_degree=1,
        ep_degree=1,
        local_ranks_size=None,
        world_size=None,
        compiler_workdir=None,
        master_proc_env_vars=None,
        debug=False,
        num_cores_per_group=1,
        init_custom_process_group_fn=None,
        logical_nc_config=1,
        weights_to_skip_layout_optimization=set(),  # noqa: B006 - the real default
):
    """``ModelBuilder.__init__`` before NxD 0.15 (SDK 2.23-2.25; 2.25.0 c63420c model_builder.py:1291-1308): no
    ``compiler_flag_hook``, which commit fecfe75 (SDK 2.26) added, so passing it is Python's own ``TypeError``."""
    _init_with_hook(self, router, tp_degree, checkpoint_loader, start_rank_id, pp_degree, ep_degree,
                    local_ranks_size, world_size, compiler_workdir, master_proc_env_vars, debug, num_cores_per_group,
                    init_custom_process_group_fn, logical_nc_config, weights_to_skip_layout_optimization)


_init_with_hook = ModelBuilder.__init__
if _nxd_version() < (0, 15):  # the installed release's signature, as inspect.signature sees it
    init_before_0_15.__name__, init_before_0_15.__qualname__ = "__init__", "ModelBuilder.__init__"
    if hasattr(init_before_0_15.__code__, "co_qualname"):  # Python 3.11 names the function in its TypeError by this
        init_before_0_15.__code__ = init_before_0_15.__code__.replace(co_qualname="ModelBuilder.__init__")
    ModelBuilder.__init__ = init_before_0_15


def _write_metaneff(path, example, module, aliases):
    """The bucket's ``MetaNeff``: its user inputs, its state (the aliased parameters) and its weights, each weight
    with its checkpoint key (torch-neuronx's ``generate_hlo`` makes the real one; NxD hlo_utils.py ~465-472 writes
    the same fields for a weight)."""
    from torch_neuronx.proto import metaneff_pb2

    meta = metaneff_pb2.MetaNeff()
    kinds = [(tensor, metaneff_pb2.MetaTensor.Type.USER_INPUT, "") for tensor in example]
    kinds += [(state, metaneff_pb2.MetaTensor.Type.INPUT_STATE, "") for state in aliases]
    kinds += [(tensor, metaneff_pb2.MetaTensor.Type.INPUT_WEIGHT, name) for name, tensor in _weights(module, aliases)]
    for index, (tensor, kind, key) in enumerate(kinds):
        entry = meta.input_tensors.add()
        entry.name = f"input{index}".encode()
        entry.shape[:] = list(tensor.shape)
        entry.type = kind
        entry.checkpoint_key = key.encode()
    Path(path).write_bytes(meta.SerializeToString())


def _weights(module, states):
    """The module's weights by state_dict name: its parameters and persistent buffers, less the states (aliased
    parameters, which StateInitializer allocates)."""
    state_ids, persistent = {id(p) for p in states}, set(module.state_dict())
    named = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if n in persistent)]
    return [(name, tensor) for name, tensor in named if id(tensor) not in state_ids]


def _slice(checkpoint, name, param, rank, tp_degree):
    full = checkpoint[name]
    dim = getattr(param, "partition_dim", None)
    return full if dim is None else torch.split(full, full.shape[dim] // tp_degree, dim)[rank]


def _layout(tensors: dict[str, torch.Tensor]):
    return [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def _empty(module, names):
    """Each named parameter or buffer of ``module`` replaced by an empty tensor of its dtype."""
    for name in names:
        table, attr = slot(module, name)
        table[attr] = torch.empty(0, dtype=table[attr].dtype)
