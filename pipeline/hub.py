"""The Hugging Face Hub as a publish target and a pull source, through ``huggingface_hub.HfApi``.

One version is one ``create_commit`` (every file and the card together; large files take the client's LFS path with
its progress bars) made against the head it was prepared from (``parent_commit``), then a tag on the returned commit.
The commit request is not retried by the client, so this module retries the whole read-prepare-commit step on
conflicts (409/412: someone else committed) and transient failures (5xx, connection errors) with jittered, capped
exponential backoff; re-running is safe because an identical commit is a no-op and the version check comes first.

The token comes from ``HF_TOKEN`` or the login cache (``hf auth login``) and is never logged. ``HF_ENDPOINT`` is
honoured at call time.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import PublishError
from pipeline.log import log

RETRY_STATUS = {408, 409, 412, 429, 500, 502, 503, 504}


def endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def token() -> str:
    from huggingface_hub import get_token

    found = get_token()
    if not found:
        raise PublishError("no Hugging Face token: set HF_TOKEN (a token with write access) or run `hf auth login`; "
                           "nothing was published")
    return found


def api(with_token: bool = True):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=token() if with_token else None)


def status_of(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (the client wraps upload failures in a RuntimeError)."""
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _transient_one(exc: BaseException) -> bool:
    status = status_of(exc)
    if status is not None:
        return status in RETRY_STATUS
    # httpx's transport errors (the client's HTTP library) by name: no import of its private module paths.
    name = type(exc).__name__
    network = ("ConnectError", "TimeoutException", "RemoteProtocolError", "ReadError", "WriteError", "NetworkError")
    return isinstance(exc, (ConnectionError, TimeoutError, OSError)) or name.endswith(network)


def transient(exc: BaseException) -> bool:
    """Worth another attempt: conflicts, throttling, server errors and connection failures."""
    chain = causes(exc)
    if any(type(e).__name__ == "OfflineModeIsEnabled" for e in chain):  # a setting (HF_HUB_OFFLINE), not the network
        return False
    return any(_transient_one(e) for e in chain)


def with_retries(step: Callable[[], object], what: str, attempts: int, base_s: float, max_s: float):
    """Run ``step`` until it succeeds, retrying transient failures with jittered exponential backoff."""
    for attempt in range(1, attempts + 1):
        try:
            return step()
        except PublishError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            if not transient(exc) or attempt == attempts:
                status = status_of(exc)
                kind = f"HTTP {status}" if status else type(exc).__name__
                if transient(exc):
                    hint = "retry later: publishing is idempotent, a re-run finishes what this one started"
                elif any(type(e).__name__ == "OfflineModeIsEnabled" for e in causes(exc)):
                    hint = "unset HF_HUB_OFFLINE to publish"
                else:
                    hint = "check publish.repo_id and the token's write access"
                detail = " ".join(str(exc).split())[:400]  # one line: the client's messages span several
                raise PublishError(f"{what} failed after {attempt} attempt(s) ({kind}: {detail}); {hint}. "
                                   "The local artifacts are untouched.") from None
            delay = min(max_s, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            log.warning("%s: attempt %d of %d failed (%s: %s); retrying in %.1f s", what, attempt, attempts,
                        type(exc).__name__, " ".join(str(exc).split())[:200], delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


class HubTarget:
    """A model repo on the Hub, seen as commits, files and tags (the same view ``LocalRepo`` gives of a folder)."""

    def __init__(self, repo_id: str, private: bool):
        self.repo_id, self.private = repo_id, private
        self.api = api()

    def ensure(self) -> None:
        self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)

    def head(self) -> str:
        return self.api.repo_info(self.repo_id).sha

    def tags(self) -> dict[str, str]:
        return {t.name: t.target_commit for t in self.api.list_repo_refs(self.repo_id).tags}

    def list_files(self, commit: str) -> list[str]:
        return self.api.list_repo_files(self.repo_id, revision=commit)

    def read(self, commit: str, path: str) -> bytes | None:
        from huggingface_hub.errors import EntryNotFoundError

        with tempfile.TemporaryDirectory() as tmp:
            try:
                got = self.api.hf_hub_download(self.repo_id, path, revision=commit, local_dir=tmp)
            except EntryNotFoundError:
                return None
            return Path(got).read_bytes()

    def commit(self, files: dict[str, Path | bytes], deletions: list[str], message: str, parent: str) -> str:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        operations = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=src if isinstance(src, bytes) else str(src))
                      for p, src in files.items()]
        operations += [CommitOperationDelete(path_in_repo=p) for p in deletions]
        return self.api.create_commit(self.repo_id, operations, commit_message=message, parent_commit=parent).oid

    def tag(self, name: str, commit: str, replace: bool) -> None:
        if replace:
            self.api.delete_tag(self.repo_id, tag=name)
        self.api.create_tag(self.repo_id, tag=name, revision=commit, tag_message=f"Published {name}")
