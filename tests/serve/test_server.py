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

import numpy as np
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


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The servers' cache folder (the query encoder's ONNX graph), not the user's."""
    return tmp_path_factory.mktemp("cache")


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


def test_serve_answers_and_refuses_on_loopback(index, cache):
    with Server(index, "--cache-dir", str(cache)) as server:
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
        # Ctrl-C twice: it stops without uvicorn's traceback of its lifespan task (there was one)
        assert server.stop(twice=True) == 0, server.output
        assert "Traceback" not in server.output and server.output.rstrip().endswith("stopped"), server.output


def search(server: Server, q: str, k: int = 3) -> list[dict]:
    with urllib.request.urlopen(f"{server.url}/search?{urllib.parse.urlencode({'q': q, 'k': k})}",
                                timeout=60) as r:
        return json.loads(r.read())["hits"]


def info(server: Server) -> dict:
    with urllib.request.urlopen(f"{server.url}/info", timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_default_runtime_is_onnx_with_torch_results(index, cache):
    """serve encodes with ONNX Runtime by default (the graph exported into --cache-dir),
    and answers what the torch runtime answers."""
    pytest.importorskip("onnxruntime")
    with Server(index, "--cache-dir", str(cache)) as fast, Server(index, "--query-runtime", "torch") as plain:
        assert (info(fast)["query_runtime"], info(plain)["query_runtime"]) == ("onnx", "torch")
        assert [p.suffix for p in (cache / "onnx").iterdir()] == [".onnx"]
        for q in ("how do whales breathe", "bread", "reliable byte streams", "the tallest mountain"):
            got, want = search(fast, q), search(plain, q)
            assert [h["id"] for h in got] == [h["id"] for h in want]
            np.testing.assert_allclose([h["score"] for h in got], [h["score"] for h in want], atol=1e-5)
        assert fast.stop() == 0 and plain.stop() == 0, fast.output + plain.output


def test_a_port_in_use_is_one_error_line_before_anything_says_serving(index, cache):
    """The port is bound before "serving ... at URL" is printed: a port in use was
    announced as served, then uvicorn's own error and exit code 3 (the code of a run that
    skipped inputs). --port 0 takes a free port, and the URL printed is the one bound."""
    import subprocess
    import sys

    from server import REPO

    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "embedingest", "serve", str(index), "--port", str(port),
                              "--cache-dir", str(cache)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "serving" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"Error: cannot listen on 127.0.0.1:{port}: Address already in use; choose another --port "
        "(0 picks a free one) or stop what uses it")

    proc = subprocess.Popen([sys.executable, "-m", "embedingest", "serve", str(index), "--port", "0",
                             "--cache-dir", str(cache)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert line.startswith(f"serving {index} at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0].rstrip("/")
        assert not url.endswith(":0")
        with urllib.request.urlopen(url + "/info", timeout=30) as r:
            assert json.loads(r.read())["vectors"] > 0
    finally:
        proc.send_signal(__import__("signal").SIGINT)
        proc.wait(30)


def test_serve_in_the_caller_s_process_gives_torch_its_threads_back(index, cache):
    """serve(threads=1) left torch on one thread for the rest of the process, also when it
    failed (a port in use): a notebook's later torch work ran on one core."""
    import torch

    from embedingest.errors import ConfigError
    from embedingest.serve import serve

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            with pytest.raises(ConfigError, match="Address already in use"):
                serve(index, port=taken.getsockname()[1], threads=1, cache_dir=cache)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
