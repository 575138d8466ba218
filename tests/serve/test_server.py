"""``embedingest serve`` as a real process on uvicorn: it answers, binds the loopback
address only, turns away a 10 MB query with a 4xx and stops on Ctrl-C."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("uvicorn")

from server import Server  # noqa: E402
from test_app import make_corpus  # noqa: E402

from embedingest import build_index  # noqa: E402


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("srv")
    build_index(make_corpus(root / "corpus"), out=str(root / "idx"), num_workers=0, num_consumers=1,
                batch_size=8, search_k=2)
    return root / "idx"


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


def raw_get(port: int, target: bytes, timeout: float = 30.0) -> bytes:
    """Send one GET with ``target`` as is (the server may hang up while it is sent) and
    return the start of the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
    return reply


def test_serve_answers_and_refuses_on_loopback(index):
    with Server(index) as server:
        assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, nothing else
        q = urllib.parse.urlencode({"q": "how do whales breathe"})
        with urllib.request.urlopen(f"{server.url}/search?{q}", timeout=30) as r:
            data = json.loads(r.read())
        assert len(data["hits"]) == 2 and data["hits"][0]["source"] == "whales.txt"  # the stored k
        t0 = time.monotonic()
        reply = raw_get(server.port, b"/search?q=" + b"x" * 10_000_000)
        status = int(reply.split(b" ", 2)[1])
        assert 400 <= status < 500 and time.monotonic() - t0 < 30
        reply = raw_get(server.port, b"/search?q=" + b"y" * 3000)  # under the request-line limit
        assert reply.startswith(b"HTTP/1.1 422") and b"3,000 characters" in reply
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(f"{server.url}/search?q=x", method="POST"), timeout=30)
        assert err.value.code == 405
        with urllib.request.urlopen(f"{server.url}/search?{q}", timeout=30) as r:  # still serving
            assert r.status == 200
        assert server.stop() == 0, server.output
