"""Logging and progress bars: one ``pipeline`` logger; bars only on a terminal, so CI logs stay quiet."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

log = logging.getLogger("pipeline")


def interactive() -> bool:
    return sys.stderr.isatty() and not os.environ.get("CI")


def quiet_third_party() -> None:
    """Silence other libraries' progress bars and chatter unless on a terminal."""
    if not interactive():
        # transformers reads this when it is imported; only a copy imported already needs telling (importing it here
        # would cost every stage process a third of a second).
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:
            with contextlib.suppress(Exception):
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
    for name in ("transformers", "huggingface_hub", "torch.distributed", "filelock", "urllib3", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


def progress(iterable, **kwargs):
    from tqdm import tqdm

    return tqdm(iterable, disable=not interactive(), leave=False, **kwargs)


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    started = time.monotonic()
    log.info("%s ...", what)
    yield
    log.info("%s done in %.1f s", what, time.monotonic() - started)
