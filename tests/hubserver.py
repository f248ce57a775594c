"""A Hugging Face Hub-compatible server for tests: in memory, on 127.0.0.1 (the standard library, and PyYAML for the
model card's metadata).

It implements the endpoints ``huggingface_hub`` calls to publish and to pull: create a repo, repo info, preupload, the
LFS batch API with upload and verify actions, the Xet token routes, commit (NDJSON, ``parentCommit`` answered with 412
when the branch moved), list refs, create and delete tags, validate YAML, list the tree, and resolve (download) files.

It is as strict as the Hub where the project depends on it: a read-only token (``Hub.read_token``) gets 403 on every
write; a tag name ``git check-ref-format`` refuses is a 400; deleting a missing file is a 404 ``EntryNotFound``; a
README.md whose metadata names an unknown ``license`` or a ``base_model`` that is no repo id is a 400, on
``/api/validate-yaml`` and on the commit alike.

Xet: a real Xet upload cannot complete here (hf_xet talks to a CAS server with its own protocol, and this server could
not serve the files back without reassembling Xet's chunks), so the Xet token routes answer faithfully (the headers
hf_xet reads) but point at a CAS that answers 501, and the tests that upload successfully disable Xet, taking the LFS
path. With Xet enabled the client asks for a write token before any byte moves (huggingface_hub
_commit_api._upload_xet_files hands the route to hf_xet), so the failures production meets there (a token refused, the
route down) are tested with Xet on and ``Faults.xet_token``.

Faults are injected through ``Hub.faults``: a number of 412s on the next commits, failed or dropped LFS uploads, a
commit that lands but answers 500, every resolve answering a status (an outage), the Xet token routes answering a
status, and a private repository over its storage quota.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import yaml

USER = "tester"
LFS_THRESHOLD = 64 * 1024  # files larger than this (or not text) go through LFS
# The license identifiers the Hub accepts in a card's metadata, as its validation error lists them
# (huggingface/huggingface_hub#4218, 2026).
LICENSES = set("""apache-2.0 mit openrail bigscience-openrail-m creativeml-openrail-m bigscience-bloom-rail-1.0
bigcode-openrail-m afl-3.0 artistic-2.0 bsl-1.0 bsd bsd-2-clause bsd-3-clause bsd-3-clause-clear c-uda cc cc0-1.0
cc-by-2.0 cc-by-2.5 cc-by-3.0 cc-by-4.0 cc-by-sa-3.0 cc-by-sa-4.0 cc-by-nc-2.0 cc-by-nc-3.0 cc-by-nc-4.0 cc-by-nd-4.0
cc-by-nc-nd-3.0 cc-by-nc-nd-4.0 cc-by-nc-sa-2.0 cc-by-nc-sa-3.0 cc-by-nc-sa-4.0 cdla-sharing-1.0 cdla-permissive-1.0
cdla-permissive-2.0 wtfpl ecl-2.0 epl-1.0 epl-2.0 etalab-2.0 eupl-1.1 eupl-1.2 agpl-3.0 gfdl gpl gpl-2.0 gpl-3.0 lgpl
lgpl-2.1 lgpl-3.0 isc h-research intel-research lppl-1.3c ms-pl apple-ascl apple-amlr mpl-2.0 odc-by odbl openmdw-1.0
openrail++ osl-3.0 postgresql ofl-1.1 ncsa unlicense zlib pddl lgpl-lr deepfloyd-if-license
fair-noncommercial-research-license llama2 llama3 llama3.1 llama3.2 llama3.3 llama4 grok2-community gemma unknown
other""".split())
# A repo id as huggingface_hub's validate_repo_id accepts it, with the owner the Hub's metadata check requires.
REPO_ID_RE = re.compile(r"[\w\-.]{1,96}/[\w\-.]{1,96}")
# The Hub's answer to a write past a private repository's storage quota (huggingface/huggingface_hub#3048).
QUOTA_MESSAGE = "Private repository storage limit reached, please upgrade your plan to increase your storage limit"


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    files: dict[str, bytes]
    message: str


@dataclass
class Repo:
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    main: str = ""
    tags: dict[str, str] = field(default_factory=dict)

    def commit(self, files: dict[str, bytes], message: str) -> Commit:
        oid = hashlib.sha1(json.dumps([self.main, message, sorted((p, git_sha1(d)) for p, d in files.items())])
                           .encode() + str(len(self.commits)).encode()).hexdigest()
        c = Commit(oid, self.main or None, files, message)
        self.commits[oid] = c
        self.main = oid
        return c

    def resolve(self, revision: str) -> Commit | None:
        if revision in ("main", "refs/heads/main"):
            return self.commits.get(self.main)
        if revision in self.tags:
            return self.commits[self.tags[revision]]
        matches = [c for oid, c in self.commits.items() if oid.startswith(revision)]
        return matches[0] if len(matches) == 1 else None


@dataclass
class Faults:
    conflicts: int = 0  # answer this many commits with 412 (as if the branch moved)
    upload_errors: int = 0  # fail this many LFS uploads with a 400 (the client does not retry those)
    drop_uploads: int = 0  # drop this many LFS uploads mid-body (a broken connection)
    commit_lost: int = 0  # apply this many commits but answer 500 (the response is lost)
    resolve: int = 0  # while set, answer every resolve (HEAD and GET) with this status: the Hub is down
    xet_token: int = 0  # while set, answer the Xet token routes with this status
    quota: bool = False  # while set, private repositories are over their storage quota: writes get the Hub's 403


class Hub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.faults = Faults()
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.token = "hf_test_token"
        self.read_token = "hf_test_read_token"  # a token with the read role: every write answers 403
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> Hub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def commit_count(self, repo_id: str) -> int:
        return len(self.repos[repo_id].commits) if repo_id in self.repos else 0


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # -- plumbing ---------------------------------------------------------------------------------------------

    def body(self) -> bytes:
        if getattr(self, "_body", None) is not None:
            return self._body
        self._body = self._read_body()
        return self._body

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def reply(self, status: int, payload=None, headers: dict | None = None, raw: bytes | None = None) -> None:
        data = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else b"")
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if raw is None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def error(self, status: int, code: str, message: str) -> None:
        self.reply(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def bearer(self) -> str | None:
        return {f"Bearer {self.hub.token}": "write", f"Bearer {self.hub.read_token}": "read"}.get(
            self.headers.get("Authorization", ""))

    def authorized(self) -> bool:
        if self.bearer():
            return True
        self.error(401, "Unauthorized", "Invalid credentials in Authorization header")
        return False

    def writable(self, repo_id: str) -> bool:
        """A write: a valid token with the write role, and (for a private repository) room in its storage quota."""
        if not self.authorized():
            return False
        if self.bearer() != "write":  # the Hub's answer to a read token on a write route (message approximated)
            self.error(403, "Forbidden", f"You don't have the rights to write to {repo_id}: this token has the read "
                                         "role; use a token with the write role")
            return False
        repo = self.hub.repos.get(repo_id)
        if self.hub.faults.quota and repo is not None and repo.private:
            self.error(403, "Forbidden", QUOTA_MESSAGE)
            return False
        return True

    def repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self.bearer()):
            self.error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
            return None
        return repo

    def route(self, method: str) -> None:
        path = self.path.split("?")[0]
        self.hub.calls.append((method, path))
        for pattern, name in ROUTES.get(method, []):
            match = re.fullmatch(pattern, path)
            if match:
                args = [unquote(g) if g is not None else None for g in match.groups()]
                self._body = None
                with self.hub.lock if name not in ("lfs_upload",) else _nolock():
                    getattr(self, name)(*args)
                if self._body is None and not self.close_connection and method in ("POST", "PUT", "PATCH", "DELETE"):
                    self.body()  # drain an unread request body, or it would be read as the next request
                return
        self.error(404, "EntryNotFound", f"no route for {method} {path}")

    def do_GET(self):  # noqa: N802
        self.route("GET")

    def do_HEAD(self):  # noqa: N802
        self.route("HEAD")

    def do_POST(self):  # noqa: N802
        self.route("POST")

    def do_PUT(self):  # noqa: N802
        self.route("PUT")

    def do_DELETE(self):  # noqa: N802
        self.route("DELETE")

    def do_PATCH(self):  # noqa: N802
        self.route("PATCH")

    # -- endpoints --------------------------------------------------------------------------------------------

    def whoami(self):
        if self.authorized():
            self.reply(200, {"name": USER, "type": "user", "orgs": []})

    def create_repo(self):
        payload = json.loads(self.body())
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
        if not self.writable(repo_id):  # the client's create_repo(exist_ok=True) then checks the repo exists
            return
        if repo_id in self.hub.repos:
            self.reply(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"},
                       {"X-Error-Code": "RepoExists"})
            return
        repo = Repo(private=payload.get("visibility", "private") != "public")
        repo.commit({".gitattributes": b"*.zst filter=lfs diff=lfs merge=lfs -text\n"}, "initial commit")
        self.hub.repos[repo_id] = repo
        self.reply(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def repo_info(self, repo_id, revision=None):
        repo = self.repo(repo_id)
        if repo is None:
            return
        commit = repo.resolve(revision or "main")
        if commit is None:
            self.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        self.reply(200, {"id": repo_id, "sha": commit.oid, "private": repo.private,
                         "siblings": [{"rfilename": p} for p in sorted(commit.files)]})

    def preupload(self, repo_id, revision):
        repo = self.repo(repo_id)
        if repo is None or not self.writable(repo_id):
            return
        head = repo.resolve(revision)
        files = []
        for f in json.loads(self.body())["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["size"] > LFS_THRESHOLD or not _is_text(sample)
            remote = head.files.get(f["path"]) if head else None
            oid = None if remote is None else (hashlib.sha256(remote).hexdigest() if lfs else git_sha1(remote))
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                          "oid": oid})
        self.reply(200, {"files": files})

    def lfs_batch(self, repo_id):
        """The LFS batch API. The server picks the transfer from those the client offers (git-lfs's batch API), and
        the Hub's repositories are Xet-backed, so a client that offers ``xet`` gets it: huggingface_hub 1.x offers it
        whenever hf_xet is installed and uploads through Xet only when the answer names it (_commit_api._upload_files,
        "Negotiates per-file transfer (LFS vs Xet)"); 2.x skips this call and goes to Xet directly."""
        if self.repo(repo_id) is None or not self.writable(repo_id):
            return
        body = json.loads(self.body())
        if "xet" in body.get("transfers", ["basic"]):
            self.reply(200, {"transfer": "xet", "objects": [{"oid": o["oid"], "size": o["size"]}
                                                            for o in body["objects"]]})
            return
        objects = []
        for obj in body["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.hub.lfs:
                entry["actions"] = {"upload": {"href": f"{self.hub.url}/lfs-upload/{obj['oid']}"},
                                    "verify": {"href": f"{self.hub.url}/lfs-verify/{obj['oid']}"}}
            objects.append(entry)
        self.reply(200, {"transfer": "basic", "objects": objects})

    def lfs_upload(self, oid):
        faults = self.hub.faults
        if faults.drop_uploads > 0:
            faults.drop_uploads -= 1
            self.rfile.read(min(1024, int(self.headers.get("Content-Length") or 1024)))
            self.close_connection = True
            self.connection.shutdown(2)  # mid-body: the client sees a broken connection
            return
        data = self.body()
        if faults.upload_errors > 0:
            faults.upload_errors -= 1
            self.error(400, "BadRequest", "simulated storage failure")
            return
        if hashlib.sha256(data).hexdigest() != oid:
            self.error(400, "BadRequest", "content does not match its oid")
            return
        self.hub.lfs[oid] = data
        self.reply(200, {})

    def lfs_verify(self, oid):
        if oid in self.hub.lfs:
            self.reply(200, {"success": True})
        else:
            self.error(404, "EntryNotFound", f"LFS object {oid} was never uploaded")

    def xet_token(self, repo_id, kind, revision):
        """``GET /api/models/{repo}/xet-{read,write}-token/{revision}``: the Xet access token, in the headers
        huggingface_hub's utils/_xet.py (parse_xet_connection_info_from_headers) and hf_xet read; the write one needs
        write access. The CAS it names answers 501: no Xet transfer completes here."""
        if self.repo(repo_id) is None or not (self.writable(repo_id) if kind == "write" else self.authorized()):
            return
        if self.hub.faults.xet_token:
            self.error(self.hub.faults.xet_token, "XetTokenFault", "simulated Xet token route failure")
            return
        self.reply(200, {}, {"X-Xet-Cas-Url": f"{self.hub.url}/cas", "X-Xet-Access-Token": "xet_test_token",
                             "X-Xet-Token-Expiration": str(int(time.time()) + 3600)})

    def cas(self, path):
        self.error(501, "NotImplemented", f"this test Hub has no Xet CAS (/cas/{path}): disable Xet for uploads")

    def commit(self, repo_id, revision):
        repo = self.repo(repo_id)
        if repo is None or not self.writable(repo_id):
            return
        lines = [json.loads(line) for line in self.body().splitlines() if line.strip()]
        header = lines[0]["value"]
        faults = self.hub.faults
        if faults.conflicts > 0:
            faults.conflicts -= 1
            self.error(412, "PreconditionFailed", "A commit has happened since. Please refresh and try again.")
            return
        if header.get("parentCommit") and not repo.main.startswith(header["parentCommit"]):
            self.error(412, "PreconditionFailed", "A commit has happened since. Please refresh and try again.")
            return
        files = dict(repo.resolve(revision).files)
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in self.hub.lfs:
                    self.error(400, "BadRequest", f"LFS object {value['oid']} was not uploaded")
                    return
                files[value["path"]] = self.hub.lfs[value["oid"]]
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:  # HfApi.delete_file documents EntryNotFoundError for this
                    self.error(404, "EntryNotFound", f"{value['path']} does not exist at {revision}")
                    return
        problems = card_problems(files["README.md"].decode()) if "README.md" in files else []
        if problems:  # the Hub validates the card on commit too, not only on /api/validate-yaml
            self.error(400, "BadRequest", "Invalid metadata in README.md. " + " ".join(problems))
            return
        commit = repo.commit(files, header["summary"])
        if faults.commit_lost > 0:
            faults.commit_lost -= 1
            self.error(500, "InternalError", "the commit landed but the response was lost")
            return
        self.reply(200, {"success": True, "commitOid": commit.oid,
                         "commitUrl": f"{self.hub.url}/{repo_id}/commit/{commit.oid}"})

    def refs(self, repo_id):
        repo = self.repo(repo_id)
        if repo is None:
            return
        self.reply(200, {"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": repo.main}],
                         "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": c}
                                  for t, c in sorted(repo.tags.items())],
                         "converts": []})

    def create_tag(self, repo_id, revision):
        repo = self.repo(repo_id)
        if repo is None or not self.writable(repo_id):
            return
        tag = json.loads(self.body())["tag"]
        commit = repo.resolve(revision)
        if not valid_ref(tag):  # a 400: hf_raise_for_status makes it a BadRequestError (utils/_http.py)
            self.error(400, "BadRequest", f"Invalid tag name: {tag!r} is not a valid git reference")
        elif tag in repo.tags:
            self.error(409, "Conflict", f"Tag {tag} already exists")
        elif commit is None:
            self.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        else:
            repo.tags[tag] = commit.oid
            self.reply(200, {})

    def delete_tag(self, repo_id, tag):
        repo = self.repo(repo_id)
        if repo is None or not self.writable(repo_id):
            return
        if repo.tags.pop(tag, None) is None:
            self.error(404, "RevisionNotFound", f"Tag {tag} does not exist")
        else:
            self.reply(200, {})

    def validate_yaml(self):
        """What HfApi.create_commit asks before uploading a README.md (hf_api._validate_yaml): a 400 with
        ``{"errors": [{"message"}]}`` becomes its ``ValueError("Invalid metadata in README.md. ...")``."""
        content = json.loads(self.body())["content"]
        problems = card_problems(content) if content.startswith("---\n") else ["README.md has no YAML metadata"]
        if problems:
            self.reply(400, {"errors": [{"message": p} for p in problems]})
        else:
            self.reply(200, {"warnings": []})

    def commit_at(self, repo_id, revision) -> Commit | None:
        """The commit ``revision`` names in ``repo_id``, or None after answering 404."""
        repo = self.repo(repo_id)
        if repo is None:
            return None
        commit = repo.resolve(revision)
        if commit is None:
            self.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def tree(self, repo_id, revision, prefix=None):
        commit = self.commit_at(repo_id, revision)
        if commit is None:
            return
        entries = []
        for p, data in sorted(commit.files.items()):
            if prefix and not p.startswith(prefix.rstrip("/") + "/"):
                continue
            entry = {"type": "file", "path": p, "size": len(data), "oid": git_sha1(data)}
            if _stored_in_lfs(data):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        self.reply(200, entries)

    def resolve_file(self, repo_id, revision, path):
        if self.hub.faults.resolve:
            self.error(self.hub.faults.resolve, "ServiceUnavailable", "simulated outage")
            return
        commit = self.commit_at(repo_id, revision)
        if commit is None:
            return
        data = commit.files.get(path)
        if data is None:
            self.error(404, "EntryNotFound", f"{path} does not exist at {revision}")
            return
        etag = hashlib.sha256(data).hexdigest() if _stored_in_lfs(data) else git_sha1(data)
        self.reply(200, raw=data, headers={"ETag": f'"{etag}"', "X-Repo-Commit": commit.oid,
                                           "Content-Type": "application/octet-stream"})


class _nolock:
    """LFS uploads stream large bodies: they do not hold the server lock."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def card_problems(readme: str) -> list[str]:
    """What the Hub's metadata check refuses in a model card, in its words: an unknown ``license`` (or none: the
    project's cards always set one) and a ``base_model`` that is not a model id."""
    _, front, _ = (readme.split("---\n", 2) + ["", ""])[:3] if readme.startswith("---\n") else ("", "", "")
    try:
        meta = yaml.safe_load(front) or {}
    except yaml.YAMLError as exc:
        return [f"Invalid YAML: {exc}"]
    problems = []
    if meta.get("license") not in LICENSES:
        problems.append(f'"license" must be one of [{", ".join(sorted(LICENSES))}]')
    bases = meta.get("base_model")
    for base in bases if isinstance(bases, list) else [] if bases is None else [bases]:
        if not isinstance(base, str) or not REPO_ID_RE.fullmatch(base):
            problems.append(f'"base_model" with value "{base}" is not valid. Use a model id from https://hf.co/models.')
    return problems


def valid_ref(name: str) -> bool:
    """A tag name the Hub accepts: what ``git check-ref-format`` accepts, not starting with '-'."""
    if name.startswith("-") or "\0" in name:
        return False
    return subprocess.run(["git", "check-ref-format", f"refs/tags/{name}"], capture_output=True).returncode == 0


def _stored_in_lfs(data: bytes) -> bool:
    return len(data) > LFS_THRESHOLD or not _is_text(data[:512])


def _is_text(sample: bytes) -> bool:
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in sample


REPO = r"([^/]+/[^/]+)"
ROUTES = {
    "GET": [
        (r"/api/whoami-v2", "whoami"),
        (rf"/api/models/{REPO}", "repo_info"),
        (rf"/api/models/{REPO}/revision/([^/]+)", "repo_info"),
        (rf"/api/models/{REPO}/refs", "refs"),
        (rf"/api/models/{REPO}/tree/([^/]+)", "tree"),
        (rf"/api/models/{REPO}/tree/([^/]+)/(.+)", "tree"),
        (rf"/api/models/{REPO}/xet-(read|write)-token/([^/]+)", "xet_token"),
        (r"/cas/(.*)", "cas"),
        (rf"/{REPO}/resolve/([^/]+)/(.+)", "resolve_file"),
    ],
    "HEAD": [(rf"/{REPO}/resolve/([^/]+)/(.+)", "resolve_file")],
    "POST": [
        (r"/api/repos/create", "create_repo"),
        (r"/api/validate-yaml", "validate_yaml"),
        (rf"/api/models/{REPO}/preupload/([^/]+)", "preupload"),
        (rf"/api/models/{REPO}/commit/([^/]+)", "commit"),
        (rf"/api/models/{REPO}/tag/([^/]+)", "create_tag"),
        (rf"/{REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
        (r"/lfs-verify/([0-9a-f]+)", "lfs_verify"),
        (r"/cas/(.*)", "cas"),
    ],
    "PUT": [(r"/lfs-upload/([0-9a-f]+)", "lfs_upload")],
    "PATCH": [(r"/cas/(.*)", "cas")],
    "DELETE": [(rf"/api/models/{REPO}/tag/([^/]+)", "delete_tag")],
}
