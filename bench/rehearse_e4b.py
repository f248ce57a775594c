"""The full-size rehearsal: every stage on a Gemma-4-E4B-shaped checkpoint, measured (``make rehearse-e4b``); with
``--model e2b``, on an E2B-shaped one at one NeuronCore and at two (``make rehearse-e2b``).

On one CPU machine, before renting an inf2 host: writes the E4B-shaped random checkpoint
(``python -m pipeline.models.e4b_shaped``), then runs the pipeline as a user does, one command per stage, for one
device-prefill and one host-prefill bf16 variant and the device-prefill one at batch 4, at tp_degree 2 on the cpu
backend, from a clean artifacts folder, publishing to a local folder; then pulls the device-prefill version, serves it
and asks it through the ``openai`` client, serves the batch-4 version to one client and then four at once, and times
transformers' own bf16 ``generate`` on the same weights and cores as the baseline of decode speed. Once a variant is
published its archive folder goes (the publish folder holds the archive), and so do the later variants' rank files:
three variants' files at once would not fit this machine's free disk.

While each command runs, every process of its tree is sampled (``/proc/<pid>/status``: VmHWM, the process's own
high-water mark, so no peak falls between samples), and the file system's used bytes give the disk high-water mark.
Writes ``<out>/rehearsal.json`` (every figure) and ``<out>/rehearsal.md`` (the table docs/full-size.md holds).

E2B's rehearsal (``--model e2b``) builds ``512_bf16_tp1`` and ``512_bf16`` (its one KV head copied to both ranks)
the same way, with transformers' baseline on the same cores, and leaves out pull, serve and the batch (the code they
run is the same for both models; E4B's rehearsal measures them).

    python bench/rehearse_e4b.py [--model e4b|e2b] [--out /tmp/rehearse-e4b] [--layers 42]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30


@dataclass(frozen=True)
class Plan:
    """One model's rehearsal: its conf file, the variants built in turn (the first is pulled, served and the baselines'
    build), and whether pull and serve run."""

    model: str
    variants: tuple[str, ...]
    serves: bool


PLANS = {"e4b": Plan("gemma4_e4b", ("512_bf16", "512_bf16_host", "512_bf16+bs4"), serves=True),
         "e2b": Plan("gemma4_e2b", ("512_bf16_tp1", "512_bf16"), serves=False)}
VARIANTS = PLANS["e4b"].variants
BATCHED = VARIANTS[2]
CLIENTS = (1, 4)  # the batched version served to one client, then four at once
# A release of 512_bf16 validates six prompts (all that fit 512) with 32 new tokens each; the rehearsal three (one per
# bucket of 512_bf16's ladder: 16, 32, 128), 16 tokens, one timed run per context.
# The cpu backend's floors are reported, not enforced (the machine's CPU and load set them): nothing to override.
VALIDATE = ("validate.max_new_tokens=16", "validate.prompt_names=[greeting,capital,near_64]",
            "validate.throughput.runs=1", "validate.throughput.contexts=[short,half]")


@dataclass
class Step:
    name: str
    command: list[str]
    wall_s: float = 0.0
    returncode: int | None = None
    peak_rss: dict[str, int] = field(default_factory=dict)  # role -> the largest VmHWM of a process in that role
    peak_anon: dict[str, int] = field(default_factory=dict)  # role -> the largest RssAnon sampled (no file pages)
    tree_peak_rss: int = 0  # the largest sum of the tree's resident memory at one sample
    disk_high_water: int = 0  # bytes above what the file system used before the rehearsal
    output_tail: str = ""


def role(proc: psutil.Process) -> str:
    try:  # once: a process can end between two reads of its command line
        argv = proc.cmdline()
    except psutil.Error:
        return "gone"
    cmd = " ".join(argv)
    if "pipeline.validation.worker" in cmd:
        return "validation worker"
    if "multiprocessing" in cmd:
        return "rank"
    if "-c" in argv[:3] and "git" not in cmd:
        return "helper"
    if cmd.startswith(("git", "/usr/bin/git", "zstd", "tar")):
        return "tool"
    return "stage"


def status(pid: int) -> dict[str, int]:
    """VmHWM and RssAnon of a process, in bytes (empty once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines)
            if k in ("VmHWM", "RssAnon")}


