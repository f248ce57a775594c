"""What the Neuron compiler would receive, read from a graph's HLO module text (as torch-xla prints it).

Pure text: no torch-xla here, so the records and the operator check are tested on any machine. ``GraphRecord`` is what
build.json keeps per lowered graph: the hash of the module (normalised: without the debug metadata, which names this
checkout's files, and without the module's process-wide serial number), the opcode histogram of the entry
computation, and its parameter and output shapes. ``unsupported`` lists each opcode the compiler's documented
operator list (``neuronx_cc_xla_operators.py``) lacks, with the recipe lines that produced it. An instruction line
this reader cannot parse (a dynamic shape such as ``f32[<=128]``, say) is an error, never skipped.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pipeline.backends.neuronx_cc_xla_operators import OPERATORS

OPERATORS_MODULE = "pipeline/backends/neuronx_cc_xla_operators.py"

COMMENT = re.compile(r"/\*.*?\*/")  # `/*index=5*/` in long tuples
METADATA = re.compile(r", metadata=\{[^}]*\}")
MODULE_NAME = re.compile(r"HloModule [^,\s]+")
# `  %add.5 = f32[1,16]{1,0} add(f32[1,16]{1,0} %x, ...), metadata={...}`; a tuple shape is `(f32[1], s64[1])`.
INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*"
                         r"(?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+(?P<op>[a-z][a-z0-9\-]*)\(")
PARAMETER = re.compile(r"\bparameter\((\d+)\)")
ARRAY_SHAPE = re.compile(r"\w+\[[\d,]*\]")
SOURCE = re.compile(r'source_file="(?P<file>[^"]+)" source_line=(?P<line>\d+)')


@dataclass(frozen=True)
class GraphRecord:
    """One lowered graph, as build.json records it."""

    hlo_sha256: str
    opcodes: dict[str, int]  # entry computation only: a reducer's own parameters are not the graph's
    parameters: list[str]  # shapes, in parameter order
    outputs: list[str]

    def to_json(self) -> dict:
        return {"hlo_sha256": self.hlo_sha256, "opcodes": self.opcodes, "parameters": self.parameters,
                "outputs": self.outputs}


@dataclass(frozen=True)
class Unsupported:
    opcode: str
    sources: list[str]  # `file:line` of the recipe code that produced it, when the HLO carries debug metadata


def normalise(hlo: str) -> str:
    """The module text without what differs between checkouts and processes for the same graph."""
    text = METADATA.sub("", COMMENT.sub("", hlo))
    name = MODULE_NAME.match(text)
    if name is None:
        raise ValueError("not an HLO module text (it does not start with `HloModule`)")
    # The module's name (also its entry computation's) carries a process-wide serial number.
    return re.sub(rf"(?<![\w.]){re.escape(name[0].removeprefix('HloModule '))}(?![\w.])", "graph", text)


def entry_computation(hlo: str) -> str:
    start = hlo.find("\nENTRY ")
    if start < 0:
        raise ValueError("no ENTRY computation in this HLO module text")
    body = hlo[start + 1:]
    end = body.find("\n}")
    return body if end < 0 else body[:end]


def instructions(text: str):
    """Every instruction line as ``(match, line)``; a line with an assignment that does not parse is an error."""
    for line in COMMENT.sub("", text).splitlines():
        match = INSTRUCTION.match(line)
        if match:
            yield match, line
        elif " = " in line:
            raise ValueError(f"an HLO instruction this reader cannot parse: {line.strip()[:200]}")


def record(hlo: str) -> GraphRecord:
    text = normalise(hlo)
    entry = entry_computation(text)
    opcodes: Counter[str] = Counter()
    parameters: dict[int, str] = {}
    outputs: list[str] = []
    for match, line in instructions(entry):
        opcodes[match["op"]] += 1
        if match["op"] == "parameter":
            parameters[int(PARAMETER.search(line)[1])] = ARRAY_SHAPE.match(match["shape"])[0]
        if match["root"]:
            outputs = ARRAY_SHAPE.findall(match["shape"])
    return GraphRecord(hlo_sha256=hashlib.sha256(text.encode()).hexdigest(), opcodes=dict(sorted(opcodes.items())),
                       parameters=[parameters[i] for i in sorted(parameters)], outputs=outputs)


def supported_opcodes() -> frozenset[str]:
    return frozenset(OPERATORS) | {"parameter"}


def unsupported(hlo: str, package_root: Path | None = None) -> list[Unsupported]:
    """Every opcode of the module (all computations: a reducer's body is compiled too) the operator list lacks."""
    found: dict[str, set[str]] = {}
    for match, line in instructions(hlo):
        if match["op"] in supported_opcodes():
            continue
        sources = found.setdefault(match["op"], set())
        source = SOURCE.search(line)
        if source:
            path = Path(source["file"])
            if package_root is not None and path.is_relative_to(package_root):
                path = path.relative_to(package_root)
            sources.add(f"{path}:{source['line']}")
    return [Unsupported(op, sorted(found[op])) for op in sorted(found)]


def describe(graph: str, problems: list[Unsupported]) -> str:
    parts = [f"{p.opcode} (from {', '.join(p.sources) or 'a line the HLO does not name'})" for p in problems]
    return (f"the {graph} graph holds HLO operators the Neuron compiler does not list as supported: "
            f"{'; '.join(parts)}. "
            f"Change the recipe so it lowers to listed operators ({OPERATORS_MODULE}), or, if a newer neuronx-cc "
            "documents the operator, add it there with its source")
