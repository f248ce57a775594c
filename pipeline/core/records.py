"""Input fingerprints and stage records: how a stage knows its outputs are already up to date, and how a record is
read back typed.

A stage hashes everything that determines its outputs (its config section, its inputs' own fingerprints or
digests, the toolchain, the code that computes it) into a fingerprint, and writes it into its record (build.json,
manifest.json, metrics.json, ...) last. The outputs are fresh when the record reads, carries the same fingerprint
and every output it names is present, exactly as DVC decides it from dvc.lock.

``Record`` is the base of every typed record (pipeline/core/build_records.py, pipeline/artifact/manifest.py,
pipeline/validation/records.py, ...): a dataclass whose annotated fields are its schema. Its reader checks every key
and type against them (and the record's own ``problems``) and refuses a record with a missing, unknown or
wrong-typed key, naming the file, the key and the fix; its writer writes only what the reader accepts.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pipeline.core import jsonio
from pipeline.core.choices import values
from pipeline.core.errors import PipelineError
from pipeline.core.fsutil import atomic_write_json, canonical_json, sha256_bytes

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # pipeline/: the code tables name paths under it


def fingerprint(parts: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``parts``: key order and formatting never matter, values always do."""
    return sha256_bytes(canonical_json(parts).encode())


def _semantic_source(path: Path) -> str:
    """The code of a Python file without comments, formatting or docstrings: what it does, not how it reads."""
    return _semantic_text(path.read_text(), str(path))


@functools.lru_cache(maxsize=1024)
def _semantic_text(text: str, filename: str) -> str:
    # Cached by the text itself: a run computes several stages' code digests over mostly the same files, and parsing
    # is what costs; a file that changed is a new key.
    tree = ast.parse(text, filename=filename)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            body[0] = ast.Pass()
    return ast.dump(tree, include_attributes=False)


def code_digest(*relative: str) -> str:
    """Digest of the pipeline's own source under ``relative`` paths (files or directories).

    Semantic: reformatting, comments and docstrings leave it unchanged, so they never invalidate a build.
    """
    digest = hashlib.sha256()
    for rel in relative:
        root = PACKAGE_DIR / rel
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        if not files:  # a path that moved would otherwise hash as nothing, and no code change would rebuild
            raise FileNotFoundError(f"code_digest: no Python source at {root}")
        for path in files:
            digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
            digest.update(_semantic_source(path).encode() + b"\0")
    return digest.hexdigest()


# -- typed records --------------------------------------------------------------------------------------------------

R = TypeVar("R", bound="Record")