def run(step: Step, disk_base: int, env: dict) -> Step:
    """Run ``step.command`` (cwd: the repository), sampling its process tree until it ends."""
    started = time.monotonic()
    proc = subprocess.Popen(step.command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        total = 0
        for p in tree:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
            name = role(p) if p.pid != proc.pid else "stage"
            figures = status(p.pid)
            step.peak_rss[name] = max(step.peak_rss.get(name, 0), figures.get("VmHWM", 0))
            step.peak_anon[name] = max(step.peak_anon.get(name, 0), figures.get("RssAnon", 0))
        step.tree_peak_rss = max(step.tree_peak_rss, total)
        step.disk_high_water = max(step.disk_high_water, shutil.disk_usage(REPO).used - disk_base)
        time.sleep(0.2)
    reader.join()
    step.returncode = proc.returncode
    step.wall_s = round(time.monotonic() - started, 1)
    step.output_tail = "".join(lines[-40:])
    step.disk_high_water = max(step.disk_high_water, shutil.disk_usage(REPO).used - disk_base)
    print(f"{step.name:38s} {step.wall_s:8.1f} s  rc={step.returncode}  tree peak {step.tree_peak_rss / GIB:6.2f} GiB"
          f"  disk +{step.disk_high_water / GIB:6.2f} GiB  hwm {gib(step.peak_rss)} anon {gib(step.peak_anon)}",
          flush=True)
    if proc.returncode:
        print(step.output_tail, flush=True)
    return step


def gib(figures: dict[str, int]) -> str:
    return json.dumps({k: round(v / GIB, 2) for k, v in figures.items()})


def pipeline_step(name: str, variant: str, stage: str, ckpt: Path, artifacts: Path, published: Path,
                  model: str = "gemma4_e4b") -> Step:
    return Step(name, [sys.executable, "-m", "pipeline", f"+variant={variant}", f"model={model}",
                       f"model.path={ckpt}", "backend=cpu", "hardware=local", "publish=local",
                       f"publish.local_dir={published}", f"artifacts_dir={artifacts}", f"stage={stage}", *VALIDATE])


QUESTION = "What is the capital of France?"

# transformers' own bf16 greedy generate on the same weights (mapped, as from_pretrained does) and the same threads as
# the cpu backend's ranks use together: the baseline of decode speed.
TRANSFORMERS_BASELINE = r"""
import json, sys, time, torch
from transformers import AutoTokenizer, Gemma4ForConditionalGeneration
torch.set_num_threads(int(sys.argv[3]))
weights, tokens = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(weights)
model = Gemma4ForConditionalGeneration.from_pretrained(weights, dtype=torch.bfloat16).eval()
ids = tok.apply_chat_template([{"role": "user", "content": sys.argv[4]}], add_generation_prompt=True,
                              tokenize=True, return_dict=False)
stamps = []
class Clock:  # a streamer: called once with the prompt, then once per new token
    def put(self, value): stamps.append(time.perf_counter())
    def end(self): pass
with torch.no_grad():
    model.generate(torch.tensor([ids]), max_new_tokens=2, do_sample=False)  # warm-up
    stamps.clear(); started = time.perf_counter()
    model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                   streamer=Clock())
steps = stamps[1:]
print(json.dumps({"ttft_s": steps[0] - started, "tokens_per_s": (len(steps) - 1) / (steps[-1] - steps[0])}))
"""


def ask_server(out: Path, artifacts: Path, published: Path, ckpt: Path, env: dict, disk_base: int) -> dict:
    """``serve`` the published device-prefill version, ask it through the ``openai`` client, and the same through
    ``generate``; the serve process's own memory apart from its ranks'."""
    import socket
    import urllib.request

    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serving = out / "serving"
    figures: dict = {}
    for name in ("pull", "pull again (cached)"):
        pulled = run(Step(name, [sys.executable, "-m", "pipeline", "pull", str(published), VARIANTS[0], "--dest",
                                 str(serving), "--allow-unsigned"]), disk_base, env)
        if pulled.returncode:
            raise SystemExit(f"{name} failed: {pulled.output_tail}")
        figures[name.split(" (")[0].replace(" ", "_") + "_s"] = pulled.wall_s
        figures[name.split(" (")[0].replace(" ", "_") + "_disk_high_water"] = pulled.disk_high_water
    started = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(published), VARIANTS[0], "--checkpoint",
                               str(ckpt), "--dest", str(serving), "--allow-unsigned", "--port", str(port)],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=(out / "serve.log").open("w"))
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"serve exited: {(out / 'serve.log').read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        figures["first_health_200_s"] = round(time.monotonic() - started, 1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=900)
        model = client.models.list().data[0].id
        for _ in range(2):  # the second is the one reported: the first pays for the first calls
            sent, arrivals, text = time.perf_counter(), [], ""
            for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                        max_tokens=32, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.perf_counter())
                    text += chunk.choices[0].delta.content
        figures.update(serve_ttft_s=round(arrivals[0] - sent, 2),
                       serve_tokens_per_s=round((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]), 2),
                       serve_reply=text)
        host = psutil.Process(server.pid)
        figures["serve_host_rss_bytes"] = status(server.pid).get("VmHWM", 0)
        figures["serve_host_anon_bytes"] = status(server.pid).get("RssAnon", 0)
        figures["serve_rank_rss_bytes"] = [status(c.pid).get("VmHWM", 0) for c in host.children(recursive=True)
                                           if role(c) == "rank"]
    finally:
        server.terminate()
        server.wait(timeout=120)
    pulled = next(p for p in serving.iterdir() if p.is_dir() and not p.name.startswith("."))
    gen = run(Step("generate (same build)", [sys.executable, "-m", "pipeline", "generate", str(pulled), "--checkpoint",
                                             str(ckpt), "--prompt", QUESTION, "--max-new-tokens", "32"]),
              disk_base, env)
    line = next(x for x in gen.output_tail.splitlines() if "new tokens, first token" in x)
    figures["generate_ttft_s"] = float(line.split("first token ")[1].split(" ms")[0]) / 1e3
    figures["generate_tokens_per_s"] = float(line.split("ms, ")[1].split(" tok/s")[0])
    figures["pulled"] = str(pulled)
    return figures


