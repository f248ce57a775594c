"""The subcommands of ``python -m pipeline`` (each module one; ``--help`` shows its docstring through ``plain``)."""


def plain(doc: str) -> str:
    """A module docstring as ``--help`` shows it: reStructuredText's double backticks as single ones."""
    return doc.replace("``", "`")
