"""How a derived variant's name spells each field of the build shape: ``512_bf16+kv1024+fp32`` is 512_bf16 built with
kv_max 1024 and dtype fp32. Read by the config loader (the name an override builds under), ``+variant=`` with a
derived name (the overrides it stands for) and ``variant.KEY=base``.

The spellings sit here, beside ``BuildShape`` rather than in its declarations: core/shape.py is build code, which a
version's inputs digest hashes, and a name's spelling decides no byte. Every field must have one, checked on import:
a shape field without a spelling would build into the named variant's folder under its name.
"""

from __future__ import annotations

import typing
from dataclasses import fields
from enum import Enum

from pipeline.core.choices import values
from pipeline.core.shape import BuildShape

# A field's value in a derived name: "{}" is the value itself (a choice's values are unlike any other field's).
SPELLING = {"kv_max": "kv{}", "bucket": "b{}", "dtype": "{}", "prefill": "{}", "tp_degree": "tp{}",
            "batch_size": "bs{}", "smaller_buckets": "sb{}"}
LISTS = {"smaller_buckets"}
"""Fields holding a list of counts: spelled joined by '-' (``sb16-64``), an empty one ``sbnone``."""


def spelled_fields(shape: type) -> tuple[str, ...]:
    """The fields of ``shape`` in their declared order, each of which ``SPELLING`` must spell."""
    names = tuple(f.name for f in fields(shape))
    if list(SPELLING) != list(names):
        raise TypeError(f"pipeline/core/derived_names.py SPELLING must spell every field of {shape.__name__}, in its "
                        f"order {list(names)}: it has {list(SPELLING)}")
    return names


FIELDS = spelled_fields(BuildShape)
_TYPES = typing.get_type_hints(BuildShape)


def spell(key: str, value) -> str:
    """``kv_max``, 1024 -> ``kv1024``; ``smaller_buckets``, [16, 64] -> ``sb16-64``."""
    return SPELLING[key].format(text(key, value))


def text(key: str, value) -> str:
    """A field's value as a name spells it (a list's items joined by '-', ``none`` when empty)."""
    if key in LISTS:
        return "-".join(str(v) for v in value) or "none"
    return str(value)


def choices(key: str) -> list[str] | None:
    """The values a choice field (``Dtype``, ``Prefill``) takes; None for a count."""
    kind = _TYPES[key]
    return values(kind) if isinstance(kind, type) and issubclass(kind, Enum) else None


def read_part(part: str) -> tuple[str, str] | None:
    """``kv1024`` -> (``kv_max``, ``1024``); None when no field is spelled that way."""
    for key in FIELDS:
        prefix = SPELLING[key].removesuffix("{}")
        if not part.startswith(prefix):
            continue
        value, allowed = part[len(prefix):], choices(key)
        if key in LISTS:
            items = [] if value == "none" else value.split("-")
            if all(v.isascii() and v.isdigit() for v in items):
                return key, "[" + ",".join(items) + "]"
            continue
        if (value in allowed) if allowed else (value.isascii() and value.isdigit()):
            return key, value
    return None


def spellings_help() -> str:
    """What a part of a derived name may be, for a refusal: ``kv<N>, b<N>, bf16 or fp32, device or host, tp<N>,
    bs<N>, sb<N>-<N> or sbnone``."""
    return ", ".join(" or ".join(choices(key)) if choices(key) else
                     f"{spell(key, ['<N>', '<N>'])} or {spell(key, [])}" if key in LISTS else spell(key, "<N>")
                     for key in FIELDS)


def derived_name(name: str, shape: BuildShape, given: dict) -> str:
    """``name`` with a part for each field of ``shape`` that differs from ``given`` (the variant file's fields), in
    the shape's field order."""
    return "+".join([name, *[spell(key, getattr(shape, key)) for key in FIELDS
                             if text(key, getattr(shape, key)) != text(key, given[key])]])