def serve_batched(out: Path, published: Path, ckpt: Path, env: dict) -> dict:
    """``serve`` the batch-4 version and drive it with one streamed client, then four at once
    (bench/serve_batching.py's clients): every client's tokens/s together, time to first token, inter-token latency."""
    import socket
    import urllib.request

    sys.path.insert(0, str(REPO))
    from bench.serve_batching import drive

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(published), BATCHED, "--checkpoint",
                               str(ckpt), "--dest", str(out / "serving-batched"), "--allow-unsigned", "--port",
                               str(port)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=(out / "serve-batched.log").open("w"))
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"serve exited: {(out / 'serve-batched.log').read_text()[-3000:]}")
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        version = json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=30).read())["data"][0]["id"]
        figures = {str(c): drive(url, version, c, 1, 16) for c in CLIENTS}
        host = psutil.Process(server.pid)
        figures["rank_rss_bytes"] = [status(c.pid).get("VmHWM", 0) for c in host.children(recursive=True)
                                     if role(c) == "rank"]
    finally:
        server.terminate()
        server.wait(timeout=120)
        shutil.rmtree(out / "serving-batched", ignore_errors=True)
    print(f"serve {BATCHED}: " + ", ".join(f"{c} client(s) {figures[str(c)]['aggregate']:.2f} tok/s in all"
                                           for c in CLIENTS), flush=True)
    return figures


