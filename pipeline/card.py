"""The model card (the repo's README.md), generated from every published version's manifest.

It is regenerated on each publish from what the repository already holds plus the new version, so it never forgets
older versions.
"""

from __future__ import annotations

from typing import Any

BASE_MODEL = "google/gemma-4-E4B-it"


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
    base = next((m["model"].get("hub_id") for m in manifests if m["model"].get("hub_id")), None) or BASE_MODEL
    rows = "\n".join(_row(m) for m in manifests)
    example = manifests[-1] if manifests else None
    pull = (f"python -m pipeline pull --repo {repo_id} --version {example['version']} --dest /workspace"
            if example else "python -m pipeline pull --repo REPO --version VERSION --dest /workspace")
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
built with one compiler, tagged `<variant>-<compiler>`. Each version folder holds the archive of its per-rank files
(`tp_0.pt`, `tp_1.pt`), its `manifest.json` (checksums of every file, compiler and its exact arguments, toolchain,
source revision) and its `metrics.json` (parity against the float reference, throughput).

## Versions

| version | kv_max | bucket | dtype | prefill | tp | backend / compiler | tok/s | first token ms | parity |
|---|---|---|---|---|---|---|---|---|---|
{rows}

Throughput is measured on the hardware named in each `metrics.json`; cpu-backend rows come from the reference
backend, not from Inferentia2.

## Use a version

```bash
pip install gemma4-neuron-pipeline   # or a checkout of the pipeline
{pull}
```

`pull` resolves the tag to a commit once, downloads the archive and manifest at that commit, verifies every
checksum, unpacks the rank files into a directory holding nothing else and prints its path: point
neuronx-distributed's loader (`parallel_model_load`) at it.

## License

The artifacts contain the weights of `{base}` and are distributed under Apache-2.0 with attribution to Google.
"""
