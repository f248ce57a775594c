"""``serve`` after clients abandon big requests: does it stop decoding for them, and do other clients get in?

Builds the tiny model's 512_fp32 (bench/serve.py's ``build``), starts ``python -m pipeline serve`` on it, and measures,
side by side in one run, on loopback only:

  baseline   ``--probes`` requests of 4 new tokens from one client, one after another, the server otherwise idle: each
             one's time (and status).
  abandoned  ``--abandoned`` clients each POST a non-streamed ``/v1/completions`` of 16 prompts x ``n`` 16 x 200
             tokens (256 sequences) and close their connection 0.3 s later, before any answer. Then the same probes
             as the baseline; and the tokens the server decoded in the ``--watch`` seconds after the last client left
             (``serve_tokens_generated_total``, less the probes' own): tokens for nobody.

Printed as ratios against the baseline. Goals: no tokens for nobody past the cancellation (each abandoned request's
sequences end before their next token); the probes within 2x of the baseline's time; none refused.
``--repo`` serves with another checkout's pipeline (an earlier commit, for a before/after).

    python bench/serve_abandoned.py [--abandoned 9] [--probes 5] [--watch 20] [--repo /path/to/checkout]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serve import build  # noqa: E402
from bench.serve_abuse import free_port, model_id, wait_ready  # noqa: E402

PROBE_TIMEOUT_S = 60.0


def generated(port: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("serve_tokens_generated_total"))


def probe(port: int, version: str) -> tuple[int, float]:
    """One 4-token completion: its status and seconds (the timeout's when it got no answer)."""
    body = json.dumps({"model": version, "prompt": "The capital of France is", "max_tokens": 4})
    started = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_TIMEOUT_S)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        status = conn.getresponse().status
    except OSError:
        status = 0
    return status, time.perf_counter() - started


def abandon(port: int, version: str) -> None:
    """A big non-streamed request, its connection closed 0.3 s later."""
    body = json.dumps({"model": version, "prompt": [f"Tell me about the number {i}." for i in range(16)], "n": 16,
                       "max_tokens": 200}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(0.3)
    sock.close()


def summary(results: list[tuple[int, float]]) -> str:
    times = [s for _, s in results]
    refused = sum(status != 200 for status, _ in results)
    return f"median {statistics.median(times):.2f} s, worst {max(times):.2f} s, {refused} not answered 200"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--abandoned", type=int, default=9)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--watch", type=float, default=20.0)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose pipeline serves")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-abandoned-") as tmp:
        rank_dir, weights = build(Path(tmp) / "artifacts", "512_fp32", None)
        port = free_port()
        log = open(Path(tmp) / "serve.log", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(rank_dir), "--checkpoint",
                                 str(weights), "--port", str(port)], cwd=args.repo, stdout=subprocess.DEVNULL,
                                stderr=log, text=True)
        try:
            wait_ready(port, proc, log)
            version = model_id(port)
            baseline = [probe(port, version) for _ in range(args.probes)]
            for _ in range(args.abandoned):
                abandon(port, version)
            left = time.monotonic()
            time.sleep(1.0)  # the cancellation's own second: a step or two may still land
            before = generated(port)
            after = [probe(port, version) for _ in range(args.probes)]
            time.sleep(max(0.0, left + 1.0 + args.watch - time.monotonic()))
            for_nobody = generated(port) - before - 4 * sum(status == 200 for status, _ in after)
        finally:
            proc.kill()  # an earlier serve may still be decoding for nobody: SIGTERM would wait for it
            proc.wait(timeout=60)
    print(f"{args.abandoned} clients each asked for 16 prompts x n=16 x 200 tokens (non-streamed) and left after "
          f"0.3 s; serve of 512_fp32 ({args.repo})")
    print(f"  4-token requests, idle:              {summary(baseline)}")
    print(f"  4-token requests, after they left:   {summary(after)}")
    ratio = statistics.median(s for _, s in after) / statistics.median(s for _, s in baseline)
    print(f"  median after / idle: {ratio:.1f}x   (goal: within 2x, none refused)")
    print(f"  tokens decoded for nobody from 1 s to {1 + args.watch:g} s after they left: {for_nobody:.0f}   (goal: 0)")


if __name__ == "__main__":
    main()
