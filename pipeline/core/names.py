"""Names that come from outside and become paths or tags: checked here, by one set of rules, before any use.

A published repository is input like any other: its manifest names an archive and a directory, its listing names
variant folders, its tags name versions. Each such name becomes a path on the consumer's disk (``pull``, ``serve``)
or a ref on the publisher's side, so each is checked as one plain path component first (``component``), a path in a
repository as a sequence of them (``repo_path``), and a version as both a component and a tag (``tag_problem``).
``child`` is the one way a checked name is joined to a folder the command made: the result is refused unless it is
that folder's direct child.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from pipeline.core.errors import IntegrityError

MAX_COMPONENT_BYTES = 255  # NAME_MAX on Linux file systems (ext4, xfs)
# What a terminal or a log acts on or hides rather than shows: control characters (C0 and C1: ESC, CSI, NEL), format
# characters (bidi overrides such as U+202E, zero-width joiners), lone surrogates (no encoding can write them), and
# the line and paragraph separators (U+2028, U+2029). One rule for every name from outside.
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_SEPARATORS = ("/", "\\")  # of POSIX and Windows paths
# What ``git check-ref-format`` refuses anywhere in a ref: control characters, space, ``~^:?*[\``, ``..``, ``@{``
# and ``//`` (git-check-ref-format(1), rules 3-5, 8 and 10); the Hub checks tag names the same way.
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")


def component_problem(name: object) -> str | None:
    """Why ``name`` is not one plain path component, or None.

    Refused: anything but a non-empty string; ``.`` and ``..``; a separator (``/``, ``\\``) or a character of
    ``UNSAFE_CATEGORIES``; a leading ``.`` (hidden, and the mark of this project's temporary names) or ``-`` (read as
    an option by the tools a user points at it); more than 255 bytes.
    """
    if not isinstance(name, str) or not name:
        return "it is empty or not a string"
    found = unsafe_character(name) or next((sep for sep in _SEPARATORS if sep in name), None)
    if found:
        return f"it contains {found!r}"
    if name.startswith((".", "-")):
        return "it starts with '.' or '-'"
    if len(name.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
        return f"it is longer than {MAX_COMPONENT_BYTES} bytes"
    return None


def unsafe_character(text: str) -> str | None:
    """The first character of ``text`` in ``UNSAFE_CATEGORIES``, or None."""
    return next((c for c in text if unicodedata.category(c) in UNSAFE_CATEGORIES), None)


def escaped(text: str, keep: str = "") -> str:
    """``text`` as a terminal shows it safely: each character of ``UNSAFE_CATEGORIES`` but those in ``keep`` written
    as its escape (``\\x1b``, ``\\u202e``), as ``repr`` writes it."""
    if unsafe_character(text) is None:
        return text
    return "".join(repr(c)[1:-1] if c not in keep and unicodedata.category(c) in UNSAFE_CATEGORIES else c
                   for c in text)


def component(name: object, what: str) -> str:
    """``name``, when it is one plain path component; else an ``IntegrityError`` naming ``what`` it was."""
    problem = component_problem(name)
    if problem:
        raise IntegrityError(f"{what} {name!r} is not a plain file name ({problem}): refusing to use it as a path; "
                             "nothing was written")
    return name  # type: ignore[return-value]


def repo_path(path: object, what: str) -> str:
    """``path``, when it is a relative path in a repository whose every component is plain (``512_bf16/x.tar``)."""
    if not isinstance(path, str) or not path:
        raise IntegrityError(f"{what} {path!r} is not a path in the repository")
    for part in path.split("/"):
        component(part, f"{what} {path!r}: component")
    return path


def child(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` for a checked ``name``, refused unless it is a direct child of ``folder`` once resolved."""
    path = folder / component(name, what)
    if path.resolve().parent != folder.resolve():
        raise IntegrityError(f"{what} {name!r} leads outside {folder}: refusing to use it as a path")
    return path


def tag_problem(name: str) -> str | None:
    """Why ``name`` cannot be a tag (``git check-ref-format refs/tags/<name>``, and no leading ``-``, which git's
    commands would read as an option), or None."""
    if not name or name == "@":
        return "it is empty or '@'"
    found = _REF_FORBIDDEN.search(name)
    if found:
        return f"it contains {found.group()!r}"
    if name.startswith(("-", "/")) or name.endswith(("/", ".")):
        return "it starts with '-' or '/', or ends with '/' or '.'"
    if any(part.startswith(".") or part.endswith(".lock") for part in name.split("/")):
        return "a component starts with '.' or ends with '.lock'"
    return None


def version_problem(version: object) -> str | None:
    """Why ``version`` cannot name a published version: it is a tag, and a file name on the consumer's disk."""
    return component_problem(version) or tag_problem(version)  # type: ignore[arg-type]
