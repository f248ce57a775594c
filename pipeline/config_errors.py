"""Turning OmegaConf's errors into the project's own messages, each naming the setting and the fix, and collecting
every problem of a config into one list.

``merge_reporting`` merges a composed config into the schema, turning each OmegaConf error into a message naming
the key and its allowed values (or, for an unknown key, the nearest real one: ``unknown_key_in``, which the command
line also asks before Hydra composes anything), and sets each bad key aside in turn so that one run names them all.

The schema (pipeline/config.py's ``PipelineConfig``) is passed in: config.py imports this module, so importing it
here would be a cycle. Torch-free, as config.py is: every build and every dvc.yaml stage imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from enum import Enum
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, KeyValidationError, MissingMandatoryValue, OmegaConfBaseException
from omegaconf.nodes import EnumNode

from pipeline.core.choices import values

# -- merging a composed config into the schema ------------------------------------------------------------------------

MAX_TYPE_ERRORS = 50  # reported at once; a config with more is hopeless anyway


def merge_reporting(schema: type, data: dict) -> tuple[Any, list[str]]:
    """``data`` (a plain dict, changed in place: pass a copy) merged into ``schema`` and converted to dataclasses,
    and one message for each type error and unknown key; the object is None when the errors left nothing to build.

    To check the rest, each bad key is set aside in turn: a refused choice is replaced by its enum's first member
    (each enum lists first the member that asks nothing of other keys: ``tiny`` before ``hub``), any other bad key is
    dropped, its default standing in (a key without a default takes its section with it).
    """
    found: list[str] = []
    reported: set[str] = set()
    typed = None
    for _ in range(MAX_TYPE_ERRORS):
        try:
            typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), data))
            break
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or ""
            if isinstance(exc, MissingMandatoryValue) and key in reported:
                # Its bad value was dropped and it has no default: its section goes too (its own checks need it).
                key = key.rpartition(".")[0]
            else:
                found.append(_type_error_message(schema, exc))
                reported.add(key)
            if not _set_aside(data, key, _refused_choice(exc)):
                break
    return typed, found


def _type_error_message(schema: type, exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "?"
    text = f"{key}: {str(exc).splitlines()[0]}"
    if isinstance(exc, ConfigKeyError):  # a key the schema lacks
        return unknown_key_in(schema, key) or f"unknown key {key!r}"
    if isinstance(exc, KeyValidationError):  # e.g. a key of an enum-keyed dict that is not a member
        return unknown_key_in(schema, key) or text
    if isinstance(exc, MissingMandatoryValue):
        return f"{key} is required but not set"
    choices = _refused_choice(exc)
    return f"{key}={exc.value!r} is not one of {values(choices)}" if choices else text


def _refused_choice(exc: OmegaConfBaseException) -> type[Enum] | None:
    """The enum a refused (or missing) value was to be a member of: an Enum-typed field's, or a list of them's
    elements'; None for any other error."""
    if isinstance(exc, (ConfigKeyError, KeyValidationError)):
        return None
    child = getattr(exc, "child_node", None)
    if isinstance(child, EnumNode):
        return child.enum_type
    element = getattr(getattr(getattr(exc, "parent_node", None), "_metadata", None), "element_type", None)
    return element if _is_enum(element) else None


def _set_aside(data: dict, full_key: str, choices: type[Enum] | None) -> bool:
    """Replace the value at ``full_key`` (dotted, list indices in brackets) in ``data`` by the first of ``choices``,
    or remove it when there are none; False when it is not there."""
    if not full_key:
        return False
    *parents, last = _key_parts(full_key)
    node: Any = data
    for part in parents:
        node = _item(node, part)
    index: Any = last
    if isinstance(node, list) and _item(node, last) is not None:
        index = int(last)
    elif not (isinstance(node, dict) and (last in node or choices is not None)):
        return False
    if choices is not None:
        node[index] = values(choices)[0]
    else:
        del node[index]
    return True


def _item(node: Any, part: str) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    return None


# -- unknown keys: the nearest real one ----------------------------------------------------------------------------

