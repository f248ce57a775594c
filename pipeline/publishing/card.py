"""The model card (the repo's README.md), generated from every published version's manifest.

It is regenerated on each publish from what the repository already holds plus the new version, so it never forgets
older versions.
"""

from __future__ import annotations

from typing import Any

from pipeline.artifact.manifest import Manifest
from pipeline.publishing.index import Headline


def cell(value: Any, fmt: str = "{}") -> str:
    """A table cell: the value in ``fmt``, or a dash for none (the model card's table, and ``versions``' table)."""
    return "–" if value is None else fmt.format(value)


HEADER = ("| version | kv_max | buckets | dtype | prefill | tp | batch | files | backend / compiler | tok/s "
          "| tok/s, full batch | first token ms | parity | signed |\n" + "|---" * 14 + "|")


def _files(m: Manifest) -> str:
    return ", ".join(f"`{member.path}`" for member in m.members)


def _row(m: Manifest) -> str:
    v, figures = m.variant, Headline.of(m)
    parity = figures.parity
    parity_text = "–" if parity.passed is None else f"{'pass' if parity.passed else 'FAIL'} ({parity.mode})"
    buckets = ", ".join(str(b) for b in (*v.smaller_buckets, v.bucket))  # the prefill ladder, its largest last
    return (f"| `{m.version}` | {v.kv_max} | {buckets} | {v.dtype} | {v.prefill} | {v.tp_degree} | {v.batch_size} "
            f"| {_files(m)} | {m.backend} `{m.compiler.id}` | {cell(figures.tokens_per_s, '{:.1f}')} "
            f"| {cell(figures.aggregate_tokens_per_s, '{:.1f}')} | {cell(figures.ttft_ms, '{:.0f}')} | {parity_text} "
            f"| {'yes' if m.signature else 'no'} |")


def usage(example: Manifest | None, source: str) -> str:
    """The commands that pull and run ``example``, exactly as they apply to it: its source, its own files, and a
    public key only if it is signed."""
    if example is None:
        return "No version is published yet."
    verify = ("--public-key PUBLISHER-KEY.pub.pem" if example.signature
              else "--allow-unsigned   # this version is not signed")
    # The base model's own files, at the revision the build was made from (serve and generate check its config.json).
    checkpoint = f"/data/{(example.model.hub_id or example.model.name).split('/')[-1]}"
    return f"""```bash
python -m pipeline pull {source} {example.version} --dest /workspace {verify}
python -m pipeline generate /workspace/{example.archive.root} --checkpoint {checkpoint} \\
    --prompt "What is the capital of France?"
```

`pull {source} {example.variant.name}` takes the newest published version of that variant instead (it says
which). `{example.version}` unpacks to `/workspace/{example.archive.root}/` holding
{_files(example)}."""


def render(manifests: list[Manifest], repo_id: str, source: str | None = None) -> str:
    """The full README.md for ``manifests`` (one per published version, the one being published last; its usage
    block shows that one); ``source`` is where ``pull`` finds them (the Hub repo id, or a local publish folder;
    default ``repo_id``)."""
    example = manifests[-1] if manifests else None
    manifests = sorted(manifests, key=lambda m: (m.variant.name, m.version))
    base = next((m.model.hub_id for m in manifests if m.model.hub_id), None)
    if base is None:
        return demo_card(manifests, repo_id)
    return model_card(base, manifests, usage(example, source or repo_id))


def model_card(base: str, manifests: list[Manifest], usage_block: str) -> str:
    """The card of builds of the Hub model ``base``: what they are, a row per version, how to use them."""
    rows = "\n".join(_row(m) for m in manifests)
    return f"""{_model_intro(base)}

## Versions

{HEADER}
{rows}

Throughput is measured on the hardware named in each `manifest.json` (`validation.hardware`); tok/s is one
sequence's decode speed at the slowest context length, tok/s at full batch every sequence's together with `batch`
of them in flight (a version decodes `batch` sequences at once: a server batches requests continuously into them),
and cpu-backend rows come from the reference backend, not from Inferentia2.

## Use a version

With a checkout of the pipeline (on an inf2 host, with its `[neuron]` extra) and the base checkpoint, which supplies
the tokenizer and the embedding tables the host looks up:

{usage_block}

`pull` resolves the tag to a commit once, downloads the manifest, its signature and the archive at that commit,
verifies every checksum (and the signature, with the publisher's public key), unpacks the files into a directory
holding nothing else and prints its path. neuronx-distributed loads it as it is: `parallel_model_load(dir)` for
`per_rank`, or `torch.jit.load(dir + "/model.pt")` then `.nxd_model.initialize_with_saved_weights(torch.tensor(0))`
for `nxd_model`. `generate` verifies it again against the manifest beside it and runs it. Versions are never moved
once published; if you copy files by hand, pin the commit all the same.

## License

The artifacts contain the weights of `{base}` and are distributed under Apache-2.0 with attribution to Google.
"""


def _model_intro(base: str) -> str:
    """The card's metadata, title and what a version folder holds (the text before its versions)."""
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
the gemma4-neuron-pipeline. Every version is one variant (KV cache length, prefill bucket, dtype, prefill mode, batch)
built with one compiler from one set of inputs, tagged `<variant>-<compiler>-<inputs>`: the last part is a digest of
everything that decides the files' bytes (checkpoint, recipe code, compiler and its arguments), so a rebuild from other
inputs is a new version and a published version never changes. Each version folder holds the archive of its compiled
files, its `manifest.json` (checksums of every file, compiler and its exact arguments, toolchain, source revision, the
`layout`, and the validation summary under `validation`) and its `metrics.json` (the headline figures: parity against
the float reference, decode tokens/s and time to first token per context length, peak memory). The files column says
what each archive holds: one file per NeuronCore (`tp_0.pt`, `tp_1.pt`: layout `per_rank`, neuronx-distributed's
`parallel_model_trace`), or one `model.pt` (layout `nxd_model`, the ModelBuilder executor with the prefill and
decode graphs and every rank's weights)."""


def demo_card(manifests: list[Manifest], repo_id: str) -> str:
    """The card of a repository of demo builds (the embedded tiny test model): it says what they are, and claims no
    base model."""
    rows = "\n".join(_row(m) for m in manifests)
    names = sorted({m.model.name for m in manifests})
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

{HEADER}
{rows}
"""
