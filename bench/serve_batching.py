"""Continuous batching through ``serve``'s HTTP routes: a batch-1 and a batch-4 build of the same variant, against
transformers' own batched ``generate``, on the same machine in one run.

Builds the variant at ``batch_size`` 1 and 4 with the pipeline's own stages (the embedded tiny model by default;
``--e4b-layers N`` writes a checkpoint at google/gemma-4-E4B-it's real widths with N layers, as
``bench/rank_weights_rss.py`` does), serves each in turn, and drives it with 1, 2, 4 and 8 clients at once, each
sending ``--requests`` streamed completions of ``--tokens`` new tokens (greedy, a prompt of its own) one after another.
Per build and client count, from the clients' clocks (one event per token):

  aggregate   every client's tokens over the wall time from the first request sent to the last token received
  ttft        time to first token per request (queue wait and the prefills ahead of it included): p50 and p99
  itl         inter-token latency, consecutive events of one request: p50 and p99

The baseline: ``Gemma4ForCausalLM.generate`` of the same eight prompts at once, left-padded, greedy, the same new
tokens, at the variant's dtype, with every CPU this process may use (the two rank processes share those CPUs), timed
after a warm-up; and of as many prompts as each batched build decodes at once (like for like: as many rows per step).
Goals (issue 48): at 8 clients batch 4 gives at least 3x
batch 1's aggregate on the tiny model; at E4B's widths at least transformers' batched generate; p50 inter-token
latency at batch 4 at most 1.5x batch 1's on the tiny model.

The hand-written client checked against a load tool (``--aiperf PATH``, aiperf's executable: make test-loadtools
builds .venv-aiperf): with every build's figures taken, aiperf drives the batch-4 build at the most clients with the
same concurrency, request count and output length, and both clients' aggregate tokens/s, first token and inter-token
p50 are printed side by side, as a ratio. Both ask for fixed output lengths (``ignore_eos``).

    python bench/serve_batching.py [--e4b-layers 6] [--variant 512_bf16] [--tokens 64] [--requests 3] [--batches 1,4]
                                   [--aiperf .venv-aiperf/bin/aiperf]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.serve import build, e4b_checkpoint, free_port  # noqa: E402

CLIENTS = (1, 2, 4, 8)
BATCH = 4  # the batched build the goals name
TOPICS = ["the sea", "a lighthouse", "mountains", "a city at night", "the desert", "an old library", "a storm",
          "a garden in spring"]


def prompt(i: int) -> str:
    return f"Write a few sentences about {TOPICS[i % len(TOPICS)]}."


def stream(url: str, version: str, text: str, tokens: int) -> tuple[float, list[float]]:
    """One streamed completion: ``(sent, [arrival of each token])`` by this client's clock."""
    body = json.dumps({"model": version, "prompt": text, "max_tokens": tokens, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    sent, arrivals = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=900) as response:
        for raw in response:
            line = raw.decode().strip()
            # one event per token; the last event of a choice only carries its finish (no token)
            choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else []
            if choices and choices[0]["finish_reason"] is None:
                arrivals.append(time.perf_counter())
    return sent, arrivals


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def drive(url: str, version: str, clients: int, requests: int, tokens: int) -> dict:
    """``clients`` threads, each sending ``requests`` streamed completions in turn; the figures of the module's
    docstring."""
    runs: list[tuple[float, list[float]]] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            got = stream(url, version, prompt(c * requests + r), tokens)
            with lock:
                runs.append(got)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tokens_in = sum(len(a) for _, a in runs)
    wall = max(a[-1] for _, a in runs) - started
    ttft = [a[0] - s for s, a in runs]
    itl = [y - x for _, a in runs for x, y in zip(a, a[1:])]
    return {"aggregate": tokens_in / wall, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99), "tokens": tokens_in}


