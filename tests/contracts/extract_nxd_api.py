"""Regenerate tests/contracts/nxd_api.json: the neuronx-distributed API surface the pipeline uses, read from the
real source at each release this project knows (pipeline/backends/neuron_sdk.py names them).

    python tests/contracts/extract_nxd_api.py GIT_DIR > tests/contracts/nxd_api.json

GIT_DIR is a clone (or bare mirror) of aws-neuron/neuronx-distributed; each release's files are read with
``git show REF:PATH`` and parsed with ``ast`` (nothing is imported or run). For every function and method below it
records the parameters in order, their kind and the source text of their defaults, whether ``*args``/``**kwargs``
are accepted, and, for ModelBuilder's default-flag logic, a digest of its code (so a change upstream shows up as a
changed file here and a failing test that says to re-read it).
"""

from __future__ import annotations

import ast
import hashlib
import json
import subprocess
import sys

# release -> the git ref of neuronx-distributed that shipped in it
REFS = {"2.25.0": "c63420c", "2.28.1": "v2.28.0", "2.29.0": "fbac349"}
# module -> (file in the repository, [qualified names])
SURFACE = {
    "neuronx_distributed.trace.trace": ("src/neuronx_distributed/trace/trace.py", [
        "parallel_model_trace", "parallel_model_save", "parallel_model_load",
        "TensorParallelNeuronModel.__init__", "TensorParallelNeuronModel.forward"]),
    "neuronx_distributed.trace.model_builder": ("src/neuronx_distributed/trace/model_builder.py", [
        "ModelBuilder.__init__", "ModelBuilder.add", "ModelBuilder.trace", "BaseModelInstance.__init__",
        "BaseModelInstance.load_module", "BaseModelInstance.get", "append_default_compiler_flags"]),
    "neuronx_distributed.trace.spmd": ("src/neuronx_distributed/trace/spmd.py", [
        "NxDModel.initialize_with_saved_weights", "NxDModel.router", "NxDModel.forward"]),
    "neuronx_distributed.parallel_layers.layers": ("src/neuronx_distributed/parallel_layers/layers.py", [
        "ColumnParallelLinear.__init__", "ColumnParallelLinear.forward", "RowParallelLinear.__init__",
        "RowParallelLinear.forward"]),
    "neuronx_distributed.parallel_layers.mappings": ("src/neuronx_distributed/parallel_layers/mappings.py", [
        "reduce_from_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region"]),
    "neuronx_distributed.parallel_layers.parallel_state": (
        "src/neuronx_distributed/parallel_layers/parallel_state.py", [
        "initialize_model_parallel", "model_parallel_is_initialized", "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_size", "get_tensor_model_parallel_group"]),
}
DIGESTED = {"append_default_compiler_flags"}
EXPORTS = {"neuronx_distributed.trace": "src/neuronx_distributed/trace/__init__.py"}


def find(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    scope: list[ast.stmt] = tree.body
    *outer, name = qualname.split(".")
    for cls in outer:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def signature(fn: ast.FunctionDef) -> dict:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    params = [{"name": p.arg, "kind": "positional", "default": d} for p, d in zip(positional, defaults)]
    params += [{"name": p.arg, "kind": "keyword_only", "default": None if d is None else ast.unparse(d)}
               for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if params and params[0]["name"] == "self":
        params = params[1:]
    return {"params": params, "varargs": a.vararg is not None, "varkw": a.kwarg is not None}


def code_digest(fn: ast.FunctionDef) -> str:
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    dump = ast.dump(ast.Module(body=body, type_ignores=[]), include_attributes=False)
    return hashlib.sha256(dump.encode()).hexdigest()


def exported(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            names += [alias.asname or alias.name for alias in node.names]
    return sorted(names)


def read(git_dir: str, ref: str, path: str) -> ast.Module:
    text = subprocess.run(["git", "-C", git_dir, "show", f"{ref}:{path}"], capture_output=True, text=True,
                          check=True).stdout
    return ast.parse(text)


def surface(git_dir: str, ref: str) -> dict:
    api: dict[str, dict] = {}
    for module, (path, names) in SURFACE.items():
        tree = read(git_dir, ref, path)
        for qualname in names:
            fn = find(tree, qualname)
            entry = signature(fn)
            if qualname in DIGESTED:
                entry["code_sha256"] = code_digest(fn)
            api[f"{module}:{qualname}"] = entry
    exports = {module: exported(read(git_dir, ref, path)) for module, path in EXPORTS.items()}
    version_text = subprocess.run(["git", "-C", git_dir, "show", f"{ref}:src/neuronx_distributed/_version.py"],
                                  capture_output=True, text=True, check=True).stdout
    version = ast.literal_eval(next(line.split("=", 1)[1].strip() for line in version_text.splitlines()
                                    if line.startswith("__version__")))
    return {"ref": ref, "nxd_version": version, "api": api, "exports": exports}


def main(argv: list[str]) -> int:
    git_dir = argv[0]
    data = {"source": "aws-neuron/neuronx-distributed",
            "generated_by": "tests/contracts/extract_nxd_api.py",
            "releases": {release: surface(git_dir, ref) for release, ref in REFS.items()}}
    print(json.dumps(data, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
