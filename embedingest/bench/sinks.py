"""Sinks for benchmarks: what a consumer does with a batch decides which side is the bound."""

from __future__ import annotations

import os


class DevNullSink:
    """Hands the slot's bytes to the kernel without copying them (``write`` of a view)."""

    def __init__(self, worker: int):
        self.fd = os.open(os.devnull, os.O_WRONLY)

    def __call__(self, batch_id, arrays):
        for a in arrays.values():
            os.write(self.fd, memoryview(a).cast("B"))

    def close(self):
        os.close(self.fd)


class SeedSink:
    """The seed article's consumer: ``tobytes()`` (a full copy) then a write."""

    def __init__(self, worker: int):
        pass

    def __call__(self, batch_id, arrays):
        with open(os.devnull, "wb") as fh:
            for a in arrays.values():
                fh.write(a.tobytes())


SINKS = {"devnull": DevNullSink, "tobytes": SeedSink}
