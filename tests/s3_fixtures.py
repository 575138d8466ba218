"""An S3-compatible server (moto's standalone server) on 127.0.0.1 for the tests of
inputs in object storage, and a fresh bucket for each test.

The server is a process of its own, started once per session; the tests reach it only
through the environment variables boto reads (``AWS_ENDPOINT_URL_S3``, the keys), as a
user's run would, so nothing in the package is told about it.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

_BUCKETS = itertools.count()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """The server's URL; the server stops with the session."""
    pytest.importorskip("s3fs", reason="s3:// needs s3fs: pip install -e '.[remote]'")
    pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (the test extra)")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not start on {url}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_environment(endpoint: str, home: Path) -> dict[str, str]:
    """What a user's shell would hold to reach the server: its endpoint and keys, a home
    without ~/.aws, and no instance-metadata look-up (which waits seconds off EC2)."""
    return {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(home / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "aws-credentials")}


class Bucket:
    """A fresh bucket: ``put`` objects, ``url`` of a key, ``upload`` a local folder."""

    def __init__(self, fs, name: str):
        self.fs, self.name = fs, name

    def url(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}" if key else f"s3://{self.name}"

    def put(self, key: str, data: bytes) -> str:
        self.fs.pipe_file(f"{self.name}/{key}", data)
        return self.url(key)

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file below ``folder`` (hidden ones too) under ``prefix``; its URL."""
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
        return self.url(prefix)


@pytest.fixture
def s3(s3_endpoint, monkeypatch, tmp_path_factory) -> Bucket:
    """A new bucket on the session's server, with the environment set to reach it."""
    import s3fs

    for key, value in s3_environment(s3_endpoint, tmp_path_factory.mktemp("home")).items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()  # made under another environment, maybe
    fs = s3fs.S3FileSystem()
    name = f"bucket-{os.getpid()}-{next(_BUCKETS)}"
    fs.mkdir(name)
    yield Bucket(fs, name)
    s3fs.S3FileSystem.clear_instance_cache()
