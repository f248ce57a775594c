"""``python -m pipeline versions SOURCE``: what a repository publishes, and which of it fits this host.

SOURCE is what ``pull`` takes (a local publish folder or a Hugging Face repo id). One row per published version:
variant, its batch (sequences decoded at once), compiler, decode tokens/s of one sequence and of a full batch, time to
first token, whether it is signed, when it was published, and whether it fits this host
(pipeline/backends/compatibility.py: compatible, a warning, or refused, with the reason). It reads the repository's
index, ``versions.json`` (one small download; pipeline/publishing/index.py), and the tags, which
decide: a version the index lacks is read from its own manifest. ``--variant`` keeps one variant's versions,
``--fits-this-host`` those this host can run, ``--json`` prints the rows for scripts (every field of the index, the
commit and the verdict).

    python -m pipeline versions your-org/gemma-4-E4B-it-inferentia2 --variant 2048_bf16 --fits-this-host
    python -m pipeline versions artifacts/published --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from pipeline.backends import compatibility
from pipeline.cli import plain
from pipeline.cli.pull import host_toolchain, source_for
from pipeline.core.log import exit_on_error, setup
from pipeline.core.names import escaped
from pipeline.core.records import encode
from pipeline.publishing import index, trust
from pipeline.publishing.card import cell

COLUMNS = ("version", "variant", "batch", "compiler", "tok/s", "tok/s, full batch", "first token ms", "signed",
           "published", "fits this host")


def table(rows: list[tuple[index.Published, compatibility.Verdict]]) -> str:
    lines = [[p.row.version, p.row.variant.name, p.row.variant.batch_size, p.row.compiler,
              cell(p.row.metrics.tokens_per_s, "{:.1f}"), cell(p.row.metrics.aggregate_tokens_per_s, "{:.1f}"),
              cell(p.row.metrics.ttft_ms, "{:.0f}"), "yes" if p.row.signed else "no",
              cell(p.row.published), verdict.fit.value] for p, verdict in rows]
    lines = [[escaped(str(x)) for x in line] for line in lines]  # an unsigned index's strings reach the terminal
    widths = [max(len(str(x)) for x in column) for column in zip(COLUMNS, *lines)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [COLUMNS, *lines]]
    notes = [escaped(f"  {p.row.version}: {verdict.says()}") for p, verdict in rows
             if verdict.fit != compatibility.Fit.compatible]
    notes += [escaped(f"  {p.row.version}: the signed index lists it, but the repository has no tag for it (withheld "
                      "or removed): pull refuses it") for p, _ in rows if p.commit is None]
    return "\n".join(out + (["", "why:", *notes] if notes else []))


def as_json(rows: list[tuple[index.Published, compatibility.Verdict]]) -> str:
    return json.dumps([{**encode(p.row), "commit": p.commit, "fits_this_host": verdict.fit.value,
                        "why": verdict.reason, "fix": verdict.fix} for p, verdict in rows], indent=2)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline versions", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a local publish folder, or a Hugging Face repo id")
    parser.add_argument("--variant", help="only this variant's versions")
    parser.add_argument("--fits-this-host", action="store_true", help="only the versions this host can run")
    parser.add_argument("--public-key", help="PEM public key the index's signature must verify with (the signed index "
                                             "then decides: one that is missing, fails, has expired or is older than "
                                             "one already trusted is refused)")
    parser.add_argument("--allow-expired", action="store_true", help="list a signed index past its expiry")
    parser.add_argument("--json", action="store_true", help="the rows as JSON, for scripts")
    args = parser.parse_args(argv)
    setup()
    with exit_on_error(), tempfile.TemporaryDirectory(prefix="versions-") as work:
        source = source_for(args.source)
        host = host_toolchain()
        listing = index.listing(source, Path(work), args.public_key, args.allow_expired)
        if listing.signed is not None:  # a rolled-back index is refused here too; a newer one is remembered
            trust.check_index(source.identity, listing.signed)
            trust.remember(source.identity, listing.signed)
        rows = [(p, compatibility.judge(p.row.backend, p.row.toolchain, host)) for p in listing.versions
                if args.variant is None or p.row.variant.name == args.variant]
        if args.fits_this_host:
            rows = [(p, v) for p, v in rows if v.fit != compatibility.Fit.refused]
        print(as_json(rows) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
