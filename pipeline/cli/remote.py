"""``python -m pipeline check-remote [-r NAME]``: can this host read and write the DVC remote, before any build work?

The scheduled rebuild (deploy/rebuild.sh) and the cluster recipe (docs/scale.md) pull from the DVC remote, build for
hours, then push. A bucket that does not exist or credentials it refuses would otherwise surface only at the push, or
be mistaken by ``dvc pull --allow-missing`` for a first run with nothing stored yet. This command asks DVC for the
remote exactly as ``dvc push`` would (its configuration, its filesystem, the credentials it resolves: the usual AWS
variables, a profile, or the instance role), then writes one empty object under the remote's path and removes it.

Exit 0 when both succeed; 1 naming the remote, its URL and the fix otherwise: no remote configured, the bucket (or
folder) does not exist, the credentials are refused, or the endpoint does not answer. Nothing is created: not the
bucket (s3fs would create a missing bucket on ``makedirs``, so it is never called for an object store), and the
probe object is removed. Credentials are never printed: only the remote's name and URL, and the store's own error
message (S3's messages name the key id at most, never the secret).
"""

from __future__ import annotations

import argparse
import uuid

from pipeline.cli import plain
from pipeline.core.errors import ConfigError, PipelineError
from pipeline.core.log import exit_on_error, log, setup

PROBE_PREFIX = ".pipeline-check-remote-"


class RemoteError(PipelineError):
    """The DVC remote cannot be used from here (missing, refused, or not answering)."""


def check_remote(repo_dir: str, name: str | None) -> str:
    """Write and remove a probe object on the remote; return a line saying which remote answered."""
    from dvc.config import NoRemoteError, RemoteNotFoundError
    from dvc.repo import Repo

    with Repo(repo_dir) as repo:
        try:
            remote = repo.cloud.get_remote(name, command="check-remote")
        except (NoRemoteError, RemoteNotFoundError) as exc:
            raise ConfigError(f"DVC remote {name or '(default)'}: {exc}. Add one with `dvc remote add -d NAME "
                              "s3://BUCKET/PATH` (docs/rebuilds.md), or run without a remote (SKIP_DVC_REMOTE=1)"
                              ) from None
        url = repo.config["remote"][remote.name]["url"]
        where = f"DVC remote {remote.name!r} ({url})"
        probe = f"{remote.path.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            if remote.fs.protocol == "local":  # a folder remote may not exist yet: dvc push creates it
                remote.fs.makedirs(remote.path, exist_ok=True)
            remote.fs.pipe_file(probe, b"")
            remote.fs.rm_file(probe)
        except FileNotFoundError as exc:
            raise RemoteError(f"{where}: {exc}. Create it (for S3: aws s3 mb s3://BUCKET), or point the remote at "
                              f"one that exists: dvc remote modify {remote.name} url s3://BUCKET/PATH") from None
        except PermissionError as exc:
            raise RemoteError(f"{where} refused this host's credentials: {exc}. Give ones allowed to read and write "
                              "it: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or the instance "
                              "role (dvc remote modify --local can hold them too; never commit them)") from None
        except Exception as exc:  # noqa: BLE001 - the endpoint's other failures (unreachable, no credentials at all)
            raise RemoteError(f"{where} cannot be written from here: {type(exc).__name__}: {exc}. Check the "
                              f"remote's endpoint (dvc remote modify {remote.name} endpointurl URL, for a store "
                              "other than AWS) and the credentials") from None
        return f"{where}: readable and writable from here"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline check-remote",
                                     description=plain(__doc__.split("\n\n")[0]))
    parser.add_argument("-r", "--remote", help="the remote's name (default: the repository's default remote)")
    parser.add_argument("--repo", default=".", help="the DVC repository (default: here)")
    args = parser.parse_args(argv)
    setup()
    with exit_on_error():
        log.info("%s", check_remote(args.repo, args.remote))
        return 0
    return 1