def _decode(hint: Any, value: Any, where: str, problems: list[str]) -> Any:
    """``value`` (parsed JSON) as the annotation ``hint`` reads it: dataclasses from objects, tuples from lists. Each
    mismatch is appended to ``problems`` (``where`` names the key, e.g. ``archive.sha256``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return _decode_fields(hint, value, where, problems)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _decode(inner[0], value, where, problems)
        for option in inner:  # a value of one of several kinds (``bool | float``): the first that reads it
            found: list[str] = []
            decoded = _decode(option, value, where, found)
            if not found:
                return decoded
        kinds = " or ".join(getattr(a, "__name__", str(a)) for a in inner)
        problems.append(f"field {where} has the wrong type ({type(value).__name__}; expected {kinds})")
        return value
    if origin is tuple:  # tuple[X, ...]: a JSON list, held immutable
        if not isinstance(value, list):
            problems.append(f"field {where} has the wrong type ({type(value).__name__}; expected a list)")
            return value
        return tuple(_decode(args[0], item, f"{where}[{i}]", problems) for i, item in enumerate(value))
    if origin is dict:  # dict[str, X]: JSON keys are strings already
        if not isinstance(value, dict):
            problems.append(f"field {where} has the wrong type ({type(value).__name__}; expected an object)")
            return value
        return {key: _decode(args[1], item, f"{where}.{key}", problems) for key, item in value.items()}
    if isinstance(hint, type) and issubclass(hint, Enum):  # a choice (core/choices.py): its value in JSON
        if value in values(hint):
            return hint(value)
        problems.append(f"field {where} is {value!r}, not one of {values(hint)}")
        return value
    # bool is an int to isinstance, but never a count, a size or a figure; an int is a float (JSON has one kind of
    # number, and PEP 484 reads float as "int or float": a configured limit of 30 is written as 30)
    ok = (isinstance(value, (int, float)) if hint is float else isinstance(value, hint)) and not (
        hint in (int, float) and isinstance(value, bool))
    if not ok:
        problems.append(f"field {where} has the wrong type ({type(value).__name__}; expected {hint.__name__})")
    return value


def _decode_fields(cls: type, value: Any, where: str, problems: list[str]) -> Any:
    """A dataclass from a JSON object: a field with a default may be absent, any other must be there; no other key
    may be."""
    if not isinstance(value, dict):
        problems.append(f"{where or 'the top level'} must be an object, not {type(value).__name__}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    found_before, kwargs = len(problems), {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name in value:
            kwargs[name] = _decode(hints[name], value[name], path, problems)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"missing field {path}")
    problems += [f"unknown field {where}.{key}" if where else f"unknown field {key}" for key in value
                 if key not in fields]
    return cls(**kwargs) if len(problems) == found_before else None


ADDED = "added"  # a field's metadata key: see ``added``


def added(default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING, **kwargs) -> Any:
    """A field added to a record after records of it were written: read as its default where a record lacks it, and
    written only where it differs from its default, so that every record of what existed before (a published
    manifest, a batch-1 build's records) reads and writes back byte for byte."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={ADDED: True}, **kwargs)


def _left_out(f: dataclasses.Field, value: Any) -> bool:
    if f.default is None and value is None:
        return True
    if not f.metadata.get(ADDED):
        return False
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return value == default


def encode(value: Any) -> Any:
    """A record (or any part of one) as JSON-able values: the inverse of the reader. A field whose default is None is
    an optional key, left out while it is None, and an ``added`` field is left out at its default; every other field
    is written, null or not."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not _left_out(f, getattr(value, f.name))}
    if isinstance(value, (list, tuple)):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    return value


class Record:
    """A typed record one stage writes and others read: subclasses are dataclasses whose fields are the schema.

    ``KIND`` names it in messages, ``MAKE`` says what makes it (the fix for a missing one), ``FIX`` what to do about
    one this release cannot read, and ``ERROR`` is what a refusal raises.
    """

    KIND: ClassVar[str] = "record"
    MAKE: ClassVar[str] = ""
    FIX: ClassVar[str] = ""
    ERROR: ClassVar[type[PipelineError]] = PipelineError
    SCHEMA_VERSION: ClassVar[int | None] = None
    """The ``schema_version`` a record of this release carries (None: the record has none). Another is refused
    before its keys are read: they may mean something else."""
    MAX_BYTES: ClassVar[int] = 16 << 20
    """The largest file of this kind read (pipeline/core/jsonio.py: a record may come from outside)."""

    def problems(self) -> list[str]:
        """What is wrong beyond keys and types (formats, consistency); a subclass adds its own checks."""
        return []

    def to_json(self) -> dict[str, Any]:
        return encode(self)

    @classmethod
    def from_json(cls: type[R], data: Any, source: str) -> R:
        """The record in ``data`` (parsed JSON), or ``ERROR`` listing every problem, naming ``source`` (its file)."""
        found: list[str] = []
        version = data.get("schema_version") if isinstance(data, dict) else None
        if cls.SCHEMA_VERSION is not None and version is not None and version != cls.SCHEMA_VERSION:
            found.append(f"schema_version {version!r} is not {cls.SCHEMA_VERSION} (written by another release of "
                         "the pipeline?)")
        record = None if found else _decode_fields(cls, data, "", found)
        if record is not None:
            found = record.problems()
        if found:
            raise cls.ERROR(f"{source} is not a valid {cls.KIND}:\n  - " + "\n  - ".join(found) + f"\n{cls.FIX}")
        return record

    @classmethod
    def from_bytes(cls: type[R], raw: bytes, source: str) -> R:
        """The record in the JSON text ``raw``, read within this kind's bounds (size, depth, no repeated key)."""
        if len(raw) > cls.MAX_BYTES:
            raise cls.ERROR(f"{source} is {len(raw)} bytes, more than the {cls.MAX_BYTES} a {cls.KIND} may have: "
                            f"refusing to read it. {cls.FIX}")
        try:
            data = jsonio.loads(raw)
        except jsonio.JSONRefused as exc:
            raise cls.ERROR(f"{source} is not a readable {cls.KIND}: {exc}. {cls.FIX}") from None
        return cls.from_json(data, source)

    @classmethod
    def read(cls: type[R], path: str | Path) -> R:
        path = Path(path)
        try:
            data = jsonio.read(path, cls.MAX_BYTES, cls.ERROR)
        except FileNotFoundError:
            raise cls.ERROR(f"no {cls.KIND} at {path}: {cls.MAKE}") from None
        return cls.from_json(data, str(path))

    @classmethod
    def read_if_valid(cls: type[R], path: str | Path) -> R | None:
        """The record at ``path``, or None when there is none this release can read (its outputs are then stale)."""
        try:
            return cls.read(path)
        except PipelineError:
            return None

    def write(self, path: str | Path) -> None:
        """Write it atomically, refusing (with the reader's message) what the reader would refuse."""
        data = self.to_json()
        type(self).from_json(data, f"{path} (not written)")
        atomic_write_json(path, data)