def unknown_key_in(schema: type, full_key: str) -> str | None:
    """Why ``full_key`` (``validate.max_new_tokenz``; list indices in brackets) is no key of ``schema``, naming the
    nearest real key, or None when it is one. Keys of a dict with free-form keys (``floors.neuron.<hardware>``) are
    all accepted."""
    parts = _key_parts(full_key)
    node: Any = schema
    for depth, part in enumerate(parts):
        keys = _keys_there(node, part)
        if keys is not None:
            return _unknown_message(schema, full_key, parts, depth, keys)
        node = _type_under(node, part)
    return None


def _unknown_message(schema: type, full_key: str, parts: list[str], depth: int, keys: list[str]) -> str:
    near = _nearest(schema, parts, depth, keys)
    if near:
        return f"unknown key {full_key!r}: did you mean {near!r}?"
    where = _join(parts[:depth])
    if not keys:
        return f"unknown key {full_key!r}: {where} is a value, it has no keys"
    return f"unknown key {full_key!r}: {where or 'the top level'} has {', '.join(keys)}"


def _nearest(schema: type, parts: list[str], depth: int, keys: list[str]) -> str | None:
    """The real key nearest to ``parts``, whose part at ``depth`` is not among ``keys``: that part corrected, else (a
    key put in the wrong section) the key of the nearest name elsewhere."""
    import difflib  # only for a misspelt key: every build and every dvc.yaml stage imports this module

    close = difflib.get_close_matches(parts[depth], keys, n=1)
    if close:  # the misspelt part corrected, and the rest kept if it then names a key
        fixed = [*parts[:depth], close[0], *parts[depth + 1:]]
        return _join(fixed) if unknown_key_in(schema, _join(fixed)) is None else _join(fixed[:depth + 1])
    if depth == 0 or depth != len(parts) - 1:
        return None
    by_name: dict[str, list[str]] = {}
    for key in _schema_keys(schema):
        by_name.setdefault(key.rpartition(".")[2], []).append(key)
    # Stricter than for a misspelt part: a name from another section is a guess only when it is nearly the same.
    close = difflib.get_close_matches(parts[depth], list(by_name), n=1, cutoff=0.8)
    given = _join(parts)
    return max(by_name[close[0]], key=lambda k: difflib.SequenceMatcher(None, k, given).ratio()) if close else None


def _keys_there(schema: Any, part: str) -> list[str] | None:
    """None when ``part`` is a key of a config node of schema type ``schema``; else the keys that node has."""
    schema = _non_optional(schema)
    origin, args = typing.get_origin(schema), typing.get_args(schema)
    if dataclasses.is_dataclass(schema):
        keys = [f.name for f in dataclasses.fields(schema)]
    elif origin is dict and _is_enum(args[0]):
        keys = values(args[0])
    elif origin is dict or (origin is list and part.isdigit()):
        return None
    else:
        keys = []
    return None if part in keys else keys


def _type_under(schema: Any, part: str) -> Any:
    schema = _non_optional(schema)
    if dataclasses.is_dataclass(schema):
        return _field_types(schema)[part]
    return typing.get_args(schema)[-1]  # a dict's values, a list's elements


@functools.cache
def _schema_keys(schema: Any, prefix: str = "") -> tuple[str, ...]:
    """Every key of the schema's sections (not those inside its dicts and lists), dotted."""
    found: list[str] = []
    for name, hint in _field_types(schema).items():
        found.append(prefix + name)
        if dataclasses.is_dataclass(_non_optional(hint)):
            found += _schema_keys(_non_optional(hint), f"{prefix}{name}.")
    return tuple(found)


@functools.cache
def _field_types(schema: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _non_optional(schema: Any) -> Any:
    args = typing.get_args(schema)
    rest = [a for a in args if a is not type(None)]
    return rest[0] if type(None) in args and len(rest) == 1 else schema


def _is_enum(schema: Any) -> bool:
    return isinstance(schema, type) and issubclass(schema, Enum)


def _key_parts(full_key: str) -> list[str]:
    return re.sub(r"\[(\d+)\]", r".\1", full_key).split(".")


def _join(parts: list[str]) -> str:
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts).lstrip(".")
