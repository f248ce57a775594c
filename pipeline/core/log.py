"""Logging: one ``pipeline`` logger, one line format for every command and the processes they start, progress bars
only on a terminal (so CI logs stay quiet), and the one way a command turns a PipelineError into exit code 1.

The format (``FORMAT``) is set here for the subcommands and the subprocesses (``setup``), and for
``python -m pipeline`` by Hydra through conf/hydra/job_logging/pipeline.yaml, which names ``Formatter`` below.
Every command logs to standard error; standard output carries results (pull's path, generate's reply, tables).
``PIPELINE_LOG_LEVEL=DEBUG`` shows debug lines, the HTTP clients' request lines among them, in every command
(``hydra.verbose=true`` too, for the main command).

A child process whose output a stage reads (the validation worker) runs with ``PIPELINE_LOG_RELAY=1``: it writes
each record as one JSON line, and the stage re-logs it (``relay``), so the child's lines reach the stage's own
handlers (its standard error and Hydra's log file under ``artifacts/logs/``) in the one format.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator

from pipeline.core.names import escaped

log = logging.getLogger("pipeline")

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LEVEL_ENV = "PIPELINE_LOG_LEVEL"
RELAY_ENV = "PIPELINE_LOG_RELAY"
EXIT_ERROR = 1  # a PipelineError: the message says what to fix; anything else is a bug and keeps its traceback
# Libraries whose INFO lines are noise in a build log. The HTTP clients log every request at INFO: httpx, or httpx2
# (its fork, which huggingface_hub 2.x uses); their transports (httpcore, httpcore2) and urllib3 log at DEBUG.
CHATTY = ("transformers", "huggingface_hub", "torch.distributed", "filelock", "urllib3", "httpx", "httpx2", "httpcore",
          "httpcore2")


# What a secret looks like in text a server or a library wrote (an error body, a request line, a traceback): an
# Authorization header's value, a bearer token, a Hugging Face (hf_...), GitHub (ghp_..., github_pat_...) or AWS
# access key (AKIA...), and the value of a field or query parameter named like a secret.
_SECRETS = (
    (re.compile(r"(?i)(authorization\s*[:=]\s*)(?:\w+\s+)?[^\s,;'\"}]+"), r"\1[REDACTED]"),
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]{8,}"), r"\1\2[REDACTED]"),
    # Hugging Face user tokens are hf_ and 34 letters and digits; GitHub's gh?_ and 36 (hf_hub_download is no token).
    (re.compile(r"\b(?:hf|ghp|gho|ghs|ghu|ghr)_[A-Za-z0-9]{30,}\b|\bgithub_pat_[A-Za-z0-9_]{22,}"), "[REDACTED]"),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "[REDACTED]"),
    # key=value (a query string, an environment line) and "key": "value" (a JSON body), the key ending in a secret's
    # name: "max_tokens=16" and "no token: set HF_TOKEN" are no secrets.
    (re.compile(r"(?i)(\b[\w.-]*(?:token|secret|password|passwd|api[_-]?key|signature|credential)=)[^\s&\"',;}]+"),
     r"\1[REDACTED]"),
    (re.compile(r"(?i)(\"[\w.-]*(?:token|secret|password|passwd|api[_-]?key|signature|credential)\"\s*:\s*\")"
                r"[^\"]*"), r"\1[REDACTED]"),
)
REDACTED = "[REDACTED]"


def redact(text: str) -> str:
    """``text`` with anything shaped like a secret replaced by ``[REDACTED]``: every log line and every message
    built from another program's words (a server's error body) passes through here."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


