"""The stand-in Neuron SDK (tests/fake_neuron) is at least as strict as the real one where the pipeline depends on it.

Each behaviour below is one the real SDK has (tests/fake_neuron/README.md says where each comes from) and one the
pipeline's code once got wrong or could: a model that replaces its state on its first forward, a ``model.pt`` that
needs ``torch_neuronx`` imported, routing by input shapes, ranks traced in spawned processes with real collectives,
the state order, NeuronCores a loaded model holds, and the fixed rendezvous port. Everything that loads a model
runs in its own process: a process that initialises the runtime holds its NeuronCores until it exits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from . import fake_sdk

# What differs between versions: the stand-in SDK on torch (an inf2 host runs torch 2.8).
# make test-production runs these, and make test-lowest where a distribution named is at another version than
# the production pins (tests/conftest.py, --already-tested-with).
pytestmark = pytest.mark.across_versions("torch", "safetensors")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sdk(tmp_path_factory):
    """The stand-in on a host with 4 NeuronCores (two Inferentia2 devices)."""
    site = fake_sdk.install(tmp_path_factory.mktemp("sdk"), cores=4)
    with pytest.MonkeyPatch.context() as mp, fake_sdk.activated(site, mp, cores=4):
        yield site


@pytest.fixture(scope="module")
def built(neuron_checked, sdk) -> dict[str, Path]:
    """A device-prefill (model.pt) and a host-prefill (tp_0.pt, tp_1.pt) build of the tiny model, tp_degree 2."""
    out, root = neuron_checked
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return {"device": root / "gemma4_tiny" / "512_fp32" / "build" / "model.pt",
            "host": root / "gemma4_tiny" / "256_bf16_host" / "build"}


# The end of every script that may have run a loaded model: the stand-in's ranks run on torch's interop threads
# (torch.jit.fork), and tearing those down at interpreter exit has aborted a finished script on a loaded machine
# ("terminate called without an active exception", exit -6) after everything it checks was printed. Leaving without
# that teardown keeps the exit code the script's (an uncaught exception still exits 1 before it gets here).
LEAVE = """
import os as _os, sys as _sys
_sys.stdout.flush()
_sys.stderr.flush()
_os._exit(0)
"""


def python(code: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter on the stand-in (its environment as the fixture set it), run in a scratch
    directory (the stand-in's parallel_model_trace writes its compiler log into the current directory); ``LEAVE``
    after it."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ["PYTHONPATH"]]), **(env or {})}
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code) + LEAVE], capture_output=True, text=True,
                              env=full, timeout=timeout, cwd=scratch)


INPUTS = """
import torch
def inputs(tokens, hidden=128, layers=8, ple=16):
    return (torch.zeros(1, tokens, hidden), torch.zeros(1, tokens, layers, ple), torch.arange(tokens).view(1, -1),
            torch.tensor([tokens - 1]))
"""


def test_a_batched_model_pt_takes_exactly_the_last_keys_inputs_and_routes_each_graph_by_their_shapes(neuron_checked,
                                                                                                     sdk):
    """ModelBuilder traces its executor with the last key's example inputs (NxD v2.28.0 model_builder.py ~1091): a
    batch-4 build's model.pt takes exactly five (seq_ids the fifth), a prefill's one line or a decode step's four
    rows; four inputs, or shapes no key was traced with, are refused."""
    out, root = neuron_checked
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    path = root / "gemma4_tiny" / "512_fp32+bs4" / "build" / "model.pt"
    run = python(INPUTS + f"""
import torch, torch_neuronx
model = torch.jit.load({str(path)!r})
model.nxd_model.initialize_with_saved_weights(torch.tensor(0))
prefill = (*inputs(128), torch.tensor([2]))
decode = tuple(t.repeat(4, *[1] * (t.dim() - 1)) for t in inputs(1)[:3]) + (torch.tensor([0]), torch.arange(4))
print("prefill", tuple(model(*prefill)[0].shape), "decode", tuple(model(*decode)[0].shape))
for name, bad in (("four", inputs(128)), ("shapes", (*inputs(64), torch.tensor([2])))):
    try:
        model(*bad)
    except Exception as exc:
        print(name, "refused", type(exc).__name__)
