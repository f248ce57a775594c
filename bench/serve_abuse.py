"""``serve`` under oversized requests: does ``/health`` keep answering, and does memory come back?

Builds the tiny model's 512_fp32 (bench/serve.py's ``build``), starts ``python -m pipeline serve`` on it, and measures,
side by side in one run:

  baseline  ``/health`` latency (median and worst of 100 probes) and the server process's resident memory, idle.
  abuse     the same probes while ``--clients`` clients POST, for ``--seconds``, one after another: a ``--megabytes``
            MB prompt to ``/v1/completions`` and a prompt just short of what ``serve`` refuses untokenized
            (``engine.max_prompt_chars``: it is tokenized, then refused as too many tokens); the server's peak
            resident memory meanwhile, each answer's status and time, and the resident memory ``--settle`` seconds
            after the last one. The bodies are built before the clients start, so the probes time the server, not
            this process's own JSON encoding.

Printed as ratios against the baseline. Goals: the worst ``/health`` under abuse within 100 ms; memory after the
requests back within 1.2x of idle.

    python bench/serve_abuse.py [--megabytes 10] [--clients 4]
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
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serve import build  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_ms(port: int, timeout: float = 120) -> float:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("GET", "/health")
    conn.getresponse().read()
    conn.close()
    return (time.perf_counter() - started) * 1e3


def wait_ready(port: int, proc: subprocess.Popen, log, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"serve exited with {proc.returncode}: {log.read()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("serve did not become ready")


def model_id(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]


def post(port: int, body: bytes) -> tuple[object, float]:
    """POST ``body`` to /v1/completions with its Content-Length: (status, seconds to the answer)."""
    started = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        status = conn.getresponse().status
        conn.close()
    except OSError as exc:  # the server may close the connection before the whole body is sent
        status = f"closed ({type(exc).__name__})"
    return status, time.perf_counter() - started


def abuse(port: int, bodies: list[bytes], until: float, out: list) -> None:
    while time.monotonic() < until:
        for body in bodies:
            out.append(post(port, body))


def bodies(model: str, megabytes: float, weights: Path, kv_max: int) -> list[bytes]:
    from transformers import AutoTokenizer

    from pipeline.serving.engine import max_prompt_chars

    bound = max_prompt_chars(AutoTokenizer.from_pretrained(weights), kv_max)
    return [json.dumps({"model": model, "prompt": "Paris " * int(megabytes * 2**20 / 6), "max_tokens": 4}).encode(),
            json.dumps({"model": model, "prompt": ("Paris " * bound)[:bound - 1], "max_tokens": 4}).encode()]


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def probe(port: int, seconds: float) -> None:
    """Time /health every 20 ms for ``seconds``; print the latencies (ms) as JSON."""
    until, out = time.monotonic() + seconds, []
    while time.monotonic() < until:
        out.append(health_ms(port))
        time.sleep(0.02)
    print(json.dumps(out))


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:
        probe(int(sys.argv[2]), float(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=3.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="serve-abuse-") as tmp:
        rank_dir, weights = build(Path(tmp) / "artifacts", "512_fp32", None)
        port = free_port()
        log = open(Path(tmp) / "serve.log", "w+")  # a file, not a pipe: thousands of access lines would fill a pipe
        proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(rank_dir), "--checkpoint",
                                 str(weights), "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=log, text=True)
        try:
            wait_ready(port, proc, log)
            time.sleep(1.0)
            idle_ms = [health_ms(port) for _ in range(100)]
            idle_rss = rss(proc.pid)

            answers: list = []
            sent = bodies(model_id(port), args.megabytes, weights, 512)
            until = time.monotonic() + args.seconds
            clients = [threading.Thread(target=abuse, args=(port, sent, until, answers)) for _ in range(args.clients)]
            # The probes run in a process of their own: in this one they would wait for the clients' threads' turns
            # at the interpreter lock, and time this process instead of the server.
            prober = subprocess.Popen([sys.executable, __file__, "--probe", str(port), str(args.seconds)],
                                      stdout=subprocess.PIPE, text=True)
            peak = idle_rss
            for c in clients:
                c.start()
            while any(c.is_alive() for c in clients):
                peak = max(peak, rss(proc.pid))
                time.sleep(0.05)
            for c in clients:
                c.join()
            probes = json.loads(prober.communicate(timeout=120)[0])
            time.sleep(args.settle)
            after_rss = rss(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    mib = 2**20
    print(f"{args.clients} clients for {args.seconds:g} s: {args.megabytes:g} MB prompts and prompts at the "
          "untokenized bound, to /v1/completions")
    counts = {str(s): sum(1 for a, _ in answers if str(a) == str(s)) for s, _ in answers}
    print(f"  answers: {counts}; slowest answer {max(t for _, t in answers):.2f} s")
    p99 = statistics.quantiles(probes, n=100)[98]
    slow = sum(1 for ms in probes if ms > 100)
    print(f"  /health ms   idle: median {statistics.median(idle_ms):.1f}, worst {max(idle_ms):.1f}    under abuse: "
          f"median {statistics.median(probes):.1f}, p99 {p99:.1f}, worst {max(probes):.1f}; {slow} of {len(probes)} "
          "over 100 ms")
    print(f"  the worst probe was number {probes.index(max(probes)) + 1}")
    print(f"  worst /health under abuse / worst idle: {max(probes) / max(idle_ms):.1f}x   (goal: worst <= 100 ms)")
    print(f"  RSS MiB   idle {idle_rss / mib:.0f}, peak {peak / mib:.0f} ({peak / idle_rss:.2f}x), "
          f"{args.settle:g} s after {after_rss / mib:.0f} ({after_rss / idle_rss:.2f}x; goal <= 1.2x)")


if __name__ == "__main__":
    main()
