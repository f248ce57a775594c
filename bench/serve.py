"""``serve``'s host footprint and its overhead over ``generate``, on one build, in one run.

Builds one variant with the pipeline's own stages (the embedded tiny model by default; ``--e4b-layers N`` writes a
checkpoint with google/gemma-4-E4B-it's real vocabulary, hidden size and per-layer width but N layers, as
``bench/rank_weights_rss.py`` does), unpacks it as ``pull`` would, then measures:

  footprint  the ``serve`` process's resident memory once ready and after requests, against the bytes of the two
             embedding tables it looks rows up in, plus the runtime's fixed overhead (a process that imports what
             ``serve`` imports and loads the tokenizer, run side by side: the baseline). Goal: at most 1.3x (tables
             + fixed overhead). The rank processes (the decoder: on inf2 it lives on the NeuronCores) are shown apart.
  overhead   decode speed and time to first token of ``/v1/chat/completions`` with ``stream: true``, timed by the
             client per event (one event per token), against what ``generate`` reports for the same prompt on the
             same build (median of the runs each). Goals: tokens/s >= 0.95x, first token <= 1.1x + 5 ms.

    python bench/serve.py [--e4b-layers 6] [--variant 512_bf16] [--tokens 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QUESTION = "What is the capital of France?"
BASELINE = r"""
import sys
import pipeline.cli.serve, pipeline.serving.engine, pipeline.serving.routes, torch, transformers, uvicorn
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1])
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) * 1024)
"""


def pipeline(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pipeline", *args], check=True, cwd=REPO, capture_output=True)


def build(artifacts: Path, variant: str, checkpoint: Path | None) -> tuple[Path, Path]:
    """The variant built and unpacked as pull leaves it: ``(rank directory, checkpoint)``."""
    from pipeline.artifact.archive import extract_verified
    from pipeline.artifact.manifest import Manifest

    model = "bench_model"
    common = [f"artifacts_dir={artifacts}", "backend=cpu", f"model.name={model}"]
    if checkpoint:
        common += ["model=gemma4_e4b", f"model.path={checkpoint}", "model.text_prefix=model."]
    for stage in ("toolchain", "model"):
        pipeline(f"stage={stage}", *common)
    for stage in ("trace", "package"):
        pipeline(f"+variant={variant}", f"stage={stage}", *common, "package.signing.allow_unsigned=true")
    dist = artifacts / model / variant / "dist"
    manifest = Manifest.read(dist / "manifest.json")
    target = artifacts / "pulled" / manifest.archive.root
    target.parent.mkdir()
    extract_verified(dist / manifest.archive.name, manifest, target)
    manifest.write(target.with_name(target.name + ".manifest.json"))
    return target, artifacts / model / "weights"


def e4b_checkpoint(layers: int, out: Path) -> Path:
    """bench/rank_weights_rss.py's E4B-shaped checkpoint, with the tiny model's tokenizer beside it."""
    from bench.rank_weights_rss import write_checkpoint
    from pipeline.models.tiny_model import TinyModelConfig, generate

    write_checkpoint(out, layers)
    tiny = generate(TinyModelConfig(), out.parent / "tiny")
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def children_rss(pid: int) -> int:
    import psutil

    return sum(c.memory_info().rss for c in psutil.Process(pid).children(recursive=True))


def table_bytes(checkpoint: Path) -> int:
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.host import EMBEDDING_TABLES
    from pipeline.recipe.spec import load_spec
    from pipeline.serving.engine import text_prefix_of

    spec = load_spec(checkpoint)
    with Checkpoint(checkpoint, text_prefix_of(checkpoint)) as ckpt:
        return sum(ckpt.stored_bytes(name, spec) for name in EMBEDDING_TABLES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_chat(url: str, version: str, tokens: int) -> tuple[float, float]:
    """``(first token s, decode tokens/s)`` of one streamed chat completion, timed per event by the client."""
    body = json.dumps({"model": version, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": tokens,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    arrivals = []
    with urllib.request.urlopen(req, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            choice = event["choices"][0] if event["choices"] else {}
            if "content" in choice.get("delta", {}) and "role" not in choice["delta"]:
                arrivals.append(time.perf_counter())
    return arrivals[0] - sent, (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e4b-layers", type=int, default=0,
                        help="an E4B-shaped checkpoint with this many layers (6, as bench/rank_weights_rss.py); "
                             "default: the tiny model")
    parser.add_argument("--variant", default="512_bf16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gemma4-bench-serve-"))
    server = None
    try:
        checkpoint = e4b_checkpoint(args.e4b_layers, work / "e4b") if args.e4b_layers else None
        started = time.monotonic()
        rank_dir, weights = build(work / "artifacts", args.variant, checkpoint)
        shape = f"E4B-shaped, {args.e4b_layers} layers" if checkpoint else "tiny"
        print(f"built {args.variant} ({shape}) in {time.monotonic() - started:.0f} s")
        version = json.loads(rank_dir.with_name(rank_dir.name + ".manifest.json").read_text())["version"]
        baseline = int(subprocess.run([sys.executable, "-c", BASELINE, str(weights)], check=True, cwd=REPO,
                                      capture_output=True, text=True).stdout.split()[-1])
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(rank_dir), "--checkpoint",
                                   str(weights), "--port", str(port)], cwd=REPO, stderr=subprocess.DEVNULL)
        while True:
            assert server.poll() is None, "serve exited"
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        ready = status(server.pid)
        ranks_ready = children_rss(server.pid)

        gen_ttft, gen_rate, srv_ttft, srv_rate = [], [], [], []
        for _ in range(args.runs):  # interleaved, so both see the same machine
            out = subprocess.run([sys.executable, "-m", "pipeline", "generate", str(rank_dir), "--checkpoint",
                                  str(weights), "--prompt", QUESTION, "--max-new-tokens", str(args.tokens)],
                                 cwd=REPO, check=True, capture_output=True, text=True).stderr
            line = next(x for x in out.splitlines() if "new tokens, first token" in x)
            gen_ttft.append(float(line.split("first token ")[1].split(" ms")[0]) / 1e3)
            gen_rate.append(float(line.split("ms, ")[1].split(" tok/s")[0]))
            ttft, rate = stream_chat(url, version, args.tokens)
            srv_ttft.append(ttft)
            srv_rate.append(rate)
        after = status(server.pid)
        tables = table_bytes(weights)
    finally:
        if server and server.poll() is None:
            server.terminate()
            server.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)

    mib = 2**20
    budget = tables + baseline
    print(f"embedding tables (token + per-layer, as stored): {tables / mib:9.1f} MiB")
    print(f"fixed overhead (imports + tokenizer, baseline):  {baseline / mib:9.1f} MiB")
    print(f"serve, ready:        RSS {ready['VmRSS'] / mib:9.1f} MiB  peak {ready['VmHWM'] / mib:9.1f} MiB")
    print(f"serve, after {args.runs} requests: RSS {after['VmRSS'] / mib:9.1f} MiB  "
          f"peak {after['VmHWM'] / mib:9.1f} MiB")
    print(f"rank processes (the decoder; on inf2 the NeuronCores hold it), ready: {ranks_ready / mib:9.1f} MiB")
    print(f"ratio serve peak / (tables + fixed overhead): {after['VmHWM'] / budget:.2f}  (goal <= 1.3)")
    g_ttft, s_ttft = statistics.median(gen_ttft), statistics.median(srv_ttft)
    g_rate, s_rate = statistics.median(gen_rate), statistics.median(srv_rate)
    print(f"generate: first token {g_ttft * 1e3:7.1f} ms, {g_rate:7.1f} tok/s   (median of {args.runs})")
    print(f"serve:    first token {s_ttft * 1e3:7.1f} ms, {s_rate:7.1f} tok/s   (streamed chat, client-timed)")
    print(f"ratio serve / generate tokens/s: {s_rate / g_rate:.2f}  (goal >= 0.95)")
    print(f"serve first token vs 1.1 x generate's + 5 ms: {s_ttft * 1e3:.1f} ms vs "
          f"{(1.1 * g_ttft + 0.005) * 1e3:.1f} ms")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
