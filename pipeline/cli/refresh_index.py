"""``python -m pipeline refresh-index [OVERRIDE ...]``: keep the published repository's signed index from expiring.

A consumer with the public key refuses ``versions.json`` once it has expired (``publish.index_expiry_days`` after it
was written; pipeline/publishing/index.py): that bounds how long someone can serve an old copy (a freeze). While
nothing new is published, nothing rewrites it, so this command does: when less than half of its lifetime is left
(``--force``: now), it commits the same rows again with the next ``index_version`` and a new expiry, signed with
``package.signing.private_key`` where signing is on. The scheduled rebuild (deploy/rebuild.sh) runs it after every
``dvc repro``.

The target is the one ``dvc repro`` publishes to: params.yaml's ``publish`` and ``model`` choices (as dvc.yaml passes
them), then the overrides given here.

    python -m pipeline refresh-index                   # the target params.yaml names
    python -m pipeline refresh-index publish=hub publish.repo_id=your-org/gemma-4-E4B-it-inferentia2 --force

A ``publish=local`` folder is the publisher's own: git runs there with its own configuration and hooks, as it does
when the publisher types a git command in it. What is refused is a folder another user could change (the pull
record's rule, pipeline/host/locking.py): they could plant configuration that runs a command, and, worse, commit rows
that this command would then sign with the private key. Its folder (or, as /tmp is, sticky and this user's or root's)
and every folder and file in it must be this user's alone; the publish stage holds it to the same rule
(pipeline/stages/publish.py ``on_target``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from pipeline.cli import plain
from pipeline.core.log import exit_on_error, setup

CHOICES = ("model", "publish")  # params.yaml's pipeline-level choices the target depends on


def params_choices(params: Path = Path("params.yaml")) -> list[str]:
    """``model=...`` and ``publish=...`` as params.yaml sets them (none where there is no params.yaml)."""
    if not params.is_file():
        return []
    data = yaml.safe_load(params.read_text()) or {}
    return [f"{key}={data[key]}" for key in CHOICES if isinstance(data.get(key), str)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline refresh-index", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="configuration overrides (KEY=VALUE), after params.yaml's")
    parser.add_argument("--force", action="store_true", help="write the index again now, however much time is left")
    args = parser.parse_args(argv)
    setup()
    with exit_on_error():
        from pipeline.run import compose
        from pipeline.stages.publish import refresh_index

        cfg = compose(params_choices() + list(args.overrides))
        refresh_index(cfg, args.force)  # refuses a publish=local folder another user could change
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
