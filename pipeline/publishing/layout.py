"""Where a version's files live in a published repository (the Hub repo, or ``publish=local``'s git repository).

``<variant>/manifest.json``, ``<variant>/<archive>``, ``<variant>/metrics.json`` (and ``manifest.sig``), with the model
card as the root ``README.md`` and the index of every published version as the root ``versions.json`` (with
``versions.sig`` where signing is on: pipeline/publishing/index.py). A version ``<variant>-<compiler>-<inputs>`` is
tagged and lives under its variant's folder. Publish and pull both find a version's folder here, from the repository's
listing, whose every name is checked as a plain path component first (pipeline/core/names.py): a listing is input from
outside.
"""

from __future__ import annotations

from pipeline.core.log import log
from pipeline.core.names import component_problem, repo_path

MANIFEST = "manifest.json"
METRICS = "metrics.json"
CARD = "README.md"
INDEX = "versions.json"
INDEX_SIGNATURE = "versions.sig"


def variant_folders(files: list[str]) -> set[str]:
    """The folders of a listing that hold a manifest. A folder whose name is not a plain path component is left out
    (with a warning): nothing is ever read from it or written for it."""
    folders = set()
    for path in files:
        if path.count("/") != 1 or not path.endswith("/" + MANIFEST):
            continue
        folder = path.split("/")[0]
        problem = component_problem(folder)
        if problem:
            log.warning("the repository's listing names a folder %r (%s): ignored", folder, problem)
        else:
            folders.add(folder)
    return folders


def folder_of(version: str, files: list[str]) -> str | None:
    """The variant folder of ``version`` in a listing (the longest folder name it starts with, so that ``a-b``'s
    versions are not taken for ``a``'s), or None."""
    matches = [f for f in variant_folders(files) if version.startswith(f + "-")]
    return max(matches, key=len) if matches else None


def path_in(folder: str, name: str) -> str:
    """``<folder>/<name>``, each part checked: the path of one of a version's files in the repository."""
    return repo_path(f"{folder}/{name}", "a path in the repository")
