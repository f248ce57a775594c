"""A local S3 endpoint for the tests: moto's server on a loopback port, as strict about credentials as S3.

DVC's own test suite runs its S3 tests against ``moto_server`` (dvc-s3's tests). By default moto accepts any
credentials; S3 refuses an unknown key id (403 InvalidAccessKeyId) and a wrong secret (403 SignatureDoesNotMatch).
moto enforces that too once ``INITIAL_NO_AUTH_ACTION_COUNT`` requests have been served (moto/core/authorization.py):
the first requests, made here with throwaway credentials, create an IAM user allowed every S3 action, its access
key, and the bucket; every later request must be signed with that key. A bucket that does not exist answers 404
NoSuchBucket, as S3 does.

``SlowProxy`` forwards HTTP to the endpoint and holds each PUT for a while, so a test can interrupt ``dvc push``
(``-j 1``) with some objects stored and others not. It forwards every header unchanged (the Host header is part of
the SigV4 signature the endpoint checks).

Run by hand: ``python -m tests.s3_endpoint`` starts one and prints the settings to export; Ctrl-C stops it.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BUCKET = "gemma4-builds"
SETUP_REQUESTS = 4  # create the user, its access key, its policy, the bucket: then credentials are checked
ALLOW_S3 = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def moto_server() -> str | None:
    found = Path(sys.executable).parent / "moto_server"
    return str(found) if found.exists() else shutil.which("moto_server")


class Endpoint:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.key_id = self.secret = ""

    def start(self) -> Endpoint:
        import boto3

        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_REQUESTS)}
        self.proc = subprocess.Popen([moto_server(), "-H", "127.0.0.1", "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {self.port}") from None
                time.sleep(0.1)
        setup = {"endpoint_url": self.url, "region_name": "us-east-1", "aws_access_key_id": "setup",
                 "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="builder")
        key = iam.create_access_key(UserName="builder")["AccessKey"]
        iam.put_user_policy(UserName="builder", PolicyName="s3", PolicyDocument=json.dumps(ALLOW_S3))
        boto3.client("s3", **setup).create_bucket(Bucket=BUCKET)
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def env(self) -> dict[str, str]:
        """The usual AWS variables, as a host's job would have them."""
        return {"AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id=self.key_id,
                            aws_secret_access_key=self.secret)

    def keys(self, bucket: str = BUCKET, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def buckets(self) -> list[str]:
        return sorted(b["Name"] for b in self.client().list_buckets()["Buckets"])


class SlowProxy:
    """HTTP to ``target``, each PUT held ``put_delay_s`` before it is forwarded (0: a plain proxy)."""

    def __init__(self, target_port: int, put_delay_s: float):
        self.put_delay_s = put_delay_s
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if self.headers.get("Transfer-Encoding"):
                    raise RuntimeError("SlowProxy forwards Content-Length bodies only")
                body = self.rfile.read(length) if length else None
                if self.command == "PUT":
                    time.sleep(proxy.put_delay_s)
                upstream = http.client.HTTPConnection("127.0.0.1", target_port, timeout=120)
                upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    upstream.putheader(name, value)
                upstream.endheaders(body)
                answer = upstream.getresponse()
                data = answer.read()
                self.send_response_only(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the server, as Ctrl-C does
    endpoint = Endpoint().start()
    print(f"export AWS_ACCESS_KEY_ID={endpoint.key_id} AWS_SECRET_ACCESS_KEY={endpoint.secret} "
          f"AWS_DEFAULT_REGION=us-east-1  # endpoint {endpoint.url}, bucket {BUCKET}")
    try:
        endpoint.proc.wait()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        endpoint.stop()
