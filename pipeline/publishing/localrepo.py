"""A local folder laid out as the Hub repo would be: a git repository with one commit and one tag per version.

``publish=local`` writes here exactly what ``publish=hub`` pushes (``<variant>/<archive>``, ``<variant>/manifest.json``,
``<variant>/metrics.json``, ``README.md``), so the whole publish path, idempotency included, runs on any machine, and
``pull`` reads it back by tag.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from pipeline.core.errors import IntegrityError, PublishError
from pipeline.core.fsutil import CHUNK, link_or_copy, sha256_stream
from pipeline.core.names import repo_path

GIT_IDENTITY = ["-c", "user.name=gemma4-neuron-pipeline", "-c", "user.email=pipeline@localhost",
                "-c", "commit.gpgsign=false", "-c", "tag.gpgsign=false"]


class LocalRepo:
    def __init__(self, path: Path):
        self.path = Path(path)

    def git(self, *args: str, check: bool = True, binary: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run(["git", *GIT_IDENTITY, *args], cwd=self.path, capture_output=True, text=not binary)
        if check and proc.returncode != 0:
            err = proc.stderr if not binary else proc.stderr.decode(errors="replace")
            raise PublishError(f"git {' '.join(args)} failed in {self.path}: {err.strip()}")
        return proc

    def exists(self) -> bool:
        return (self.path / ".git").is_dir()

    def ensure(self) -> None:
        if self.exists():
            return
        if self.path.exists() and any(self.path.iterdir()):
            raise PublishError(f"publish.local_dir {self.path} exists and is not a publish repository: "
                               "choose an empty or new directory")
        self.path.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "main")
        self.git("commit", "-q", "--allow-empty", "-m", "Initial commit")

    def head(self) -> str:
        return self.git("rev-parse", "HEAD").stdout.strip()

    def tag_commit(self, tag: str) -> str | None:
        proc = self.git("rev-parse", "-q", "--verify", f"refs/tags/{tag}^{{commit}}", check=False)
        return proc.stdout.strip() or None

    def tags(self) -> dict[str, str]:
        out = self.git("for-each-ref", "--format=%(refname:short) %(objectname)", "refs/tags").stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if line.strip())

    def read(self, revision: str, path: str) -> bytes | None:
        proc = self.git("show", f"{revision}:{path}", check=False, binary=True)
        return proc.stdout if proc.returncode == 0 else None

    def list_files(self, revision: str) -> list[str]:
        return self.git("ls-tree", "-r", "--name-only", revision).stdout.splitlines()

    def commit(self, files: dict[str, Path | bytes], deletions: list[str], message: str, parent: str) -> str:
        """Write ``files`` (repo path -> source file or bytes), remove ``deletions``, and commit it all as one commit
        on top of ``parent``. Returns the new head (the old one when nothing changed: no empty commit)."""
        self.git("checkout", "-q", "main")
        if self.head() != parent:
            raise PublishError(f"{self.path} moved from {parent[:12]} while preparing the commit")
        for rel in deletions:
            self.git("rm", "-q", "--", rel)
        for rel, source in files.items():
            target = self.path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(source, bytes):
                target.write_bytes(source)
            else:
                link_or_copy(source, target)
            # Stored, not deflated: an archive is zstd already, and zlib's default level gained nothing on a 2.8 GB
            # one (2.7 GB in .git either way) but ran at 35 MB/s: 80 s, and 21 s stored (git streams a file over
            # core.bigFileThreshold into a pack at core.compression).
            self.git("-c", "core.compression=0", "add", "--", rel)
        if not self.git("status", "--porcelain").stdout.strip():
            return self.head()
        self.git("commit", "-q", "-m", message)
        return self.head()

    def tag(self, name: str, commit: str, replace: bool = False) -> None:
        self.git("tag", *(["-f"] if replace else []), name, commit)

    def file_digest(self, revision: str, path: str) -> tuple[int, str] | None:
        """``(size, sha256)`` of one file of ``revision``, hashed as git streams it (None: no such file)."""
        repo_path(path, "a file of the repository")
        with subprocess.Popen(["git", "cat-file", "blob", f"{revision}:{path}"], cwd=self.path,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
            found = sha256_stream(proc.stdout)
        return found if proc.returncode == 0 else None

    def checkout_file(self, revision: str, path: str, dest: Path, max_bytes: int | None = None) -> None:
        """Stream one file of ``revision`` to ``dest``, a new file (archives can be many GB: never held in memory);
        one larger than ``max_bytes`` is refused before a byte is copied.

        ``dest`` is created here, exclusively: an existing file is never opened, truncated or removed, whatever a
        repository's names say, and only the file this call created is removed when the copy fails."""
        repo_path(path, "a file of the repository")
        if max_bytes is not None:
            size = self.git("cat-file", "-s", f"{revision}:{path}", check=False).stdout.strip()
            if size.isdigit() and int(size) > max_bytes:
                raise IntegrityError(f"{path} at {revision[:12]} is {size} bytes, more than the {max_bytes} a file "
                                     "of its kind may have: refusing to download it")
        out = open(dest, "xb")  # noqa: SIM115 - closed below, and removed only if it is ours
        # Copied through this process, so a full disk raises an OSError here (git would only exit non-zero).
        try:
            with out, subprocess.Popen(["git", "cat-file", "blob", f"{revision}:{path}"], cwd=self.path,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
                try:
                    shutil.copyfileobj(proc.stdout, out, CHUNK)
                except BaseException:
                    proc.kill()
                    raise
                error = proc.stderr.read().decode().strip()
            if proc.returncode != 0:
                raise PublishError(f"{path} is not in {self.path} at {revision}: {error}")
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
