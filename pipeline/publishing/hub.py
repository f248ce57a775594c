"""The Hugging Face Hub as a publish target and a pull source, through ``huggingface_hub.HfApi``.

One version is one ``create_commit`` (every file and the card together; large files go through Xet, hf_xet being a
dependency of huggingface_hub on x86_64, or LFS without it) made against the head it was prepared from
(``parent_commit``), then a tag on the returned commit. The commit request is not retried by the client, so this
module retries the whole read-prepare-commit step on conflicts (409/412: someone else committed) and transient failures
(5xx, connection errors) with jittered, capped exponential backoff; re-running is safe because an identical commit is a
no-op and the version check comes first. A refused token (401/403, the Xet token route's included) and a full storage
quota are not retried, and a read the Hub did not answer is never taken for a missing file.

The token comes from ``HF_TOKEN`` or the login cache (``hf auth login``) and is never logged. ``HF_ENDPOINT`` is
honoured at call time.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.core.errors import PublishError
from pipeline.core.log import log, redact

RETRY_STATUS = {408, 409, 412, 429, 500, 502, 503, 504}
AUTH_STATUS = {401, 403}
# hf_xet (the Rust client every upload goes through when it is installed: huggingface_hub's _commit_api._upload_files)
# fetches its write token itself and reports an HTTP failure as a plain ConnectionError whose message carries the
# status, e.g. "Network error: Request error: HTTP status client error (401 Unauthorized), domain: <token url>"
# (hf_xet 1.8.0; tests/hubserver.py answers that route).
_STATUS_IN_MESSAGE = re.compile(r"HTTP status (?:client|server) error \((\d{3})\b")
# The Hub refuses an upload past a private repository's storage quota with a 403 and a message such as "Private
# repository storage limit reached, please upgrade your plan..." (huggingface/huggingface_hub#3048).
_QUOTA = re.compile(r"storage limit|quota", re.IGNORECASE)


def endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def endpoint_url() -> str:
    """The Hub this process talks to, for messages."""
    from huggingface_hub import constants

    return endpoint() or constants.ENDPOINT


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
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status is None and isinstance(exc, ConnectionError):
        found = _STATUS_IN_MESSAGE.search(str(exc))
        status = int(found.group(1)) if found else None
    return status


def causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (the client wraps upload failures in a RuntimeError, and a download whose
    metadata request failed in a LocalEntryNotFoundError)."""
    chain = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _network(exc: BaseException) -> bool:
    # httpx's transport errors (the client's HTTP library) by name: no import of its private module paths. Not every
    # OSError: a LocalEntryNotFoundError is a FileNotFoundError, a full disk an OSError; their causes decide.
    names = ("ConnectError", "TimeoutException", "RemoteProtocolError", "ReadError", "WriteError", "NetworkError")
    return isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__.endswith(names)


def failure(exc: BaseException) -> str:
    """What went wrong, from the whole cause chain: ``offline`` (HF_HUB_OFFLINE), ``quota`` (a 403 naming the storage
    limit), ``auth`` (a 401 or 403 anywhere, the Xet token route included), ``transient`` (conflicts, throttling, server
    errors, connection failures: worth another attempt) or ``permanent``."""
    chain = causes(exc)
    if any(type(e).__name__ == "OfflineModeIsEnabled" for e in chain):  # a setting, not the network
        return "offline"
    statuses = [(status, e) for e in chain if (status := status_of(e)) is not None]
    if any(s == 403 and _QUOTA.search(str(e)) for s, e in statuses):
        return "quota"
    if any(s in AUTH_STATUS for s, _ in statuses):
        return "auth"
    if statuses:  # the outermost answer decides: a 400 wrapping a retried 503 is a 400
        return "transient" if statuses[0][0] in RETRY_STATUS else "permanent"
    return "transient" if any(_network(e) for e in chain) else "permanent"


def transient(exc: BaseException) -> bool:
    """Worth another attempt: conflicts, throttling, server errors and connection failures."""
    return failure(exc) == "transient"


