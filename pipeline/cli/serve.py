"""``python -m pipeline serve SOURCE [VERSION] --checkpoint DIR``: serve a published version over HTTP.

SOURCE is what ``pull`` takes (a local publish folder or a Hugging Face repo id, with VERSION a published version or a
variant's name, its newest version that fits this host), or a directory ``pull`` printed (VERSION may then be left
out); a version this host cannot run is refused before anything loads (pipeline/backends/compatibility.py). The
version is pulled and verified exactly as ``pull`` does it (signature, archive and every rank file's sha256; a version
already in the cache is used with nothing downloaded, ``--offline`` without asking the source), and a pulled
directory's rank files are checked against the manifest beside it again: by pull's record of them where they are
unchanged since they were hashed and no other user could have changed them (pipeline/artifact/pulled.py), else, or with
``--verify-full``, by hashing them. With ``--public-key`` a directory's manifest must verify with the signature beside
it first, as ``pull --offline`` checks it (an unsigned one is refused). The port is
taken first, so a port in use is named before any work. The server then listens at once and loads the build in the
background: ``GET /health`` answers 503 ``loading`` until the build is loaded and a warm-up token decoded, then 200
``ready``.

Routes (pipeline/serving/routes.py): ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (the
version is the model id), ``POST /generate`` (``{"prompt": ..., "max_tokens": ...}``), ``GET /health`` and
``GET /metrics``. The build's ``batch_size`` sequences decode at once (a request's ``n`` choices and prompts are a
sequence each); up to ``--queue-size`` requests wait for a free one beyond those, each up to ``--queue-timeout``
seconds.
A request body larger than ``--max-request-bytes`` (default 1 MiB) gets 413 before it is read, one slower than
``--body-timeout`` 408; at most ``--max-connections`` are open at once (past it the oldest idle one is closed), and
one whose headers take longer than ``--header-timeout`` is closed (pipeline/serving/connections.py). SIGTERM or
Ctrl-C: the requests decoding finish, the waiting ones and any new one get 503, and the command exits 0; a request
still running ``--shutdown-grace`` seconds later (a long answer, or a client that stopped reading its stream) is
cancelled and its connection closed.

    python -m pipeline serve your-org/gemma-4-E4B-it-inferentia2 2048_bf16 --checkpoint /data/gemma-4-E4B-it \\
        --dest /workspace --public-key signing-key.pub.pem --port 8000
    python -m pipeline serve /workspace/gemma4_e4b-2048_bf16-ncc2.23.6484.0-1f0c9a7e --checkpoint /data/gemma-4-E4B-it
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import socket
import sys
import threading
from pathlib import Path

from pipeline.artifact import signing
from pipeline.artifact.manifest import Manifest, manifest_of
from pipeline.cli import add_decode_threads, plain
from pipeline.cli.pull import add_source_flags, host_toolchain, judged, pull, source_for
from pipeline.core.cache import versions_dir
from pipeline.core.errors import InputError, IntegrityError, PipelineError
from pipeline.core.log import exit_on_error, log, setup
from pipeline.models.tiny_model import MEANINGLESS, is_tiny

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # a prompt that fills a 2048-token cache is about 10 KB of text
DEFAULT_MAX_CONNECTIONS = 256  # batch_size decode and --queue-size wait: the rest are health probes and idlers
DEFAULT_HEADER_TIMEOUT_S = 10.0  # a client sends its headers in one write; 10 s is ample on any network
DEFAULT_BODY_TIMEOUT_S = 30.0  # 1 MiB (--max-request-bytes) at 35 KB/s
# Under Kubernetes' default terminationGracePeriodSeconds (30), after which the pod is killed with no clean exit.
DEFAULT_SHUTDOWN_GRACE_S = 25.0


def take_port(host: str, port: int):
    """The listening socket, before any work: a port in use is refused by name."""
    from pipeline.serving.connections import Listener

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = Listener(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may bind while old connections linger
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise InputError(f"--port {port}: {host}:{port} is in use (another server?); stop it or choose another "
                             "port with --port") from None
        raise InputError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None
    sock.listen(128)
    return sock


def is_rank_dir(source: str) -> bool:
    """A directory that is no publish folder (a git repository): a directory ``pull`` printed, or a build folder
    (``manifest_of`` says what is wrong with any other)."""
    path = Path(source)
    return path.is_dir() and not (path / ".git").exists()


def obtain(args: argparse.Namespace) -> tuple[Path, Manifest | None]:
    """The verified rank directory to serve; for a directory given (not pulled here), also the manifest it was checked
    with, which the engine must read the same (a manifest changed after its signature was checked is refused)."""
    problem = signing.key_problem(args.public_key, "public", "--public-key") if args.public_key else None
    if problem:
        raise PipelineError(problem)
    if is_rank_dir(args.source):
        rank_dir = Path(args.source).resolve()
        manifest = (signing.verified_manifest(manifest_of(rank_dir), args.public_key) if args.public_key
                    else Manifest.read(manifest_of(rank_dir)))
        version = manifest.version
        judged(manifest, host_toolchain())  # it loads here: a version this host cannot run is refused first
        if args.version and args.version != version:
            raise InputError(f"{rank_dir} holds {version!r}, not {args.version!r}: leave VERSION out, or pull "
                             f"{args.version!r}")
        return rank_dir, manifest  # its rank files are checked against it again before loading (Engine.verify)
    if not args.version:
        raise InputError(f"{args.source} is a publish folder or a Hub repo: give the VERSION (or a variant's name) to "
                         "serve; a directory pull printed needs none")
    dest = (args.dest or versions_dir()).resolve()
    source = None if args.offline else source_for(args.source)
    return pull(source, args.version, dest, args.public_key, args.allow_unsigned, host_toolchain(), args.verify_full,
                allow_older=args.allow_older, allow_expired=args.allow_expired), None


def quiet_logs() -> None:
    """A refused accept or a broken client logged once per 10 s, not each time; a request cancelled at the end of the
    shutdown grace in one line, not a traceback."""
    from pipeline.serving.connections import CancelledQuietly, OncePer

    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(OncePer())
    logging.getLogger("uvicorn.error").addFilter(CancelledQuietly())


def run_server(service, sock, limits: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; the build loads in the decode thread meanwhile, which then runs the decode
    loop. 0, or 1 when the load failed (the server stops at once: a server that will never be ready must not look
    alive)."""
    import uvicorn

    from pipeline.serving.connections import bounded_protocol
    from pipeline.serving.routes import create_app

    failed = threading.Event()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.loop is not None:
                self.loop.call_soon_threadsafe(service.close)  # waiting and new requests: 503 from now on
            super().handle_exit(sig, frame)
            # uvicorn raises a caught signal again once it has shut down; the shutdown was complete and clean, so
            # the command exits 0 instead of dying of the signal (and the build's ranks are closed first).
            getattr(self, "_captured_signals", []).clear()

    protocol = bounded_protocol(sock, limits.max_connections, limits.header_timeout_s)
    quiet_logs()
    # Past the grace uvicorn cancels the requests' tasks: each cancels its sequences (service.py), and the server
    # exits. Without one it waited forever for a client that stopped reading its stream.
    config = uvicorn.Config(create_app(service), log_config=None, timeout_graceful_shutdown=limits.shutdown_grace_s,
                            http=protocol)
    server = Server(config)
    server.loop = None

    def load() -> None:
        try:
            service.engine.load()
            service.tokenizing.submit(service.engine.text_ids, "Hi").result()  # its thread's first call, not a client's
            # What is loaded now lives as long as the server: keep it out of the collector's full passes, which
            # otherwise walk the tokenizer's and the libraries' objects while a request (or /health) waits.
            gc.freeze()
            for name, size in service.engine.host_bytes.items():
                log.info("serve: host memory: %s %.2f GiB", name.replace("_", " "), size / 2**30)
            server.loop.call_soon_threadsafe(service.ready)
        except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
            service.state, service.problem = "failed", str(exc)
            log.error("serve: loading %s failed: %s", service.engine.version, exc)
            failed.set()
            server.should_exit = True
            return
        service.decode_loop()

    async def main() -> None:
        server.loop = asyncio.get_running_loop()
        service.open()
        # In the decode thread, which lives as long as the server: a backend's rank processes end with the thread
        # that started them (procinfo.die_with_parent), so a loader thread of its own would take them along.
        service.worker.submit(load)
        await server.serve(sockets=[sock])

    try:
        asyncio.run(main())
    finally:
        service.shutdown()
    return 1 if failed.is_set() else 0


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline serve", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a local publish folder, a Hugging Face repo id, or a directory pull printed")
    parser.add_argument("version", nargs="?", help="a published version, or a variant's name for its newest (not "
                                                   "needed for a pulled directory)")
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="the original checkpoint (tokenizer, config, embedding tables)")
    add_source_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--queue-size", type=int, default=8, help="requests that may wait for a free sequence "
                                                                 "beyond those decoding; past it: 429")
    parser.add_argument("--queue-timeout", type=float, default=60.0, help="seconds a request may wait; past it: 503")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"the largest request body taken; past it: 413 (default {DEFAULT_MAX_REQUEST_BYTES}, "
                             "1 MiB)")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="connections held open at once; past it, the oldest with no request in progress is "
                             f"closed (default {DEFAULT_MAX_CONNECTIONS}; kept under ulimit -n)")
    parser.add_argument("--header-timeout", dest="header_timeout_s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="seconds a request's headers may take to arrive; past it the connection is closed "
                             f"(default {DEFAULT_HEADER_TIMEOUT_S:g})")
    parser.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help=f"seconds a request's body may take to arrive; past it: 408 (default "
                             f"{DEFAULT_BODY_TIMEOUT_S:g})")
    parser.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                        help="seconds the running requests may take to finish after SIGTERM; past it they are "
                             f"cancelled and the server exits (default {DEFAULT_SHUTDOWN_GRACE_S:g}, under "
                             "Kubernetes' 30 s kill)")
    parser.add_argument("--served-model-name", dest="served_names", nargs="+", default=[], metavar="NAME",
                        help="names requests may give as model, listed first by /v1/models (vLLM's option); the "
                             "version is always accepted too")
    parser.add_argument("--text-prefix", help="override the decoder's tensor prefix in the checkpoint")
    add_decode_threads(parser)
    return parser


