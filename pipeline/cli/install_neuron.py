"""``python -m pipeline install-neuron``: install one Neuron SDK release from its lock file (the first install).

The second step of ``deploy/install-inf2.sh`` (the first installs the base lock from PyPI): installs release
``--release`` (default the tested one, pipeline/backends/neuron_sdk.py ``PINNED``) with torch ``--torch``'s
torch-neuronx build from ``deploy/lock/neuron-<release>-torch<torch>.txt``, every file by URL and sha256 (no index is
asked; pipeline/cli/neuron_lock.py). When that lock is missing it is made first, from the Neuron repository alone for
the Neuron packages (``--neuron-index``), exactly as ``check-upgrades --apply`` makes the lock of a newer release;
commit it. ``--lock-only`` makes a missing lock and installs nothing: ``deploy/install-inf2.sh`` runs it first, in the
new environment before its base lock is installed (``python -m pipeline.cli.install_neuron``, with pip's own vendored
``packaging``: nothing of this module needs more), so that a release the base lock cannot hold (a Neuron package
pinning ``numpy<2`` against its ``numpy==2.2.6``) is refused, the two pins named, with the host untouched. Exit codes:
0 installed (or locked), 1 refused or failed (nothing half-installed is left to trust: rerun), 2 usage.

    python -m pipeline install-neuron
    python -m pipeline install-neuron --release 2.28.1 --neuron-index https://neuron-mirror.example/simple
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pipeline.backends import neuron_sdk
from pipeline.cli import neuron_lock, plain, upgrades
from pipeline.core.errors import PipelineError
from pipeline.core.log import exit_on_error, setup


def versions_to_install(args: argparse.Namespace, lock: Path) -> tuple[dict[str, str], dict]:
    """Each package's version, and the Neuron repository's offers when the lock must be made (when it exists, no
    request is made at all: the table's versions are what the lock must hold)."""
    row = neuron_sdk.release(args.release)
    wanted = row.exact_versions(args.torch)
    if wanted is None:
        raise upgrades.UpgradeCheckError(f"release {args.release} has no torch-neuronx build for torch {args.torch} "
                                         f"(it has {', '.join(row.torch_neuronx)}): choose --torch")
    if lock.is_file():
        return wanted, {}
    available = {name: upgrades.offers(args.neuron_index, name) for name in neuron_sdk.PACKAGES}
    found = upgrades.offered_row(row, args.torch, available)
    if found is None:
        raise upgrades.UpgradeCheckError(f"the Neuron repository {args.neuron_index} does not offer all of release "
                                         f"{args.release} for torch {args.torch} ({wanted})")
    return found, available


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline install-neuron", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--release", default=neuron_sdk.PINNED, choices=[r.release for r in neuron_sdk.RELEASES],
                        help=f"the Neuron SDK release (default: {neuron_sdk.PINNED}, the tested one)")
    parser.add_argument("--torch", default=neuron_sdk.PINNED_TORCH,
                        help=f"the torch whose torch-neuronx build to install (default: {neuron_sdk.PINNED_TORCH})")
    parser.add_argument("--neuron-index", default=neuron_sdk.NEURON_INDEX,
                        help="the Neuron repository or a mirror of it, asked only to make a missing lock")
    parser.add_argument("--python", help="the interpreter of the environment to install into (default: this one)")
    parser.add_argument("--lock-only", action="store_true",
                        help="make the release's lock when it is missing (resolved against the base lock), install "
                             "nothing")
    upgrades.add_lock_arguments(parser)
    args = parser.parse_args(argv)
    setup()
    with exit_on_error():
        lock = neuron_lock.lock_file(Path(args.lock_dir), args.release, args.torch)
        try:
            versions, available = versions_to_install(args, lock)
            if args.lock_only:
                made = upgrades.make_lock(args.python, args.neuron_index, args.release, versions, available,
                                          Path(args.lock_dir), Path(args.base_lock))
                print(f"release {args.release}: {made} holds it, resolved against {args.base_lock}")
                return 0
            upgrades.install(args.python, args.neuron_index, args.release, versions, available,
                             Path(args.lock_dir), Path(args.base_lock))
        except neuron_lock.LockError as exc:
            raise PipelineError(f"{exc}: delete it to make it again, or restore it from git") from None
        except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
            raise upgrades.UpgradeCheckError(str(exc)) from None
    print(f"installed Neuron SDK release {args.release} from {lock}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
