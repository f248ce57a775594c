"""JSON from outside, parsed within bounds: the one reader of every request body, manifest, index and record.

A document is refused, with a message naming where it came from, when it is larger than its reader's bound (checked
before a byte is parsed: a file's size by ``stat``, a download's as it streams), nested deeper than ``MAX_DEPTH``
(Python's parser recurses once per level and ends in a ``RecursionError`` near a thousand; no record here nests past
six), when an object repeats a key (parsers disagree on which one wins: a signed manifest must mean one thing to every
reader), or when it uses the non-standard ``NaN`` and ``Infinity``, which Python's parser accepts and JSON has not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError, PipelineError

MAX_DEPTH = 32


class JSONRefused(ValueError):
    """A JSON document this reader refuses (not JSON, too deep, a repeated key, a non-standard constant)."""


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise JSONRefused(f"the key {key!r} appears twice in one object")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"{name} is not JSON")


def depth(value: Any) -> int:
    """How deeply ``value``'s lists and objects nest (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def loads(raw: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` parsed, or ``JSONRefused`` saying why not."""
    try:
        value = json.loads(raw, object_pairs_hook=_no_repeats, parse_constant=_no_constant)
    except RecursionError:
        raise JSONRefused(f"it nests deeper than {max_depth} levels") from None
    except JSONRefused:
        raise
    except ValueError as exc:  # json.JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise JSONRefused(f"it is not valid JSON ({exc})") from None
    if depth(value) > max_depth:
        raise JSONRefused(f"it nests deeper than {max_depth} levels")
    return value


def read_bytes(path: str | Path, max_bytes: int, error: type[PipelineError] = IntegrityError,
               named: str | None = None) -> bytes:
    """The bytes of ``path``, refused (``error`` naming it ``named``, default its path) when it is larger than
    ``max_bytes``, read no further; a missing file raises ``FileNotFoundError`` as ``open`` does."""
    named = named or str(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{named} is {size} bytes, more than the {max_bytes} a file of its kind may have: refusing "
                        "to read it")
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:  # it grew since stat
        raise error(f"{named} is more than {max_bytes} bytes: refusing to read it")
    return raw


def read(path: str | Path, max_bytes: int, error: type[PipelineError] = IntegrityError,
         named: str | None = None) -> Any:
    """The JSON document at ``path``, refused (``error`` naming it ``named``, default its path) when it is larger than
    ``max_bytes`` or ``loads`` refuses it; a missing file raises ``FileNotFoundError`` as ``open`` does."""
    raw = read_bytes(path, max_bytes, error, named)
    try:
        return loads(raw)
    except JSONRefused as exc:
        raise error(f"{named or path} cannot be read: {exc}") from None