""")
    assert run.returncode == 0, run.stderr
    assert "prefill (1, 512) decode (4, 512)" in run.stdout
    assert "four refused" in run.stdout and "shapes refused" in run.stdout


def test_model_pt_cannot_be_loaded_before_torch_neuronx_is_imported(built):
    bare = python(f"import torch; torch.jit.load({str(built['device'])!r})")
    assert bare.returncode != 0 and "neuron::" in bare.stderr  # an operator only torch_neuronx registers
    imported = python(f"import torch, torch_neuronx; torch.jit.load({str(built['device'])!r}); print('loaded')")
    assert imported.returncode == 0 and "loaded" in imported.stdout, imported.stderr


def test_a_loaded_model_pt_runs_only_once_initialised_and_routes_by_every_input_shape(built):
    out = python(INPUTS + f"""
import torch_neuronx
model = torch.jit.load({str(built['device'])!r})
for attempt in ("before", "after"):
    try:
        model(*inputs(1))
        print(attempt, "ran")
    except Exception as exc:
        print(attempt, type(exc).__name__, str(exc).splitlines()[-1][:160])
    model.nxd_model.initialize_with_saved_weights(torch.tensor(0))
for tokens in (128, 129):  # the bucket, and one token more
    try:
        logits = model(*inputs(tokens))[0]
        print(tokens, "ran", list(logits.shape))
    except torch.jit.Error as exc:
        print(tokens, "jit.Error", "not found in input_shape_map" in str(exc))
""")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("before Error") and "This model is not initialized" in lines[0]
    assert lines[1] == "after ran"
    assert lines[2] == "128 ran [1, 512]" and lines[3] == "129 jit.Error True"


def test_a_loaded_per_rank_model_replaces_its_state_parameters_on_its_first_forward(built):
    out = python(INPUTS + f"""
from neuronx_distributed.trace import parallel_model_load
model = parallel_model_load({str(built['host'])!r})
def states():
    return [[p for n, p in rank.named_parameters() if n.startswith("states.")] for rank in model.models]
before = states()
before[0][0].data.fill_(7.0)  # written before any call: carried to the device
model(*inputs(1))
after = states()
print(all(a is not b for ra, rb in zip(after, before) for a, b in zip(ra, rb)), len(after[0]))
print(float(after[0][0][0, 0, 1, 0]))
""")
    assert out.returncode == 0, out.stderr
    replaced, count = out.stdout.split()[:2]
    assert replaced == "True" and int(count) > 0
    assert float(out.stdout.split()[2]) == 7.0  # slot 1 untouched by the call at position 0: the seeded value


def test_a_second_process_cannot_take_neuroncores_in_use(built, sdk):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, torch, torch_neuronx
        model = torch.jit.load({str(built['device'])!r})
        model.nxd_model.initialize_with_saved_weights(torch.tensor(0))
        print("ready", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "NEURON_RT_VISIBLE_CORES": "0-1"})
    try:
        assert holder.stdout.readline().strip() == "ready"
        load = f"""
import torch, torch_neuronx
model = torch.jit.load({str(built['device'])!r})
model.nxd_model.initialize_with_saved_weights(torch.tensor(0))
print("loaded")
"""
        every_core = python(load)  # no NEURON_RT_VISIBLE_CORES: the runtime wants all 4
        assert every_core.returncode != 0 and "NeuronCore 0 is in use by another process" in every_core.stderr
        same = python(load, {"NEURON_RT_VISIBLE_CORES": "0-1"})
        assert same.returncode != 0 and "in use by another process" in same.stderr
        other = python(load, {"NEURON_RT_VISIBLE_CORES": "2-3"})
        assert other.returncode == 0 and "loaded" in other.stdout, other.stderr
    finally:
        holder.communicate("")
    assert python(load, {"NEURON_RT_VISIBLE_CORES": "0-1"}).returncode == 0  # released when the holder exited


class TwoStates(nn.Module):
    """Two aliased parameters whose outputs come in the opposite order to their aliasing."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(2), requires_grad=False)

    def forward(self, x):
        return x.sum(), self.a + 1.0, self.b + 2.0