def baselines(out: Path, artifacts: Path, ckpt: Path, env: dict, disk_base: int, plan: Plan = PLANS["e4b"]) -> dict:
    """transformers' bf16 generate, and ``tar -I 'zstd -T0'`` of the same rank files the package stage packed."""
    hf = run(Step("transformers bf16 generate", [sys.executable, "-c", TRANSFORMERS_BASELINE, str(ckpt), "32",
                                                 str(os.cpu_count() or 1), QUESTION]), disk_base, env)
    build = artifacts / plan.model / plan.variants[0] / "build"
    ranks = " ".join(sorted(p.name for p in build.glob("tp_*.pt")))
    # Flushed to disk before the clock stops, as the package stage fsyncs its archive (unflushed, the baseline's
    # writeback was left to land in whatever ran next)
    baseline = out / "baseline.tar.zst"
    tar = run(Step("tar -I 'zstd -T0' (baseline)", ["sh", "-c", f"tar -C '{build}' -I 'zstd -T0' -cf '{baseline}' "
                                                                f"{ranks} && sync -f '{baseline}'"]),
              disk_base, env)
    figures = {"transformers": json.loads(hf.output_tail.strip().splitlines()[-1]),
               "tar_zstd_s": tar.wall_s, "tar_zstd_bytes": (out / "baseline.tar.zst").stat().st_size,
               "rank_files_bytes": sum(p.stat().st_size for p in build.glob("tp_*.pt"))}
    (out / "baseline.tar.zst").unlink()
    return figures


# -- the table --------------------------------------------------------------------------------------------------------

def gib_of(value: float | None) -> str:
    return "" if value is None else f"{value / GIB:.2f}"


def estimates(checkpoint: Path, variants: tuple[str, ...] = VARIANTS) -> dict[str, float]:
    """Each step's preflight need (GiB), from the preflight's code as it is now (the records hold what it said when
    they were written)."""
    from pipeline.backends.registry import BACKENDS
    from pipeline.host import preflight
    from pipeline.recipe.spec import load_spec

    spec, cpu = load_spec(checkpoint), BACKENDS["cpu"]
    need = {"reference": preflight.reference_need(spec).memory / GIB}
    for variant in variants:
        shape = shape_of(variant)
        est = preflight.estimate(spec, shape, cpu, None)
        need[f"trace {variant}"] = preflight.trace_need(est.resources, cpu, shape, 0, []).memory / GIB
        need[f"validate {variant}"] = preflight.validate_need(est.resources, cpu, shape).memory / GIB
    return need


def shape_of(variant: str):
    """A named variant's shape, or a derived name's (``512_bf16+bs4``: the file's fields, then each part's)."""
    from pipeline.core import derived_names
    from pipeline.core.shape import BuildShape

    name, *parts = variant.split("+")
    conf = yaml.safe_load((REPO / "conf" / "variant" / f"{name}.yaml").read_text())
    values = {f.name: conf.get(f.name, f.default) for f in fields(BuildShape)}
    for part in parts:
        key, value = derived_names.read_part(part)
        values[key] = int(value) if derived_names.choices(key) is None else value
    return BuildShape(**values)