def explain(exc: BaseException, repo_id: str, reading: bool = False) -> tuple[str, str]:
    """``(what the client said, what to do)`` for a failed Hub request, each one line; ``reading`` for pull."""
    status = next((s for s in map(status_of, causes(exc)) if s is not None), None)
    # The server's words, shortened and with anything shaped like a token redacted: they end up in logs and CI output.
    said = f"{f'HTTP {status}' if status else type(exc).__name__}: {redact(' '.join(str(exc).split()))[:400]}"
    hint = {
        "offline": "unset HF_HUB_OFFLINE to reach the Hub",
        "quota": f"{repo_id} is over the Hub's storage quota for private repositories (deleted archives still count: "
                 "git history keeps them): free space in the repository's storage settings (or super-squash its "
                 "history), make it public, or upgrade the plan; not retried",
        "auth": (f"the token cannot read {repo_id}: set HF_TOKEN to a token with access to it" if reading else
                 f"the token cannot write to {repo_id}: use a token with write access (HF_TOKEN or `hf auth login`); "
                 "not retried"),
        "transient": f"the Hub at {endpoint_url()} did not answer; retry later",
        "permanent": ("check the repository id and, for a private repository, HF_TOKEN" if reading else
                      "check publish.repo_id and the token's write access"),
    }[failure(exc)]
    if any("Invalid metadata in README.md" in str(e) for e in causes(exc)):  # hf_api._validate_yaml, or the commit
        hint = "the Hub refused the model card's metadata (rendered by pipeline/publishing/card.py)"
    return said, hint


def with_retries(step: Callable[[], object], what: str, attempts: int, base_s: float, max_s: float,
                 repo_id: str = "the repository"):
    """Run ``step`` until it succeeds, retrying transient failures with jittered exponential backoff."""
    for attempt in range(1, attempts + 1):
        try:
            return step()
        except PublishError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            if not transient(exc) or attempt == attempts:
                said, hint = explain(exc, repo_id)
                if transient(exc):
                    hint += ": publishing is idempotent, a re-run finishes what this one started"
                raise PublishError(f"{what} failed after {attempt} attempt(s) ({said}); {hint}. "
                                   "The local artifacts are untouched.") from None
            delay = min(max_s, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
            log.warning("%s: attempt %d of %d failed (%s: %s); retrying in %.1f s", what, attempt, attempts,
                        type(exc).__name__, redact(" ".join(str(exc).split()))[:200], delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


class HubTarget:
    """A model repo on the Hub, seen as commits, files and tags (the same view ``LocalRepo`` gives of a folder)."""

    def __init__(self, repo_id: str, private: bool):
        self.repo_id, self.private = repo_id, private
        self.api = api()

    def exists(self) -> bool:
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            self.api.repo_info(self.repo_id)
        except RepositoryNotFoundError:
            return False
        return True

    def ensure(self) -> None:
        """Create the repository if it is missing. Asked first, so that an existing one needs no create right: the
        client's ``create_repo(exist_ok=True)`` answers a 403 by checking that the repo exists, then builds a URL that
        fails for any HF_ENDPOINT but huggingface.co's (HfUriError; huggingface_hub 2.4.0, hf_api.create_repo)."""
        if not self.exists():
            self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)

    def head(self) -> str:
        return self.api.repo_info(self.repo_id).sha

    def tags(self) -> dict[str, str]:
        return {t.name: t.target_commit for t in self.api.list_repo_refs(self.repo_id).tags}

    def list_files(self, commit: str) -> list[str]:
        return self.api.list_repo_files(self.repo_id, revision=commit)

    def read(self, commit: str, path: str) -> bytes | None:
        """The file's bytes, or None when the Hub says it has no such file (404 ``X-Error-Code: EntryNotFound``).

        Only that answer is absence: a download whose metadata request failed (5xx, timeouts, a closed port) ends, after
        the client's own retries, in ``LocalEntryNotFoundError``, a sibling of the remote error under
        ``EntryNotFoundError`` (huggingface_hub file_download._raise_on_head_call_error); it propagates, so that an
        outage fails the step instead of reading as an empty repository."""
        from huggingface_hub.errors import RemoteEntryNotFoundError

        with tempfile.TemporaryDirectory() as tmp:
            try:
                got = self.api.hf_hub_download(self.repo_id, path, revision=commit, local_dir=tmp)
            except RemoteEntryNotFoundError:
                return None
            return Path(got).read_bytes()

    def file_digest(self, commit: str, path: str) -> tuple[int, str] | None:
        """``(size, sha256)`` of one file at ``commit`` (None: no such file). For a file in LFS or Xet storage (every
        archive: binary files go there), the Hub's record of its object, the sha256 the object is addressed by and
        that the Hub checked when it was uploaded (the tree listing's ``lfs`` entry); any other file is downloaded
        and hashed."""
        from huggingface_hub.errors import EntryNotFoundError

        folder = path.rsplit("/", 1)[0] if "/" in path else None
        try:
            entries = list(self.api.list_repo_tree(self.repo_id, path_in_repo=folder, revision=commit))
        except EntryNotFoundError:
            return None
        entry = next((e for e in entries if getattr(e, "path", None) == path and hasattr(e, "lfs")), None)
        if entry is None:
            return None
        if entry.lfs is not None:
            return entry.lfs.size, entry.lfs.sha256
        data = self.read(commit, path)
        return None if data is None else (len(data), hashlib.sha256(data).hexdigest())

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
