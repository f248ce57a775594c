"""``python -m pipeline eval SOURCE [VERSION] --checkpoint DIR``: a version's task scores beside its reference's.

Starts ``serve`` of the version on a free loopback port (every flag eval does not take is serve's: --dest,
--allow-unsigned, --public-key, ...), runs the project's lm-eval tasks against it (pipeline/evaluation/tasks.py: a
multiple-choice task scored by log-likelihood, a generation task by exact match), stops it, runs the same tasks on
the checkpoint through lm-eval's transformers backend in fp32 on the CPU, and prints both scores. Exits 1 when the
served build scores below the reference by more than --margin on any task, or with a one-line message on bad input
(before anything starts). --output writes the scores as JSON. Needs the ``[eval]`` extra (lm-eval); docs/validation.md
says when to run it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from pipeline.cli import plain
from pipeline.core.errors import InputError
from pipeline.core.log import exit_on_error, log, setup

SERVED_NAME = "pipeline-eval"  # the name lm-eval asks the server for (serve --served-model-name)
DEFAULT_MARGIN = 0.1  # absolute: one item in ten of a task may go the other way


def arguments() -> argparse.ArgumentParser:
    from pipeline.evaluation.tasks import TASKS

    parser = argparse.ArgumentParser(prog="python -m pipeline eval", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a local publish folder, a Hugging Face repo id, or a directory pull printed")
    parser.add_argument("version", nargs="?", help="a published version, or a variant's name for its newest")
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="the checkpoint the version was built from (serve's, and the reference's)")
    parser.add_argument("--tasks", nargs="+", choices=[t.name for t in TASKS], default=[t.name for t in TASKS])
    parser.add_argument("--limit", type=int, default=None, help="score only the first N items of each task")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help=f"how far below the reference a task's score may be (absolute; default {DEFAULT_MARGIN})")
    parser.add_argument("--output", type=Path, help="write the scores here (JSON)")
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds serve may take to load the build (default 1800)")
    return parser


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise InputError("eval needs lm-eval: pip install -e '.[eval]' (make test-loadtools builds .venv-eval with "
                         "it)") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


class Served:
    """``python -m pipeline serve`` of the version, for the length of a ``with``."""

    def __init__(self, args: argparse.Namespace, serve_args: list[str], log_file: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        source = [args.source] + ([args.version] if args.version else [])
        self.command = [sys.executable, "-m", "pipeline", "serve", *source, "--checkpoint", str(args.checkpoint),
                        "--port", str(self.port), "--served-model-name", SERVED_NAME, *serve_args]
        self.log_file, self.timeout_s = log_file, args.startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Served:
        with open(self.log_file, "w") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        try:
            return self._wait_ready()
        except BaseException:  # not ready in time, or interrupted: the server does not outlive eval
            self.__exit__()
            raise

    def _wait_ready(self) -> Served:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise InputError(f"serve exited with {self.proc.returncode} before it was ready:\n"
                                 f"{self.log_file.read_text()[-3000:]}")
            try:
                if get_json(f"{self.url}/health", timeout=5).get("status") == "ready":
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        raise InputError(f"serve was not ready after {self.timeout_s:g} s (--startup-timeout); its log ends:\n"
                         f"{self.log_file.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)


def main(argv: list[str]) -> int:
    from pipeline.evaluation import harness
    from pipeline.evaluation.tasks import task_named, write_tasks

    args, serve_args = arguments().parse_known_args(argv)
    setup()
    with exit_on_error():
        if not 0 <= args.margin <= 1 or (args.limit is not None and args.limit < 1):
            raise InputError(f"--margin {args.margin} --limit {args.limit}: the margin is a score from 0 to 1, the "
                             "limit 1 or more")
        require_lm_eval()
        tasks = tuple(task_named(name) for name in args.tasks)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
        with tempfile.TemporaryDirectory(prefix="pipeline-eval-") as scratch:
            folder = Path(scratch)
            write_tasks(folder / "tasks", tasks)  # both runs read them
            with Served(args, serve_args, folder / "serve.log") as served:
                model = get_json(f"{served.url}/v1/models")["data"][0]
                version, kv_max = model["root"], model["max_model_len"]
                log.info("eval: %s served at %s; lm-eval's tasks %s", version, served.url, ", ".join(args.tasks))
                on_build = harness.evaluate("local-completions",
                                            harness.served_model_args(served.url, SERVED_NAME, args.checkpoint,
                                                                      kv_max),
                                            folder / "tasks", tasks, args.limit)
            log.info("eval: the same tasks on %s (transformers, fp32, CPU)", args.checkpoint)
            reference = harness.evaluate("hf", harness.reference_model_args(args.checkpoint, kv_max),
                                         folder / "tasks", tasks, args.limit)
        scores = harness.compare(on_build, reference, args.margin, tasks)
        print(f"{version} against its checkpoint's fp32 reference ({args.checkpoint}):\n{harness.table(scores)}")
        if args.output:
            args.output.write_text(json.dumps({"version": version, "checkpoint": str(args.checkpoint),
                                               "limit": args.limit, "tasks": [s.as_json() for s in scores]},
                                              indent=1) + "\n")
        return 0 if all(s.passed for s in scores) else 1
    return 1  # pragma: no cover - exit_on_error exits
