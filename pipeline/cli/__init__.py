"""The subcommands of ``python -m pipeline`` (each module one; ``--help`` shows its docstring through ``plain``)."""

import argparse


def plain(doc: str) -> str:
    """A module docstring as ``--help`` shows it: reStructuredText's double backticks as single ones."""
    return doc.replace("``", "`")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give 1 or more")
    return value


def add_decode_threads(parser: argparse.ArgumentParser) -> None:
    """``--decode-threads``, as generate and serve take it (a build's validation: validate.throughput.decode_threads).
    Both load torch anyway: the default is read from validation/generation.py here, not at import."""
    from pipeline.decoding.runner import DECODE_THREADS

    parser.add_argument("--decode-threads", type=positive_int, default=DECODE_THREADS,
                        help=f"torch's threads on the host per decode step (default: {DECODE_THREADS}, the count "
                             "bench/decode_threads.py measured fastest)")