def two_states(delay_s: float = 0.0):
    """``parallel_model_trace``'s ``func``: aliases inserted b first, though b is output 2 and a output 1."""
    time.sleep(delay_s)
    module = TwoStates()
    return module, {module.b: 2, module.a: 1}


def test_parallel_model_trace_spawns_its_ranks_and_orders_state_by_alias_insertion(sdk, tmp_path):
    out = python(f"""
import os, torch
from neuronx_distributed.trace import parallel_model_trace
from tests.test_fake_neuron import two_states
try:
    parallel_model_trace(lambda: two_states(), (torch.ones(2),), tp_degree=2, compiler_workdir={str(tmp_path)!r})
except Exception as exc:
    print("lambda:", type(exc).__name__)
model = parallel_model_trace(two_states, (torch.ones(2),), tp_degree=2, compiler_workdir={str(tmp_path)!r})
model(torch.ones(2))
rank = model.models[1]
print(os.environ["MASTER_PORT"], [(n, float(p[0])) for n, p in rank.named_parameters(remove_duplicate=False)])
""")
    assert out.returncode == 0, out.stderr
    # The parent's own lines (the spawned ranks' gloo may print connection lines, interleaved, under torch 2.8)
    pickled = re.search(r"^lambda: (\w+)$", out.stdout, re.MULTILINE)
    states = re.search(rf"^{fake_sdk.trace_port()} (\[.*\])$", out.stdout, re.MULTILINE)
    assert pickled and pickled.group(1) in ("PicklingError", "AttributeError"), out.stdout  # ranks are spawned
    # states.0 is b (inserted first), written from output 2; states.1 is a, from output 1; the module's own
    # attributes are the same (moved) tensors
    assert states and states.group(1) == "[('states.0', 2.0), ('states.1', 1.0), ('model.a', 1.0), ('model.b', 2.0)]"


def test_parallel_model_trace_returns_the_aliased_outputs_too(sdk, tmp_path):
    """Every output of the graph is in its metaneff (torch-neuronx 1.x ``hlo_metaneff``): the caches come back with
    the result, each a tensor of its own, while the state is updated in place."""
    out = python(f"""
import torch
from neuronx_distributed.trace import parallel_model_trace
from tests.test_fake_neuron import two_states
model = parallel_model_trace(two_states, (torch.ones(2),), tp_degree=2, compiler_workdir={str(tmp_path)!r})
result = model(torch.ones(2))
state = dict(model.models[0].named_parameters())["states.1"]
print("RESULT", len(result), [float(r.flatten()[0]) for r in result], result[1].data_ptr() != state.data_ptr())
""")
    assert out.returncode == 0, out.stderr
    assert re.search(r"^RESULT 3 \[2.0, 1.0, 2.0\] True$", out.stdout, re.MULTILINE), out.stdout


def model_builder_code(workdir: str, chdir: bool) -> str:
    return INPUTS + f"""
import os, torch
from torch import nn
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = ColumnParallelLinear(4, 8, bias=False, gather_output=True)
    def forward(self, a, b, c, d):
        return self.proj(a[..., :4]).sum(-1)

workdir = {workdir!r}
os.makedirs(workdir, exist_ok=True)
if {chdir!r}:
    os.chdir(workdir)  # the compile process's working directory is ModelBuilder's own work folder
instance = BaseModelInstance(Tiny, {{}})
builder = ModelBuilder(router=None, tp_degree=2, checkpoint_loader=lambda: {{"proj.weight": torch.ones(8, 4)}},
                       compiler_workdir=workdir)
builder.add("decode", instance, [inputs(1)], compiler_args="--auto-cast=none")
builder.trace(initialize_model_weights=True)
print("FILES", sorted(p for p in os.listdir(workdir) if p.endswith(".safetensors")))
"""


