"""Where this user's pulled versions live by default: a cache folder like the Hub's, never the current directory.

``GEMMA4_PIPELINE_CACHE`` if set, else ``$XDG_CACHE_HOME/gemma4-neuron-pipeline``, else
``~/.cache/gemma4-neuron-pipeline``; pulled versions go in its ``versions/`` folder (``pull`` and ``serve`` without
``--dest``).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "GEMMA4_PIPELINE_CACHE"


def cache_root() -> Path:
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gemma4-neuron-pipeline"


def versions_dir() -> Path:
    """The default ``--dest`` of ``pull`` and ``serve``."""
    return cache_root() / "versions"
