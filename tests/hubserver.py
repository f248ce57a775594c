"""A Hugging Face Hub-compatible server for tests: in memory, standard library only, on 127.0.0.1.

It implements the endpoints ``huggingface_hub`` (without Xet) calls to publish and to pull: create a repo, repo info,
preupload, the LFS batch API with upload and verify actions, commit (NDJSON, ``parentCommit`` answered with 412 when
the branch moved), list refs, create and delete tags, validate YAML, list the tree, and resolve (download) files.
Faults are injected through ``Hub.faults``: a number of 412s on the next commits, failed or dropped LFS uploads, a
commit that lands but answers 500.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

USER = "tester"
LFS_THRESHOLD = 64 * 1024  # files larger than this (or not text) go through LFS


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


class Hub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.faults = Faults()
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.token = "hf_test_token"
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

    def authorized(self) -> bool:
        if self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        self.error(401, "Unauthorized", "Invalid credentials in Authorization header")
        return False

    def repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and self.headers.get("Authorization") != f"Bearer {self.hub.token}"):
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
                if self._body is None and not self.close_connection and method in ("POST", "PUT", "DELETE"):
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

    # -- endpoints --------------------------------------------------------------------------------------------

    def whoami(self):
        if self.authorized():
            self.reply(200, {"name": USER, "type": "user", "orgs": []})

    def create_repo(self):
        if not self.authorized():
            return
        payload = json.loads(self.body())
        repo_id = f"{payload.get('organization') or USER}/{payload['name']}"
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
        if repo is None or not self.authorized():
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
        if self.repo(repo_id) is None or not self.authorized():
            return
        objects = []
        for obj in json.loads(self.body())["objects"]:
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

    def commit(self, repo_id, revision):
        repo = self.repo(repo_id)
        if repo is None or not self.authorized():
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
                files.pop(value["path"], None)
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
        if repo is None or not self.authorized():
            return
        tag = json.loads(self.body())["tag"]
        commit = repo.resolve(revision)
        if tag in repo.tags:
            self.error(409, "Conflict", f"Tag {tag} already exists")
        elif commit is None:
            self.error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        else:
            repo.tags[tag] = commit.oid
            self.reply(200, {})

    def delete_tag(self, repo_id, tag):
        repo = self.repo(repo_id)
        if repo is None or not self.authorized():
            return
        if repo.tags.pop(tag, None) is None:
            self.error(404, "RevisionNotFound", f"Tag {tag} does not exist")
        else:
            self.reply(200, {})

    def validate_yaml(self):
        content = json.loads(self.body())["content"]
        if not content.startswith("---\n"):
            self.reply(400, {"errors": [{"message": "README.md has no YAML metadata"}]})
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
    ],
    "PUT": [(r"/lfs-upload/([0-9a-f]+)", "lfs_upload")],
    "DELETE": [(rf"/api/models/{REPO}/tag/([^/]+)", "delete_tag")],
}