class Formatter(logging.Formatter):
    """``2026-01-31 12:00:00,123 INFO pipeline: validate: 512_fp32 passed every gate``: every command's lines, with
    secrets redacted (``redact``) and control and format characters escaped."""

    def __init__(self) -> None:
        super().__init__(FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        # A name from outside (a repository's, a client's) may carry terminal escapes or bidi overrides: written as
        # escapes, as repr would (pipeline/core/names.py); the line's own newlines and tabs stay.
        return redact(escaped(super().format(record), keep="\n\t"))


class RecordLine(logging.Formatter):
    """One JSON object per record, for a parent process to re-log (``relay``); tracebacks stay inside the message."""

    def format(self, record: logging.LogRecord) -> str:
        message = redact(super().format(record))  # the message, with the exception's traceback when there is one
        return json.dumps({"name": record.name, "level": record.levelno, "message": message})


def level_from_env() -> int:
    """The level ``PIPELINE_LOG_LEVEL`` names (INFO when unset); a name logging does not know is refused."""
    name = os.environ.get(LEVEL_ENV, "INFO").strip().upper()
    value = logging.getLevelName(name)
    if not isinstance(value, int):
        raise SystemExit(f"{LEVEL_ENV}={os.environ[LEVEL_ENV]!r} is not a log level: use DEBUG, INFO, WARNING or ERROR")
    return value


def setup() -> None:
    """Logging for a subcommand or a subprocess: the one format on standard error, at ``PIPELINE_LOG_LEVEL``.

    Replaces any handlers already set (a process forked from a configured one writes to its own log file).
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RecordLine() if os.environ.get(RELAY_ENV) else Formatter())
    logging.basicConfig(level=level_from_env(), handlers=[handler], force=True)
    _finish()


def setup_under_hydra() -> None:
    """Logging for ``python -m pipeline``, whose handlers and format Hydra set (conf/hydra/job_logging/): the level
    from ``PIPELINE_LOG_LEVEL`` when it is set (else Hydra's: INFO, or DEBUG with ``hydra.verbose=true``)."""
    if os.environ.get(LEVEL_ENV):
        logging.getLogger().setLevel(level_from_env())
    _finish()


def _finish() -> None:
    logging.captureWarnings(True)  # warnings.warn(...) as log lines in the same format, not bare text
    quiet_third_party()


def relay_env() -> dict[str, str]:
    """The environment for a child whose output ``relay`` reads: records as JSON lines, at this process's level."""
    return {RELAY_ENV: "1", LEVEL_ENV: logging.getLevelName(log.getEffectiveLevel())}


def relay(lines: Iterable[str], tail: deque[str], source: str) -> None:
    """Re-log each record a child wrote (``RecordLine``) through this process's handlers, and any other line (a
    library writing to the stream itself, an interpreter crash) as an INFO record of logger ``source``. Appends the
    text, tracebacks included, to ``tail`` (a bounded deque) for an error message."""
    for line in lines:
        line = line.rstrip("\n")
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and {"name", "level", "message"} <= record.keys():
            logging.getLogger(record["name"]).log(record["level"], "%s", record["message"])
            tail.extend(record["message"].splitlines())
        elif line.strip():
            logging.getLogger(source).info("%s", line)
            tail.append(line)


def relay_output(name: str) -> None:
    """Log what this process writes to its standard output, line by line, as DEBUG records of logger ``name``.

    For rank processes, which inherit the command's standard output (its results) and hold libraries that print
    there from C++, below Python's logging: torch 2.8's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks..."
    once per rank, and two ranks' lines arrived interleaved character by character (CI). File descriptor 1 becomes
    a pipe that a daemon thread reads: each rank's lines stay whole, in the one format, shown with
    ``PIPELINE_LOG_LEVEL=DEBUG``. What is printed in the instant before the process exits may be lost.
    """
    sys.stdout.flush()
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)
    logger = logging.getLogger(name)

    def pump() -> None:
        with open(read_end, errors="replace") as printed:
            for line in printed:
                if line.strip():
                    logger.debug("%s", line.rstrip("\n"))

    threading.Thread(target=pump, name="stdout-relay", daemon=True).start()


def interactive() -> bool:
    return sys.stderr.isatty() and not os.environ.get("CI")


def quiet_third_party() -> None:
    """Silence other libraries' progress bars unless on a terminal, and their INFO chatter unless at DEBUG."""
    if not interactive():
        # transformers reads this when it is imported; only a copy imported already needs telling (importing it here
        # would cost every stage process a third of a second).
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:
            with contextlib.suppress(Exception):
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()
    debug = logging.getLogger().isEnabledFor(logging.DEBUG)
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET if debug else logging.WARNING)


@contextlib.contextmanager
def exit_on_error() -> Iterator[None]:
    """Run a command's work; a PipelineError becomes its message, logged in one line, and exit code 1.

    Every command and forked task uses this: the message names the setting at fault and the fix, so a traceback
    would only bury it.
    """
    from pipeline.core.errors import PipelineError

    try:
        yield
    except PipelineError as exc:
        log.error("%s", exc)
        raise SystemExit(EXIT_ERROR) from None


def progress(iterable, **kwargs):
    from tqdm import tqdm

    return tqdm(iterable, disable=not interactive(), leave=False, **kwargs)


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    started = time.monotonic()
    log.info("%s ...", what)
    yield
    log.info("%s done in %.1f s", what, time.monotonic() - started)
