"""``serve`` under a slowloris attack: does ``/health`` keep answering, and does the log stay readable?

Builds the tiny model's 512_fp32 (bench/serve.py's ``build``), starts ``python -m pipeline serve`` on it with
``ulimit -n 1024`` (its soft and hard file-descriptor limits), and measures, side by side in one run, on loopback only:

  baseline  ``/health`` latency (median and worst of 100 probes), the server idle.
  attack    ``--connections`` connections that each send a request line and then one header line a second, never
            ending their headers, those the server closed opened again each second (as slowloris does), for
            ``--seconds``;
            meanwhile ``/health`` probed every 50 ms from a process of its own (a probe that gets no answer in 5 s,
            or whose connection is refused or closed, counts as failed); the server's open file descriptors at
            their peak; the lines its log gained (besides one access line per answered request).
            ``--body`` trickles bodies instead: each connection sends a whole request's headers (a POST to
            ``/v1/completions`` declaring a 1000-byte body) at once, then one byte of body a second.

Printed as ratios against the baseline. Goals: every probe answered, the worst within 100 ms; the log a few lines.
``--repo`` serves with another checkout's pipeline (an earlier commit, for a before/after). ``--variant 512_fp32+bs4
--busy 4`` serves a batch-4 build with four clients streaming completions the whole time (baseline and attack alike):
``/health`` and the connection bound under a full batch.

    python bench/serve_slowloris.py [--connections 1100] [--seconds 25] [--repo /path/to/checkout]
    python bench/serve_slowloris.py --variant 512_fp32+bs4 --busy 4
    python bench/serve_slowloris.py --body --connections 300
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serve import build  # noqa: E402
from bench.serve_abuse import free_port, health_ms, wait_ready  # noqa: E402

NOFILE = 1024


def probe(port: int, seconds: float) -> None:
    """``/health`` every 50 ms for ``seconds``: print the latencies in ms (None for a failed probe) as JSON."""
    until, out = time.monotonic() + seconds, []
    while time.monotonic() < until:
        try:
            out.append(health_ms(port, timeout=5))
        except OSError:
            out.append(None)
        time.sleep(0.05)
    print(json.dumps(out))


BODY_HEADERS = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n")


def attack(port: int, connections: int, seconds: float, body: bool = False) -> dict:
    """Hold ``connections`` slowloris connections for ``seconds``; how many were opened and closed by the server.
    ``body``: each sends whole headers and then trickles its body, a byte a second."""
    opening, trickle = (BODY_HEADERS, b" ") if body else (b"GET /health HTTP/1.1\r\nHost: x\r\n", b"X-a: b\r\n")
    sel = selectors.DefaultSelector()
    opened = closed = 0

    def connect() -> None:
        nonlocal opened
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=1)
            sock.sendall(opening)
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
            opened += 1
        except OSError:
            pass

    for _ in range(connections):
        connect()
    until, next_trickle = time.monotonic() + seconds, time.monotonic()
    while time.monotonic() < until:
        for key, _ in sel.select(timeout=0.2):  # readable: the server answered or closed it
            sel.unregister(key.fileobj)
            key.fileobj.close()
            closed += 1
        if time.monotonic() >= next_trickle:  # once a second, as slowloris does: a header line on each, and
            for key in list(sel.get_map().values()):  # the connections the server closed opened again
                try:
                    key.fileobj.send(trickle)
                except OSError:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    closed += 1
            for _ in range(connections - len(sel.get_map())):
                connect()
            next_trickle += 1.0
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    return {"opened": opened, "closed_by_server": closed}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def keep_busy(port: int, clients: int, stop: threading.Event) -> list[int]:
    """``clients`` threads streaming completions one after another until ``stop``; the tokens each received."""
    import urllib.request

    from bench.serve_batching import stream

    url, tokens = f"http://127.0.0.1:{port}", [0] * clients
    version = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())["data"][0]["id"]

    def client(i: int) -> None:
        while not stop.is_set():
            tokens[i] += len(stream(url, version, f"Tell me about the number {i}.", 64)[1])

    for i in range(clients):
        threading.Thread(target=client, args=(i,), daemon=True).start()
    return tokens


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:
        probe(int(sys.argv[2]), float(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=1100)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose pipeline serves")
    parser.add_argument("--variant", default="512_fp32", help="the build served (512_fp32+bs4: four at once)")
    parser.add_argument("--busy", type=int, default=0, help="clients streaming completions the whole time")
    parser.add_argument("--body", action="store_true", help="trickle request bodies, not headers")
    args = parser.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < args.connections + 64:
        raise SystemExit(f"this process may open {hard} files: fewer than --connections {args.connections}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker's own limit, past the server's 1024

    with tempfile.TemporaryDirectory(prefix="serve-slowloris-") as tmp:
        rank_dir, weights = build(Path(tmp) / "artifacts", args.variant, None)
        port = free_port()
        log = open(Path(tmp) / "serve.log", "w+")

        def limited() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

        proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(rank_dir), "--checkpoint",
                                 str(weights), "--port", str(port)], cwd=args.repo, stdout=subprocess.DEVNULL,
                                stderr=log, text=True, preexec_fn=limited)
        busy = threading.Event()
        try:
            wait_ready(port, proc, log)
            streamed = keep_busy(port, args.busy, busy) if args.busy else []
            time.sleep(1.0 + 2.0 * bool(args.busy))  # the busy clients' sequences take their lines
            idle_ms = [health_ms(port) for _ in range(100)]
            log_before = Path(log.name).read_text().count("\n")
            prober = subprocess.Popen([sys.executable, __file__, "--probe", str(port), str(args.seconds)],
                                      stdout=subprocess.PIPE, text=True)
            started = time.monotonic()
            peak_fds = open_fds(proc.pid)
            outcome: dict = {}
            attacker = threading.Thread(target=lambda: outcome.update(attack(port, args.connections,
                                                                             args.seconds, args.body)))
            attacker.start()
            while attacker.is_alive():
                peak_fds = max(peak_fds, open_fds(proc.pid))
                time.sleep(0.1)
            probes = json.loads(prober.communicate(timeout=120)[0])
            written = Path(log.name).read_text().splitlines()[log_before:]
            access = sum(1 for line in written if " uvicorn.access: " in line)  # the probes' own requests
            log_lines = len(written) - access
            after_ms = health_ms(port, timeout=30)
            alive = proc.poll() is None
        finally:
            busy.set()
            proc.terminate()
            proc.wait(timeout=60)
        elapsed = time.monotonic() - started

    answered = [ms for ms in probes if ms is not None]
    kind = "body-trickling" if args.body else "slowloris"
    print(f"{args.connections} {kind} connections for {args.seconds:g} s against serve of {args.variant} with "
          f"ulimit -n {NOFILE} ({args.repo}); attack ran {elapsed:.0f} s: {outcome}")
    if args.busy:
        print(f"  {args.busy} clients streamed the whole time (baseline and attack): {sum(streamed)} tokens")
    baseline = "busy, no attack" if args.busy else "idle"
    print(f"  /health ms   {baseline}: median {statistics.median(idle_ms):.1f}, worst {max(idle_ms):.1f}")
    if answered:
        print(f"  under attack: {len(answered)} of {len(probes)} probes answered; median "
              f"{statistics.median(answered):.1f}, worst {max(answered):.1f}; "
              f"{sum(1 for ms in answered if ms > 100)} over 100 ms")
        print(f"  worst /health under attack / worst idle: {max(answered) / max(idle_ms):.1f}x   (goal: every probe "
              "answered, worst <= 100 ms)")
    else:
        print(f"  under attack: none of {len(probes)} probes answered")
    print(f"  server: peak open file descriptors {peak_fds} (limit {NOFILE}); log lines written during the attack "
          f"{log_lines} (besides {access} access lines of answered requests); alive after: {alive}; /health after "
          f"the attack {after_ms:.1f} ms")


if __name__ == "__main__":
    main()
