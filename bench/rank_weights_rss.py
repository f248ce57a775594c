"""Peak host RSS of preparing one rank's weights versus ``from_pretrained`` of the whole model.

Writes a bf16 checkpoint with google/gemma-4-E4B-it's real vocabulary (262,144), hidden size, head sizes and
per-layer embedding width but only a few layers, then measures, each in a fresh process:

  rank:     ``load_rank_state`` of rank 0 at tp_degree 2 (what a trace process holds)
  baseline: ``Gemma4ForCausalLM.from_pretrained(dtype=bfloat16)`` (what the seed's scripts did first), with its
            weights touched once: transformers maps them lazily, and any forward pass or trace makes them resident

Prints both peaks, the same net of the interpreter and imports, and the ratio (goal: <= 0.6 at TP=2).

    python bench/rank_weights_rss.py [--layers 6] [--dir /tmp/e4b_few_layers]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

E4B_TEXT = {
    "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
    "vocab_size": 262144, "hidden_size": 2560, "intermediate_size": 10240,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512,
    "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "sliding_window": 512,
    "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    "eos_token_id": [1, 106], "bos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16",
}

MEASURE = r"""
import json, sys, torch
torch.set_num_threads(1)
def rss():
    # VmHWM is this process image's own high-water mark (ru_maxrss would inherit the parent's across exec).
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
mode, path = sys.argv[1], sys.argv[2]
if mode == "rank":
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.plan import ShardPlan, load_rank_state
    from pipeline.recipe.spec import load_spec
    import transformers  # imported by both sides, so the baselines compare
    base = rss()
    spec = load_spec(path)
    with Checkpoint(path, "model.") as ckpt:
        state = load_rank_state(ckpt, ShardPlan(spec, 2), 0, torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in state.values())
else:
    from transformers import Gemma4ForCausalLM
    import pipeline.recipe.plan
    base = rss()
    model = Gemma4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # the tied head shares the embedding
    held = sum(t.numel() * t.element_size() for t in unique.values())
    lazy = rss()
    # from_pretrained maps the weights lazily; any forward pass (or trace) makes every one resident.
    for t in unique.values():
        t.sum()  # bf16 sum: reads every page, allocates nothing of the tensor's size
print(json.dumps({"base": base, "peak": rss(), "held": held, "lazy": locals().get("lazy")}))
"""


def write_checkpoint(path: Path, layers: int) -> None:
    import torch
    from safetensors.torch import save_file

    from pipeline.recipe.spec import spec_from_config

    config = dict(E4B_TEXT, num_hidden_layers=layers, num_kv_shared_layers=max(1, layers // 3),
                  layer_types=["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(layers)])
    spec = spec_from_config(config)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shard, shard_bytes, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, path / name, metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, shard_bytes, n = {}, 0, n + 1

    for name, shape in spec.text_tensor_shapes().items():
        tensor = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        shard["model." + name] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes > 2 << 30:
            flush()
    flush()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=2))


def measure(mode: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE, mode, str(path)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6, help="a multiple of 3 (every third layer is full)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/gemma4-e4b-few-layers"))
    args = parser.parse_args()
    marker = args.dir / f".layers-{args.layers}"
    if not marker.exists():
        started = time.monotonic()
        write_checkpoint(args.dir, args.layers)
        marker.touch()
        took = time.monotonic() - started
        print(f"wrote {args.layers}-layer E4B-shaped bf16 checkpoint to {args.dir} in {took:.0f} s")
    size = sum(f.stat().st_size for f in args.dir.glob("*.safetensors"))
    rank, full = measure("rank", args.dir), measure("full", args.dir)
    gib = 1 << 30
    print(f"checkpoint on disk:                {size / gib:6.2f} GiB")
    print(f"{'':35s}{'peak RSS':>10s}{'net of imports':>16s}{'tensors held':>14s}")
    for label, r in (("rank 0 of 2 (load_rank_state)", rank), ("from_pretrained (whole model)", full)):
        print(f"{label:35s}{r['peak'] / gib:9.2f}G{(r['peak'] - r['base']) / gib:15.2f}G{r['held'] / gib:13.2f}G")
    print(f"(from_pretrained right after loading, before any weight is used: {full['lazy'] / gib:.2f}G)")
    print(f"ratio rank / from_pretrained, peak RSS:          {rank['peak'] / full['peak']:.2f}  (goal <= 0.60)")
    print(f"ratio rank / from_pretrained, net of imports:    "
          f"{(rank['peak'] - rank['base']) / (full['peak'] - full['base']):.2f}")


if __name__ == "__main__":
    main()
