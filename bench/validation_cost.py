"""What validating an artifact costs besides decoding: process start, checksum, safe unpack and rank load.

Builds one variant with the pipeline's own stages (tiny model by default, or ``--checkpoint DIR`` such as the
E4B-shaped checkpoint ``bench/rank_weights_rss.py`` writes), then, in a fresh interpreter as validation does, times:

  start     interpreter start and imports
  checksum  sha256 of the archive against the manifest
  unpack    verified, allow-listed extraction (hashes every member again)
  load      the backend loads the ranks (rank processes start, torch.jit.load)
  decode    the validation's decode budget: prompts x new tokens, one token per call

and prints each phase and the ratio of the fixed costs to the decode time.

    python bench/validation_cost.py [--checkpoint DIR --text-prefix model.] [--variant 512_bf16] [--format tar]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def pipeline(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:  # e.g. the preflight's refusal: its numbers and its fix are in the log
        sys.exit(f"python -m pipeline {' '.join(args)} failed:\n{proc.stderr[-4000:]}")


def preflight_line(build_json: Path) -> str:
    """The trace's estimate beside what it measured (build.json), the figures the preflight's factors come from."""
    record = json.loads(build_json.read_text())["preflight"]
    weights, need = record["estimate"]["weights_bytes"], record["need"]["memory_gib"]
    return (f"trace: {weights['tp_degree']} ranks of {weights['rank'] / 2**30:.2f} GiB of weights; preflight "
            f"estimate {need:.1f} GiB, measured peak {record['measured']['graph_peak_rss_bytes'] / 2**30:.2f} GiB "
            f"per rank + {record['measured']['stage_peak_rss_bytes'] / 2**30:.2f} GiB for the stage")


def measure(artifacts: Path, model: str, variant: str, weights: Path, text_prefix: str, tokens: int) -> dict:
    """Runs in the fresh interpreter (the clock started before it was launched)."""
    import torch

    from pipeline.artifact.archive import extract_verified, verify_file
    from pipeline.artifact.manifest import Manifest
    from pipeline.backends import get_backend
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.host import HostEmbeddings
    from pipeline.recipe.spec import load_spec

    marks = {"imported": time.time()}
    dist = artifacts / model / variant / "dist"
    manifest = Manifest.read(dist / "manifest.json")
    archive = dist / manifest.archive.name
    verify_file(archive, manifest.archive.size, manifest.archive.sha256, "archive")
    marks["checksum"] = time.time()
    work = Path(tempfile.mkdtemp(dir=artifacts))
    ranks = extract_verified(archive, manifest, work / "ranks")
    marks["unpack"] = time.time()
    shape = manifest.shape
    spec = load_spec(weights)
    with Checkpoint(weights, text_prefix) as ckpt, get_backend(manifest.backend).load(ranks, shape) as runner:
        marks["load"] = time.time()
        embed = HostEmbeddings(ckpt, spec)
        if shape.prefill == "device":
            e, p = embed(list(range(3, 3 + shape.bucket)))
            runner.prefill(e, p, torch.arange(shape.bucket).view(1, -1), torch.tensor([shape.bucket - 1]))
        e, p = embed([5])
        runner.decode(e, p, torch.tensor([[0]]), torch.tensor([0]))  # first call, not timed
        marks["warm"] = time.time()
        for i in range(tokens):
            e, p = embed([5 + i % 100])
            runner.decode(e, p, torch.tensor([[1 + i % (shape.kv_max - 2)]]), torch.tensor([0]))
        marks["decode"] = time.time()
    shutil.rmtree(work, ignore_errors=True)
    return {"marks": marks, "archive_bytes": manifest.archive.size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--text-prefix", default="model.")
    parser.add_argument("--variant", default="512_bf16")
    parser.add_argument("--format", default="tar", choices=["tar", "tar.gz"])
    parser.add_argument("--tokens", type=int, default=0, help="decode tokens (default: the validation budget)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        job = json.loads(args.measure)
        print(json.dumps(measure(Path(job["artifacts"]), job["model"], job["variant"], Path(job["weights"]),
                                 job["text_prefix"], job["tokens"])))
        return

    artifacts = Path(tempfile.mkdtemp(prefix="gemma4-bench-"))
    model = "bench_model"
    common = [f"artifacts_dir={artifacts}", "backend=cpu", f"package.format={args.format}", f"model.name={model}",
              f"model.text_prefix={args.text_prefix}"]
    if args.checkpoint:
        common += ["model=gemma4_e4b", f"model.path={args.checkpoint.resolve()}"]
    try:
        started = time.monotonic()
        for stage in ("toolchain", "model"):
            pipeline(f"stage={stage}", *common)
        for stage in ("trace", "package"):
            pipeline(f"+variant={args.variant}", f"stage={stage}", *common)
        print(f"built {args.variant} in {time.monotonic() - started:.0f} s")
        print(preflight_line(artifacts / model / args.variant / "build.json"))
        weights = artifacts / model / "weights"
        # The validation decode budget: every default prompt that fits, 32 new tokens each.
        tokens = args.tokens or 32 * {"256": 4, "512": 5, "2048": 6}[args.variant.split("_")[0]]
        job = json.dumps({"artifacts": str(artifacts), "model": model, "variant": args.variant,
                          "weights": str(weights), "text_prefix": args.text_prefix, "tokens": tokens})
        launched = time.time()
        out = subprocess.run([sys.executable, __file__, "--measure", job], check=True, capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(artifacts, ignore_errors=True)
    m = result["marks"]
    phases = {"start (interpreter + imports)": m["imported"] - launched,
              "checksum (archive sha256)": m["checksum"] - m["imported"],
              "unpack (verified extraction)": m["unpack"] - m["checksum"],
              "load (rank processes + jit.load)": m["load"] - m["unpack"]}
    fixed = sum(phases.values())
    decode = m["decode"] - m["warm"]
    print(f"archive: {result['archive_bytes'] / 2**20:.1f} MiB ({args.format}); decode budget {tokens} tokens")
    for name, seconds in phases.items():
        print(f"  {name:<36}{seconds:8.2f} s")
    print(f"  {'fixed costs':<36}{fixed:8.2f} s")
    print(f"  {'decode (' + str(tokens) + ' tokens)':<36}{decode:8.2f} s   ({1e3 * decode / tokens:.1f} ms/token)")
    print(f"ratio fixed costs / decode time: {fixed / decode:.2f}")


if __name__ == "__main__":
    main()
