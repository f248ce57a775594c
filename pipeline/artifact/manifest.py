"""The manifest: what a packaged build is, and the checksums everything downstream trusts.

It is checked against its schema every time it is read, so a truncated, hand-edited or foreign manifest is refused
with the field at fault before anything it describes is touched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pipeline.core.errors import IntegrityError
from pipeline.core.fsutil import atomic_write_json, read_json

SCHEMA_VERSION = 1
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MEMBER_RE = re.compile(r"^(tp_(0|[1-9][0-9]*)\.pt|model\.pt)$")

# key -> expected type (a dict describes a nested object)
SCHEMA: dict[str, Any] = {
    "schema_version": int,
    "version": str,
    "fingerprint": str,
    "model": {"name": str, "hub_id": (str, type(None)), "revision": (str, type(None)), "config_digest": str,
              "weights_digest": str},
    "variant": {"name": str, "kv_max": int, "bucket": int, "dtype": str, "prefill": str, "tp_degree": int},
    "backend": str,
    "compiler": {"id": str, "args": list, "versions": dict},
    "toolchain": dict,
    "layout": str,
    "members": list,
    "archive": {"name": str, "format": str, "size": int, "sha256": str, "root": str},
}
OPTIONAL = {"validation": dict, "regression": dict, "created_by": str, "signature": dict}


def _check(obj: Any, schema: dict, where: str) -> list[str]:
    problems = []
    if not isinstance(obj, dict):
        return [f"{where or 'manifest'} must be an object"]
    for key, expected in schema.items():
        path = f"{where}.{key}" if where else key
        if key not in obj:
            problems.append(f"missing field {path}")
        elif isinstance(expected, dict):
            problems += _check(obj[key], expected, path)
        elif not isinstance(obj[key], expected) or (expected is int and isinstance(obj[key], bool)):
            problems.append(f"field {path} has the wrong type ({type(obj[key]).__name__})")
    for key, expected in OPTIONAL.items():
        if not where and key in obj and not isinstance(obj[key], expected):
            problems.append(f"field {key} has the wrong type ({type(obj[key]).__name__})")
    return problems


def problems(manifest: Any) -> list[str]:
    found = _check(manifest, SCHEMA, "")
    if found:
        return found
    if manifest["schema_version"] != SCHEMA_VERSION:
        found.append(f"schema_version {manifest['schema_version']} is not {SCHEMA_VERSION} (made by another release?)")
    for key in ("fingerprint",):
        if not SHA256_RE.match(manifest[key]):
            found.append(f"field {key} is not a sha256")
    if not SHA256_RE.match(manifest["archive"]["sha256"]):
        found.append("field archive.sha256 is not a sha256")
    names = []
    for i, member in enumerate(manifest["members"]):
        if not isinstance(member, dict) or set(member) != {"path", "size", "sha256"}:
            found.append(f"members[{i}] must have exactly path, size, sha256")
            continue
        if not isinstance(member["path"], str) or not MEMBER_RE.match(member["path"]):
            found.append(f"members[{i}].path {member['path']!r} is not a rank file name")
        if not isinstance(member["size"], int) or member["size"] < 0:
            found.append(f"members[{i}].size must be a non-negative integer")
        if not isinstance(member["sha256"], str) or not SHA256_RE.match(member["sha256"]):
            found.append(f"members[{i}].sha256 is not a sha256")
        names.append(member["path"])
    if len(set(names)) != len(names):
        found.append(f"members has duplicate paths: {names}")
    if manifest["layout"] == "per_rank":
        expected = [f"tp_{r}.pt" for r in range(manifest["variant"]["tp_degree"])]
        if sorted(names) != sorted(expected):
            found.append(f"members {sorted(names)} do not match tp_degree={manifest['variant']['tp_degree']} "
                         f"(expected {expected})")
    root = manifest["archive"]["root"]
    if not root or "/" in root or root in (".", "..") or root.startswith("."):
        found.append(f"archive.root {root!r} must be a plain directory name")
    return found


def check(manifest: Any, source: str = "manifest") -> dict:
    found = problems(manifest)
    if found:
        raise IntegrityError(f"{source} is not a valid manifest:\n  - " + "\n  - ".join(found))
    return manifest


def load(path: str | Path) -> dict:
    """Read and schema-check a manifest; ``IntegrityError`` names what is wrong."""
    path = Path(path)
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise IntegrityError(f"no manifest at {path}: run the package stage first") from None
    except ValueError as exc:
        raise IntegrityError(f"{path} is not valid JSON ({exc})") from None
    return check(data, str(path))


def write(path: str | Path, manifest: dict) -> None:
    atomic_write_json(path, check(manifest))
