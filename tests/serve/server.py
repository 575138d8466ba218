"""Start ``embedingest serve`` as a user would (a process on a free loopback port) for the
server and browser tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``embedingest serve INDEX`` in a child process; a context manager that waits until
    it answers and stops it with Ctrl-C (SIGINT)."""

    def __init__(self, index: Path, *args: str, timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "embedingest", "serve", str(index), "--port",
                                      str(self.port), *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.timeout = timeout
        self.output = ""

    def __enter__(self) -> Server:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                with urllib.request.urlopen(self.url + "/info", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"serve did not answer within {self.timeout} s: {self.output}")

    def stop(self, twice: bool = False) -> int:
        """Ctrl-C (``twice``: a second one 0.1 s later, as an impatient user presses it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            if twice:
                time.sleep(0.1)
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.output = self.proc.stdout.read()
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()