def table(out: Path) -> str:
    """The measured table, markdown: every step, its wall time, each process's peak and the preflight's estimate."""
    record = json.loads((out / "artifacts" / "rehearsal.json").read_text())
    need = estimates(out / "checkpoint", tuple(PLANS[record.get("model", "e4b")].variants))
    lines = ["| step | wall s | peak RSS, largest process of each kind (GiB) | all processes at once (GiB) | "
             "not file-backed (GiB) | preflight estimate (GiB) | estimate / measured | disk high-water (GiB) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for step in record["steps"]:
        kinds = ", ".join(f"{k} {gib_of(v)}" for k, v in step["peak_rss"].items() if v and k != "gone")
        stage, _, variant = step["name"].partition(" ")  # "trace 512_bf16": the largest rank process, once per rank
        ranks = shape_of(variant).tp_degree if stage in ("trace", "validate") else 1
        anon = sum(step["peak_anon"].get(k, 0) * (ranks if k == "rank" else 1)
                   for k in step["peak_anon"] if k != "gone")
        estimate = need.get(step["name"])
        ratio = f"{estimate * GIB / anon:.2f}" if estimate and anon else ""
        lines.append(f"| {step['name']} | {step['wall_s']:.1f} | {kinds} | {gib_of(step['tree_peak_rss'])} | "
                     f"{gib_of(anon)} | {'' if estimate is None else f'{estimate:.2f}'} | {ratio} | "
                     f"{gib_of(step['disk_high_water'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(PLANS), default="e4b")
    parser.add_argument("--out", type=Path, default=None, help="default: /tmp/rehearse-<model>")
    parser.add_argument("--layers", type=int, default=None, help="default: all the release's")
    parser.add_argument("--table", action="store_true", help="print the table of a finished rehearsal, run nothing")
    parser.add_argument("--only-extras", action="store_true",
                        help="keep the built artifacts; run only the pull, serve and baselines after them")
    args = parser.parse_args()
    out = (args.out or Path(f"/tmp/rehearse-{args.model}")).resolve()
    plan = PLANS[args.model]
    if args.table:
        print(table(out), end="")
        return 0
    ckpt, artifacts, published = out / "checkpoint", out / "artifacts", out / "published"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    disk_base = shutil.disk_usage(REPO).used
    steps: list[Step] = []
    if not args.only_extras:
        for folder in (artifacts, published, out / "serving"):
            shutil.rmtree(folder, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        build_all(out, ckpt, artifacts, published, (args.model, args.layers), env, disk_base, steps)
    extras = {"baselines": baselines(out, artifacts, ckpt, env, disk_base, plan)}
    if plan.serves:
        extras["serve"] = ask_server(out, artifacts, published, ckpt, env, disk_base)
        extras["serve_batched"] = serve_batched(out, published, ckpt, env)
    write(out, steps, (args.model, args.layers), extras)
    print(table(out), end="")
    return 0


def build_all(out: Path, ckpt: Path, artifacts: Path, published: Path, shaped: tuple[str, int | None], env: dict,
              disk_base: int, steps: list[Step]) -> None:
    """``shaped``: the release (``e4b``, ``e2b``) and its layers (None: all of them)."""
    model, layers = shaped
    plan = PLANS[model]
    def step(s: Step) -> Step:
        steps.append(run(s, disk_base, env))
        if s.returncode:
            write(out, steps, shaped, {})
            raise SystemExit(f"{s.name} failed (exit {s.returncode})")
        return s

    from pipeline.models.e4b_shaped import RELEASES

    marker = ckpt / "e4b_shaped.json"
    written = json.loads(marker.read_text()) if marker.exists() else {}
    wanted = (model, layers or RELEASES[model].text["num_hidden_layers"])
    if (written.get("model", "e4b"), written.get("layers")) != wanted:
        shutil.rmtree(ckpt, ignore_errors=True)
        step(Step(f"checkpoint ({model.upper()}-shaped, random)",
                  [sys.executable, "-m", "pipeline.models.e4b_shaped", str(ckpt), "--model", model,
                   *(["--layers", str(layers)] if layers else [])]))
    for stage in ("toolchain", "model", "reference"):
        step(pipeline_step(stage, plan.variants[0], stage, ckpt, artifacts, published, plan.model))
    for variant in plan.variants:
        for stage in ("trace", "package", "validate", "publish"):
            step(pipeline_step(f"{stage} {variant}", variant, stage, ckpt, artifacts, published, plan.model))
        # Published: its archive is in the publish folder. The first variant's rank files stay for the tar baseline.
        shutil.rmtree(artifacts / plan.model / variant / "dist")
        if variant != plan.variants[0]:
            shutil.rmtree(artifacts / plan.model / variant / "build")
    write(out, steps, shaped, {})


def write(out: Path, steps: list[Step], shaped: tuple[str, int | None], extras: dict) -> None:
    path = out / "artifacts" / "rehearsal.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(path.read_text()) if path.exists() else {}
    model, layers = shaped
    record = {"model": model, "layers": layers, "steps": [asdict(s) for s in steps] or previous.get("steps", []),
              "extras": extras or previous.get("extras", {})}
    path.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
