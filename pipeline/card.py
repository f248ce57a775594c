"""The model card (the repo's README.md), generated from every published version's manifest.

It is regenerated on each publish from what the repository already holds plus the new version, so it never forgets
older versions.
"""

from __future__ import annotations

from typing import Any


def _cell(value: Any, fmt: str = "{}") -> str:
    return "–" if value is None else fmt.format(value)


def _row(m: dict) -> str:
    v, val = m["variant"], m.get("validation", {})
    tput, parity = val.get("throughput", {}), val.get("parity", {})
    parity_text = "–" if not parity else f"{'pass' if parity.get('passed') else 'FAIL'} ({parity.get('mode')})"
    return (f"| `{m['version']}` | {v['kv_max']} | {v['bucket']} | {v['dtype']} | {v['prefill']} | {v['tp_degree']} "
            f"| {m['backend']} `{m['compiler']['id']}` | {_cell(tput.get('tokens_per_s'), '{:.1f}')} "
            f"| {_cell(tput.get('ttft_ms'), '{:.0f}')} | {parity_text} |")


def render(manifests: list[dict], repo_id: str) -> str:
    """The full README.md for ``manifests`` (one per published version)."""
    manifests = sorted(manifests, key=lambda m: (m["variant"]["name"], m["version"]))
    base = next((m["model"].get("hub_id") for m in manifests if m["model"].get("hub_id")), None)
    if base is None:
        return demo_card(manifests, repo_id)
    rows = "\n".join(_row(m) for m in manifests)
    example = manifests[-1] if manifests else None
    version = example["version"] if example else "VERSION"
    root = example["archive"]["root"] if example else "MODEL-VERSION"
    return f"""---
license: apache-2.0
base_model: {base}
library_name: neuronx-distributed
pipeline_tag: text-generation
tags:
  - gemma
  - gemma-4
  - neuron
  - aws-neuron
  - inferentia2
  - tensor-parallel
---

# {base} for AWS Inferentia2 (tensor parallel)

Compiled artifacts of [`{base}`](https://huggingface.co/{base}) for Inferentia2, built, validated and published by
the gemma4-neuron-pipeline. Every version is one variant (KV cache length, prefill bucket, dtype, prefill mode)
built with one compiler, tagged `<variant>-<compiler>`. Each version folder holds the archive of its compiled files,
its `manifest.json` (checksums of every file, compiler and its exact arguments, toolchain, source revision, and the
`layout`) and its `metrics.json` (parity against the float reference, throughput). Host-prefill versions (layout
`per_rank`) hold one file per NeuronCore, `tp_0.pt` and `tp_1.pt`, made by neuronx-distributed's
`parallel_model_trace`; device-prefill versions (layout `nxd_model`) hold one `model.pt`, the ModelBuilder executor
with the prefill and decode graphs and every rank's weights.

## Versions

| version | kv_max | bucket | dtype | prefill | tp | backend / compiler | tok/s | first token ms | parity |
|---|---|---|---|---|---|---|---|---|---|
{rows}

Throughput is measured on the hardware named in each `metrics.json`; cpu-backend rows come from the reference
backend, not from Inferentia2.

## Use a version

With a checkout of the pipeline (on an inf2 host, with its `[neuron]` extra) and the base checkpoint, which supplies
the tokenizer and the embedding tables the host looks up:

```bash
python -m pipeline pull {repo_id} {version} --dest /workspace --public-key signing-key.pub.pem
python -m pipeline generate /workspace/{root} --checkpoint /data/gemma-4-E4B-it \\
    --prompt "What is the capital of France?"
```

`pull` resolves the tag to a commit once, downloads the manifest, its signature and the archive at that commit,
verifies every checksum (and the signature), unpacks the files into a directory holding nothing else and prints its
path. neuronx-distributed loads it as it is: `parallel_model_load(dir)` for `per_rank`, or `torch.jit.load(dir +
"/model.pt")` then `.nxd_model.initialize_with_saved_weights(torch.tensor(0))` for `nxd_model`. `generate`
verifies it again against the manifest beside it and runs it. Pin the commit, not the tag, if you copy files by hand:
tags can be moved.

## License

The artifacts contain the weights of `{base}` and are distributed under Apache-2.0 with attribution to Google.
"""


def demo_card(manifests: list[dict], repo_id: str) -> str:
    """The card of a repository of demo builds (the embedded tiny test model): it says what they are, and claims no
    base model."""
    rows = "\n".join(_row(m) for m in manifests)
    names = sorted({m["model"]["name"] for m in manifests})
    return f"""---
license: apache-2.0
library_name: neuronx-distributed
tags:
  - gemma-4
  - demo
---

# Demo builds of {', '.join(names)} (not a real model)

**These are not Gemma-4-E4B artifacts.** `{repo_id}` holds builds of the gemma4-neuron-pipeline's embedded tiny
Gemma-4 test model (random weights, a few layers at toy widths), published with `publish.allow_demo=true` to
exercise the publishing path. They generate no useful text and must not be served.

## Versions

| version | kv_max | bucket | dtype | prefill | tp | backend / compiler | tok/s | first token ms | parity |
|---|---|---|---|---|---|---|---|---|---|
{rows}
"""
