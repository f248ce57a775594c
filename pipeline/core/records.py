"""Input fingerprints and stage records: how a stage knows its outputs are already up to date.

A stage hashes everything that determines its outputs (its config section, its inputs' own fingerprints or
digests, the toolchain, the code that computes it) into a fingerprint, and writes it into its record (build.json,
manifest.json, metrics.json, ...) last. The outputs are fresh when the record exists, carries the same fingerprint
and every output it names is present, exactly as DVC decides it from dvc.lock.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path
from typing import Any

from pipeline.core.fsutil import canonical_json, read_json, sha256_bytes

PACKAGE_DIR = Path(__file__).resolve().parent


def fingerprint(parts: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``parts``: key order and formatting never matter, values always do."""
    return sha256_bytes(canonical_json(parts).encode())


def _semantic_source(path: Path) -> str:
    """The code of a Python file without comments, formatting or docstrings: what it does, not how it reads."""
    tree = ast.parse(path.read_text(), filename=str(path))
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
        for path in files:
            digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
            digest.update(_semantic_source(path).encode() + b"\0")
    return digest.hexdigest()


def read_record(path: Path) -> dict | None:
    try:
        return read_json(path)
    except (FileNotFoundError, ValueError):
        return None


def is_fresh(record_path: Path, fp: str, outputs: list[Path] = ()) -> bool:
    record = read_record(record_path)
    return bool(record) and record.get("fingerprint") == fp and all(Path(p).exists() for p in outputs)


def require_record(path: Path, stage: str, *also: Path) -> dict:
    """A stage's record (and the outputs it describes), or an error saying which stage makes them."""
    from pipeline.core.errors import PipelineError

    record = read_record(path)
    missing = [str(p) for p in (path, *also) if not Path(p).exists()]
    if record is None or missing:
        raise PipelineError(f"{', '.join(missing) or path} missing or unreadable: run stage={stage} first")
    return record
