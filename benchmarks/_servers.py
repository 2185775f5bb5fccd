"""Local servers the benchmarks measure against (127.0.0.1 only)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

MOTO_PID: int | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_bucket(endpoint: str):
    """A fresh bucket on an S3 endpoint already running (a test's moto_server); yields (root
    URL, storage options), as moto_s3 does."""
    import s3fs

    options = {"endpoint_url": endpoint, "skip_instance_cache": True}
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    yield f"s3://{bucket}/root", options


@contextmanager
def moto_s3():
    """A real S3 endpoint (moto_server) on 127.0.0.1; yields (root URL, storage options)."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        import s3fs

        options = {"endpoint_url": f"http://127.0.0.1:{port}", "skip_instance_cache": True}
        global MOTO_PID
        MOTO_PID = proc.pid  # for benchmarks that place the server on a core
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(**options).mkdir(bucket)
        yield f"s3://{bucket}/root", options
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