def test_model_builder_deletes_its_work_folder_even_when_it_is_the_current_directory(sdk, tmp_path):
    """``ModelBuilder.trace`` runs ``shutil.rmtree(compiler_workdir)`` first (NxD v2.28.0 model_builder.py:543-545);
    a compiler process started in that folder then has no working directory (``os.getcwd()`` fails)."""
    inside = python(model_builder_code(str(tmp_path / "wd"), chdir=True))
    assert inside.returncode != 0 and "FileNotFoundError" in inside.stderr, inside.stdout + inside.stderr
    beside = python(model_builder_code(str(tmp_path / "wd2"), chdir=False))
    assert beside.returncode == 0, beside.stderr
    # ~764-773: each rank's slice of the weights, written into the work folder and loaded back from there
    assert "FILES ['tp0_sharded_checkpoint.safetensors', 'tp1_sharded_checkpoint.safetensors']" in beside.stdout


CACHED_BUILD = INPUTS + """
import os, sys, torch
from torch import nn
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = ColumnParallelLinear(4, 8, bias=False, gather_output=True)
        self.register_buffer("scale", torch.ones(1))  # persistent: a state_dict key
    def forward(self, a, b, c, d):
        return self.proj(a[..., :4] + 1).sum(-1) * self.scale

workdir, weights = sys.argv[1], {"proj.weight": torch.ones(8, 4)}
if sys.argv[2] == "with-buffer":
    weights["scale"] = torch.full((1,), 3.0)
seen = []
builder = ModelBuilder(router=None, tp_degree=2, checkpoint_loader=lambda: weights, compiler_workdir=workdir,
                       compiler_flag_hook=lambda key, artifacts, bucket, flags: seen.append(flags) or flags)
builder.add("decode", BaseModelInstance(Scaled, {}), [inputs(1)], compiler_args="--auto-cast=none")
model = builder.trace(initialize_model_weights=True)
log = os.path.join(workdir, "decode", "_tp0_bk0", "log-neuron-cc.txt")
print("LOG", os.path.exists(log), "FLAGS", seen, "OUT", float(model(*inputs(1))[0].flatten()[0]))
"""


