"""The package's layers (README, "Layout"): imports flow one way, and there are no import cycles.

Every import counts, at module level, inside a function, or under ``TYPE_CHECKING``: a lazy import is still a
dependency, and a cycle through one is still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pipeline"

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("core",),
    ("recipe",),
    ("models",),
    ("artifact",),
    ("config", "config_errors", "paths"),
    ("host",),
    ("backends",),
    ("decoding",),
    ("validation",),
    ("serving",),
    ("evaluation",),
    ("publishing",),
    ("stages",),
    ("run", "summary"),
    ("cli",),
    ("__main__",),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The pipeline modules ``path`` imports (``from pipeline.x import y`` counts ``pipeline.x.y`` when that is a
    module, else ``pipeline.x``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def layer_of(module: str) -> int | None:
    """The index of ``module``'s layer; None for the package itself (``pipeline/__init__.py``: its version only)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    for index, names in enumerate(LAYERS):
        if parts[1] in names:
            return index
    raise AssertionError(f"{module} is in no layer: add its folder to tests/test_layers.py LAYERS")


def test_every_module_has_a_layer_and_imports_none_above_it():
    wrong = []
    for module, imported in import_graph().items():
        mine = layer_of(module)
        for target in imported:
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                wrong.append(f"{module} imports {target} ({LAYERS[theirs][0]} is above {LAYERS[mine][0]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_package_root_imports_nothing():
    assert import_graph()["pipeline"] == set()


def test_no_import_cycles():
    graph = import_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("layer, allowed", [
    ("recipe", ("pipeline.recipe", "pipeline.core.errors", "pipeline.core.versions")),
    ("core", ("pipeline.core",)),
])
def test_recipe_and_core_stand_alone(layer, allowed):
    """The recipe (the model, its sharding and checkpoint reading) needs only its own errors and the supported
    transformers range from core; core needs nothing but itself."""
    for module, imported in import_graph().items():
        if module.startswith(f"pipeline.{layer}"):
            outside = [t for t in imported if not t.startswith(allowed)]
            assert not outside, f"{module} imports {outside}"


def test_a_backend_never_imports_a_stage_and_a_stage_never_imports_the_command_line():
    for module, imported in import_graph().items():
        if module.startswith("pipeline.backends"):
            assert not [t for t in imported if t.startswith("pipeline.stages")], module
        if module.startswith("pipeline.stages"):
            assert not [t for t in imported if t.startswith(("pipeline.cli", "pipeline.run"))], module


def test_the_graph_reader_sees_lazy_and_type_checking_imports(tmp_path, monkeypatch):
    """The reader this file relies on: an import inside a function or under TYPE_CHECKING is an edge."""
    package = tmp_path / "pipeline"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "config.py").write_text("")
    (package / "core" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from pipeline import config\n\ndef f():\n    from . import b\n")
    (package / "core" / "b.py").write_text("")
    monkeypatch.setitem(globals(), "PACKAGE", package)
    assert import_graph()["pipeline.core.a"] == {"pipeline.config", "pipeline.core.b"}


def backend_name_checks(path: Path, names: set[str]) -> list[str]:
    """Each place in ``path`` that compares a value with a backend's name, keys a table by one, or names one as a
    member of the schema's choices (``Backend.neuron``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in ("Backend", "BackendChoice") and node.attr in names):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for operand in operands:
                elements = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
                if any(isinstance(e, ast.Constant) and e.value in names for e in elements):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
        elif isinstance(node, ast.Dict):
            if any(isinstance(k, ast.Constant) and k.value in names for k in node.keys):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_nothing_outside_the_backends_asks_a_backend_by_name():
    """A backend answers for itself (pipeline/backends/registry.py): outside pipeline/backends/, no code compares a
    value with a backend's name or keys a table by one, so adding a backend is one entry there (docs/design.md)."""
    from pipeline.config import Backend
    from pipeline.core.choices import values

    names = set(values(Backend))
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if "backends" not in path.relative_to(PACKAGE).parts
             for hit in backend_name_checks(path, names)]
    assert found == []


MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_60_lines():
    """Small functions, the build code's too (a function added there, or grown, renames every version anyway: split
    it in that change)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.name} ({lines} lines)")
    assert long == []


def own_modules() -> dict[str, set[str]]:
    """Each backend's own modules: those named after it (``cpu.py``; ``neuron.py``, ``neuron_rank.py``,
    ``neuron_sdk.py`` ...), and those of its build code (its entry's ``build_code``) that no other backend's lists
    (xla's ``hlo.py``). Every other module of pipeline/backends/ is shared: the rank runtime, ``aliased_rank.py``, the
    table, the base protocol."""
    from pipeline.backends.registry import BACKENDS

    build_code = {name: entry.build_code for name, entry in BACKENDS.items()}

    def modules(rel: str) -> set[str]:
        root = PACKAGE / rel
        return {module_name(p) for p in ([root] if root.is_file() else root.rglob("*.py"))}

    listed = {name: set().union(*(modules(rel) for rel in rels)) for name, rels in build_code.items()}
    exclusive = {name: mine - set().union(*(theirs for other, theirs in listed.items() if other != name))
                 for name, mine in listed.items()}
    named = {name: {module_name(p) for p in (PACKAGE / "backends").glob("*.py")
                    if p.stem == name or p.stem.startswith(f"{name}_")} for name in build_code}
    return {name: exclusive[name] | named[name] for name in build_code}


def test_no_backend_imports_another_backends_module():
    """The backends are peers: what two of them use lives in a module of its own (the rank runtime in
    pipeline/backends/ranks.py, AliasedRank in pipeline/backends/aliased_rank.py), never in one of them; each
    backend's implementation (pipeline/backends/registry.py) is one of its own modules. (The table and what it reads,
    registry.py, packages.py and compatibility.py, answer for the backends and may import their modules.)"""
    from pipeline.backends.registry import BACKENDS

    graph, owned = import_graph(), own_modules()
    owner = {module: name for name, modules in owned.items() for module in modules}
    assert len(owner) == sum(len(modules) for modules in owned.values()), "a module owned by two backends"
    crossing = sorted(f"{module} ({owner[module]}) imports {target} ({owner[target]})"
                      for module in owner for target in graph[module]
                      if target in owner and owner[target] != owner[module])
    assert crossing == []
    for name, entry in BACKENDS.items():
        assert entry.implementation.partition(":")[0] in owned[name], name