def serve(rank_dir: Path, weights: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(rank_dir), "--checkpoint", str(weights),
                             "--port", str(port), "--queue-size", "16", "--queue-timeout", "3600"], cwd=REPO,
                            stderr=subprocess.DEVNULL)
    while True:
        assert proc.poll() is None, "serve exited"
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                break
        except OSError:
            time.sleep(0.5)
    version = json.loads(rank_dir.with_name(rank_dir.name + ".manifest.json").read_text())["version"]
    return proc, url, version


def measure_build(rank_dir: Path, weights: Path, requests: int, tokens: int, aiperf: str | None = None
                  ) -> dict[int, dict]:
    """Each client count's figures (``drive``); with ``aiperf``, also aiperf's at the most clients (key "aiperf")."""
    proc, url, version = serve(rank_dir, weights)
    try:
        drive(url, version, BATCH, 1, tokens)  # warm-up: every line's first use
        figures = {c: drive(url, version, c, requests, tokens) for c in CLIENTS}
        if aiperf:
            figures["aiperf"] = aiperf_run(aiperf, url, version, weights, max(CLIENTS), requests, tokens)
        return figures
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def aiperf_run(aiperf: str, url: str, version: str, weights: Path, clients: int, requests: int, tokens: int) -> dict:
    """aiperf's streamed completions profile: ``clients`` at once, ``clients * requests`` requests of ``tokens`` new
    tokens each, prompts of about this benchmark's length (12 tokens); its aggregate output tokens/s and p50s."""
    with tempfile.TemporaryDirectory(prefix="gemma4-bench-aiperf-") as art:
        subprocess.run([aiperf, "profile", "--model", version, "--url", url, "--endpoint-type", "completions",
                        "--streaming", "--concurrency", str(clients), "--request-count", str(clients * requests),
                        "--isl", "12", "--osl", str(tokens), "--tokenizer", str(weights), "--artifact-dir", art,
                        "--extra-inputs", "ignore_eos:true", "--use-server-token-count"],
                       check=True, capture_output=True, text=True,
                       # aiperf 0.13 in offline mode looks a tokenizer up as a Hub repository only, never a folder
                       env={k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")})
        said = json.loads((Path(art) / "profile_export_aiperf.json").read_text())
    return {"aggregate": said["output_token_throughput"]["avg"], "ttft_p50": said["time_to_first_token"]["p50"] / 1e3,
            "itl_p50": said["inter_token_latency"]["p50"] / 1e3,
            "tokens": said["output_sequence_length"]["sum"]}


BASELINE = r"""
import json, sys, time, torch
from transformers import AutoTokenizer, Gemma4ForCausalLM
path, dtype, tokens, prompts = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
tok = AutoTokenizer.from_pretrained(path)
tok.padding_side = "left"
model = Gemma4ForCausalLM.from_pretrained(path, dtype=dtype).eval()
batch = tok(prompts, return_tensors="pt", padding=True)
with torch.no_grad():
    model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
    started = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    wall = time.perf_counter() - started
print(json.dumps({"aggregate": (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / wall,
                  "threads": torch.get_num_threads()}))
"""


def transformers_generate(weights: Path, dtype: str, tokens: int, prompts: int) -> dict:
    prompts = [prompt(i) for i in range(prompts)]
    out = subprocess.run([sys.executable, "-c", BASELINE, str(weights), dtype, str(tokens), json.dumps(prompts)],
                         cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e4b-layers", type=int, default=0,
                        help="an E4B-shaped checkpoint with this many layers (6); default: the tiny model")
    parser.add_argument("--variant", default="512_bf16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3, help="requests each client sends in turn")
    parser.add_argument("--batches", default="1,4", help="the builds' batch sizes (1 and 4 at least)")
    parser.add_argument("--aiperf", help="aiperf's executable: check this client against it on the batch-4 build")
    args = parser.parse_args()
    batches = sorted({int(b) for b in args.batches.split(",")} | {1, BATCH})
    work = Path(tempfile.mkdtemp(prefix="gemma4-bench-batching-"))
    try:
        checkpoint = e4b_checkpoint(args.e4b_layers, work / "e4b") if args.e4b_layers else None
        built = {}
        for batch in batches:
            variant = args.variant if batch == 1 else f"{args.variant}+bs{batch}"
            started = time.monotonic()
            built[batch] = build(work / f"artifacts-{batch}", variant, checkpoint)
            print(f"built {variant} in {time.monotonic() - started:.0f} s", flush=True)
        figures = {batch: measure_build(*built[batch], args.requests, args.tokens,
                                        args.aiperf if batch == BATCH else None) for batch in built}
        checked = figures[BATCH].pop("aiperf", None)
        dtype = "bfloat16" if "bf16" in args.variant else "float32"
        baseline = transformers_generate(built[1][1], dtype, args.tokens, max(CLIENTS))
        alike = {b: transformers_generate(built[1][1], dtype, args.tokens, b) for b in batches if 1 < b < max(CLIENTS)}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    model = f"E4B widths, {args.e4b_layers} layers" if args.e4b_layers else "the tiny model"
    print(f"\n{args.variant} on {model}, cpu backend (tp_degree 2), {args.tokens} new tokens per request, "
          f"{args.requests} requests per client, {os.cpu_count()} CPUs")
    print(f"{'batch':>5} {'clients':>7} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8}")
    for batch, rows in figures.items():
        for clients, f in rows.items():
            print(f"{batch:>5} {clients:>7} {f['aggregate']:>8.1f} {1e3 * f['ttft_p50']:>9.1f} "
                  f"{1e3 * f['ttft_p99']:>9.1f} {1e3 * f['itl_p50']:>8.1f} {1e3 * f['itl_p99']:>8.1f}")
    print(f"transformers generate, {max(CLIENTS)} prompts at once ({baseline['threads']} threads): "
          f"{baseline['aggregate']:.1f} tok/s; " + ", ".join(f"{b} at once: {f['aggregate']:.1f} tok/s"
                                                             for b, f in alike.items()))
    for batch in batches[1:]:  # like for like: as many rows per step on both sides
        ours = figures[batch][max(CLIENTS)]["aggregate"]
        theirs = alike.get(batch, baseline)["aggregate"]
        print(f"ratio batch {batch} at {max(CLIENTS)} clients / transformers generate of {min(batch, max(CLIENTS))} "
              f"prompts at once: {ours / theirs:.2f}")
    one, four = figures[1][max(CLIENTS)], figures[BATCH][max(CLIENTS)]
    print(f"ratio batch {BATCH} / batch 1 aggregate at {max(CLIENTS)} clients: "
          f"{four['aggregate'] / one['aggregate']:.2f}  (goal on the tiny model >= 3)")
    print(f"ratio batch {BATCH} at {max(CLIENTS)} clients / transformers batched generate: "
          f"{four['aggregate'] / baseline['aggregate']:.2f}  (goal at E4B widths >= 1)")
    print(f"ratio itl p50 batch {BATCH} / batch 1 at {max(CLIENTS)} clients: "
          f"{four['itl_p50'] / one['itl_p50']:.2f}  (goal on the tiny model <= 1.5)")
    if checked:
        ours = figures[BATCH][max(CLIENTS)]
        print(f"aiperf at {max(CLIENTS)} clients, batch {BATCH}: {checked['aggregate']:.1f} tok/s, ttft p50 "
              f"{1e3 * checked['ttft_p50']:.1f} ms, itl p50 {1e3 * checked['itl_p50']:.1f} ms; ratio this client / "
              f"aiperf: aggregate {ours['aggregate'] / checked['aggregate']:.2f}, ttft p50 "
              f"{ours['ttft_p50'] / checked['ttft_p50']:.2f}, itl p50 {ours['itl_p50'] / checked['itl_p50']:.2f}")
    print(json.dumps({"figures": {str(b): {str(c): f for c, f in rows.items()} for b, rows in figures.items()},
                      "transformers": baseline, "transformers_alike": alike, "aiperf": checked}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