def test_model_builder_compiles_through_the_cache_and_loads_persistent_buffers_as_weights(sdk, tmp_path):
    """NxD v2.28.0 compiles every bucket with use_cache=True (model_builder.py ~603-624): the same graph, flags and
    work folder again is a cache hit, with no compiler run and no log, while compiler_flag_hook (~724) is handed the
    same final flags both times. A persistent buffer is a state_dict key, a weight the checkpoint must hold (the
    stricter reading of what torch-neuronx does with one)."""
    cache = {"NEURON_COMPILE_CACHE_URL": str(tmp_path / "cache")}
    code = textwrap.dedent(CACHED_BUILD) + LEAVE
    run = [sys.executable, "-c", code, str(tmp_path / "wd")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ["PYTHONPATH"]]), **cache}
    first = subprocess.run([*run, "with-buffer"], capture_output=True, text=True, env=env, cwd=tmp_path)
    again = subprocess.run([*run, "with-buffer"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    said = [re.search(r"^LOG (\w+) FLAGS (.*) OUT (\S+)$", p.stdout, re.M).groups() for p in (first, again)]
    assert [s[0] for s in said] == ["True", "False"]  # compiled, then a hit: no log
    assert said[0][1] == said[1][1] and "--logfile=" in said[0][1] and "--verbose=35" in said[0][1]
    assert said[0][2] == said[1][2] == "96.0"  # 8 outputs of 4 ones x ones, times the checkpoint's scale 3, not 1
    missing = subprocess.run([*run, "no-buffer"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert missing.returncode != 0 and "checkpoint has no weight scale" in missing.stderr, missing.stderr[-2000:]


def test_model_builder_keys_of_different_input_counts_are_refused(sdk, tmp_path):
    """The executor takes the last key's input count (NxD v2.28.0 model_builder.py ~1091), so a key of another count
    could never be called: the real one fails at that key's first call, the stand-in (stricter) at trace."""
    code = INPUTS + f"""
import torch
from torch import nn
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = ColumnParallelLinear(4, 8, bias=False, gather_output=True)
    def forward(self, a, b, c, d, e=None):
        return self.proj(a[..., :4]).sum(-1)

builder = ModelBuilder(router=None, tp_degree=2, checkpoint_loader=lambda: {{"proj.weight": torch.ones(8, 4)}},
                       compiler_workdir={str(tmp_path / "wd")!r})
builder.add("prefill", BaseModelInstance(Tiny, {{}}), [(*inputs(16), torch.tensor([0]))])
builder.add("decode", BaseModelInstance(Tiny, {{}}), [inputs(1)])
builder.trace(initialize_model_weights=True)
"""
    out = python(code)
    assert out.returncode != 0 and "TypeError: the keys' example inputs have [4, 5] tensors" in out.stderr, out.stderr


def test_two_parallel_model_traces_at_once_collide_on_the_fixed_port(sdk, tmp_path):
    code = """
import functools, torch
from neuronx_distributed.trace import parallel_model_trace
from tests.test_fake_neuron import two_states
parallel_model_trace(functools.partial(two_states, {delay}), (torch.ones(2),), tp_degree=2,
                     compiler_workdir={workdir!r})
print("traced")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ["PYTHONPATH"]])}
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code.format(delay=5, workdir=str(tmp_path / "a")))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    time.sleep(3)  # the first trace's ranks now hold port 2022 while func sleeps
    second = python(code.format(delay=0, workdir=str(tmp_path / "b")), timeout=120)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and "traced" in out, err
    assert second.returncode != 0 and ("address already in use" in second.stderr.lower()
                                       or "EADDRINUSE" in second.stderr), second.stderr[-2000:]


STRICT_BUILD = INPUTS + """
import sys, torch
from torch import nn
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = ColumnParallelLinear(4, 8, bias=False, gather_output=True)
    def forward(self, a, b, c, d):
        return self.proj(a[..., :4] + 1).sum(-1)

def from_a_module():  # a loader that builds a model to read its weights (what from_pretrained does)
    return {"proj.weight": nn.Linear(4, 8, bias=False).weight.detach() * 0 + 1}

def from_files():
    return {"proj.weight": torch.ones(8, 4)}

loader = from_a_module if sys.argv[2] == "module" else from_files
builder = ModelBuilder(router=None, tp_degree=2, checkpoint_loader=loader, compiler_workdir=sys.argv[1])
builder.add("decode", BaseModelInstance(Tiny, {}), [inputs(1)], compiler_args="--auto-cast=none")
model = builder.trace(initialize_model_weights=True)
print("OUT", float(model(*inputs(1))[0].flatten()[0]))
a, b, c, d = inputs(1)
try:
    model(a.to(torch.bfloat16), b, c, d)
    print("BF16 ran")
except Exception as exc:
    print("BF16 refused:", str(exc).strip().splitlines()[-1])
"""


def test_model_builder_loads_the_checkpoint_with_parameters_on_meta_and_refuses_a_dtype_it_was_not_traced_with(
        sdk, tmp_path):
    """As the real ModelBuilder: the checkpoint loader runs under init_on_device(meta) (v2.28.0 ~813-833), so a loader
    that builds a module to read its weights hands over meta tensors and the build fails (the pipeline reads the
    safetensors files, neuron_rank.full_checkpoint); and a call is routed by shape but runs only with the traced
    dtypes (a NEFF's inputs are typed; nothing converts them)."""
    built = python(STRICT_BUILD.replace("sys.argv[1]", repr(str(tmp_path / "a"))).replace("sys.argv[2]", "'files'"))
    assert built.returncode == 0 and "OUT 32.0" in built.stdout, built.stderr[-2000:]
    assert re.search(r"BF16 refused: .*input 0 of decode is \d+, the graph was traced with \d+", built.stdout), \
        built.stdout
    meta = python(STRICT_BUILD.replace("sys.argv[1]", repr(str(tmp_path / "b"))).replace("sys.argv[2]", "'module'"))
    assert meta.returncode != 0 and "meta" in meta.stderr, meta.stdout + meta.stderr[-2000:]


SPMD_BUILD = INPUTS + """
import json, sys, torch
from torch import nn
from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
from neuronx_distributed.trace.model_builder import BaseModelInstance, ModelBuilder

seen = []  # (rank, world) each module was built as

class Halves(nn.Module):
    '''Rank r's half of the output: cut by ColumnParallelLinear (``by="weights"``), or picked from a whole weight by
    the rank read while the module is built (``by="rank"``), which an SPMD graph cannot do.'''
    def __init__(self):
        super().__init__()
        rank, world = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_size()
        seen.append((rank, world))
        self.proj = ColumnParallelLinear(4, 8, bias=False, gather_output=True)
        self.whole = nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.rows = slice(rank * 4, rank * 4 + 4)
    def forward(self, a, b, c, d):
        x = a[..., :4] + 1
        if sys.argv[2] == "weights":
            return self.proj(x).sum(-1)
        from neuronx_distributed.parallel_layers.mappings import gather_from_tensor_model_parallel_region
        return gather_from_tensor_model_parallel_region(x @ self.whole[self.rows].T).sum(-1)

rows = torch.arange(8.0).repeat_interleave(4).view(8, 4)  # output row i is 4 * i
weights = {"proj.weight": rows, "whole": rows.clone()}
builder = ModelBuilder(router=None, tp_degree=2, checkpoint_loader=lambda: weights, compiler_workdir=sys.argv[1])
builder.add("decode", BaseModelInstance(Halves, {}), [inputs(1)], compiler_args="--auto-cast=none")
initialized = sys.argv[3] == "initialized"
model = builder.trace(initialize_model_weights=initialized)
graphs = sum(t.numel() for t in model.nxd_model.graphs.state_dict().values())
said = {"seen": seen, "graph_elements": graphs, "weight_ranks": len(model.nxd_model.weights)}
if not initialized:
    try:
        model.nxd_model.initialize_with_saved_weights(torch.tensor(0))
    except Exception as exc:
        said["refused"] = str(exc).strip().splitlines()[-1]
    shards = [{"proj.weight": rows[4 * r:4 * r + 4].clone(), "whole": rows.clone()} for r in range(2)]
    model.nxd_model.initialize(shards, torch.tensor([0], dtype=torch.int32))
said["out"] = float(model(*inputs(1))[0].flatten()[0])
print("SAID", json.dumps(said))
"""


def test_model_builder_traces_one_graph_for_every_rank_as_rank_0_and_gives_each_rank_its_weights_as_inputs(
        sdk, tmp_path):
    """Issue 51 (6b, 6c): the real ModelBuilder builds every module under mock_distributed as rank 0 of the world
    (NxD v2.28.0 model_builder.py ~551-556, ~813-816) and compiles one graph per bucket that every NeuronCore runs
    (``_tp0_bk0``) with its own weights and state, which the graph takes as inputs (trace/spmd.py ~166-193) and
    never holds. So a rank's part comes from its weights only: a module that picks its part by the rank it reads
    while built computes rank 0's part on every core. A model traced without initialize_model_weights has no
    weights until ``nxd_model.initialize`` gives them."""
    def run(by: str, initialized: str, folder: str) -> dict:
        code = SPMD_BUILD.replace("sys.argv[1]", repr(str(tmp_path / folder)))
        out = python(code.replace("sys.argv[2]", repr(by)).replace("sys.argv[3]", repr(initialized)))
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(re.search(r"^SAID (.*)$", out.stdout, re.M).group(1))

    # x = a[..., :4] + 1 is four ones; output i is 4 * i; their sum 4 * (0 + ... + 7) = 112, each rank its own half
    by_weights = run("weights", "initialized", "a")
    assert by_weights["out"] == 112.0 and by_weights["graph_elements"] == 0 and by_weights["weight_ranks"] == 2
    assert {tuple(s) for s in by_weights["seen"]} == {(0, 2)}  # every module built as rank 0 of 2
    by_rank = run("rank", "initialized", "b")
    assert by_rank["out"] == 4 * (0 + 1 + 2 + 3) * 2  # rank 0's half, on both cores: 48, not 112
    later = run("weights", "later", "c")
    assert later["weight_ranks"] == 1 and "weights for 1 ranks, not its 2" in later["refused"]
    assert later["out"] == 112.0  # once initialize() gave each rank its weights