def main(argv: list[str]) -> int:
    args = arguments().parse_args(argv)
    setup()
    with exit_on_error():
        if args.queue_size < 0 or args.queue_timeout <= 0:
            raise InputError(f"--queue-size {args.queue_size} --queue-timeout {args.queue_timeout}: the queue size "
                             "is 0 or more and the timeout more than 0 seconds")
        if args.max_connections < 8 or not all(t > 0 for t in (args.header_timeout_s, args.body_timeout,
                                                            args.shutdown_grace_s)):  # nan too
            raise InputError(f"--max-connections {args.max_connections} --header-timeout {args.header_timeout_s:g} "
                             f"--body-timeout {args.body_timeout:g} --shutdown-grace {args.shutdown_grace_s:g}: allow "
                             "at least 8 connections (health probes and the queue need room) and times of more than "
                             "0 seconds")
        if any(not name.strip() for name in args.served_names):
            raise InputError("--served-model-name: a name needs at least one character other than spaces")
        if args.max_request_bytes < 1024:
            raise InputError(f"--max-request-bytes {args.max_request_bytes}: give at least 1024 (a chat request's "
                             "JSON alone is a few hundred bytes)")
        from pipeline.serving.engine import Engine
        from pipeline.serving.service import Service

        sock = take_port(args.host, args.port)
        try:
            rank_dir, checked = obtain(args)
            engine = Engine(rank_dir, args.checkpoint.resolve(), args.text_prefix, args.decode_threads)
            if checked is not None and engine.manifest != checked:  # the engine reads the manifest file again
                raise IntegrityError(f"{manifest_of(rank_dir)} changed after it was checked: refusing to serve it")
            how = engine.verify(args.verify_full and is_rank_dir(args.source))  # pull has just hashed the others
            log.info("serve: %s verified (rank files checked %s); listening on http://%s:%d while it loads",
                     engine.version, how, args.host, sock.getsockname()[1])
            if is_tiny(args.checkpoint):
                log.warning("serve: %s", MEANINGLESS)
            service = Service(engine, args.queue_size, args.queue_timeout, args.max_request_bytes, args.body_timeout,
                              tuple(args.served_names))
            return run_server(service, sock, args)
        finally:
            sock.close()
    return 1  # pragma: no cover - exit_on_error exits


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
