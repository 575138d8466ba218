"""Sinks used by the engine tests; a module of its own so consumer processes can import them."""

from __future__ import annotations

import errno
import hashlib
import os
import time


def digest(arrays) -> dict:
    return {k: (a.shape, str(a.dtype), hashlib.sha256(a.tobytes()).hexdigest()) for k, a in arrays.items()}


class HashSink:
    """Returns a digest of every array; worker-dependent delays make slow and fast consumers."""

    def __init__(self, worker: int, delays=(0.0,)):
        self.worker = worker
        self.delay = delays[worker % len(delays)]
        self.count = 0

    def __call__(self, batch_id, arrays):
        if self.delay:
            time.sleep(self.delay)
        self.count += 1
        return (self.worker, digest(arrays))

    def close(self):
        return {"worker": self.worker, "count": self.count}


class HashSinkFactory:
    def __init__(self, delays=(0.0,)):
        self.delays = tuple(delays)

    def __call__(self, worker: int):
        return HashSink(worker, self.delays)


class FailingSink:
    """Raises on one batch id, like a sink that hits a full disk."""

    def __init__(self, worker: int, bad: int):
        self.bad = bad

    def __call__(self, batch_id, arrays):
        if batch_id == self.bad:
            raise OSError(errno.ENOSPC, f"No space left on device while writing batch {batch_id}")


class FailingSinkFactory:
    def __init__(self, bad: int):
        self.bad = bad

    def __call__(self, worker: int):
        return FailingSink(worker, self.bad)


class SuicideSinkFactory:
    """The consumer that receives batch ``bad`` kills itself with SIGKILL."""

    def __init__(self, bad: int):
        self.bad = bad

    def __call__(self, worker: int):
        bad = self.bad

        def sink(batch_id, arrays):
            if batch_id == bad:
                os.kill(os.getpid(), 9)
            time.sleep(0.01)

        return sink


def broken_factory(worker: int):
    raise ValueError(f"cannot open the output store for worker {worker}")


class SleepySinkFactory:
    """Sinks that take ``seconds`` per batch."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, worker: int):
        def sink(batch_id, arrays):
            time.sleep(self.seconds)

        return sink


def slow_sink_factory(worker: int):
    def sink(batch_id, arrays):
        time.sleep(0.05)

    return sink


class RecordingSink:
    """Keeps every batch id with its arrays as lists; ``close`` returns them."""

    def __init__(self, worker: int):
        self.seen = []

    def __call__(self, batch_id, arrays):
        self.seen.append((batch_id, {k: a.tolist() for k, a in arrays.items()}))

    def close(self):
        return self.seen


def recording_sink_factory(worker: int):
    return RecordingSink(worker)


class StartupSignalSinkFactory:
    """Records how the consumer process treats SIGINT while it is still starting: it is
    unpickled with the consumer's other arguments, before any code of the consumer runs."""

    def __init__(self):
        self.sigint_at_startup = "not unpickled"  # some state, so pickle calls __setstate__

    def __setstate__(self, state):
        import signal

        self.__dict__.update(state)
        held = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())  # held until it ignores it
        self.sigint_at_startup = ("ignored" if signal.getsignal(signal.SIGINT) == signal.SIG_IGN or held
                                  else "handled")

    def __call__(self, worker: int):
        return StartupSignalSink(self.sigint_at_startup)


class StartupSignalSink:
    def __init__(self, seen: str):
        self.seen = seen

    def __call__(self, batch_id, arrays):
        return None

    def close(self):
        return self.seen


class SlowCloseSink:
    """Counts its batches; ``close`` says where it is (its pid in ``<marker>.closing``),
    then takes ``seconds`` before it returns, like the last commit of a large shard. With
    ``hold`` the first batch takes the ``seconds`` instead, and ``close`` none."""

    def __init__(self, worker: int, seconds: float, marker: str, hold: bool):
        self.worker, self.seconds, self.marker, self.hold = worker, seconds, marker, hold
        self.count = 0

    def __call__(self, batch_id, arrays):
        if self.hold:  # the first batch waits here (its pid in <marker>.holding) until stopped
            _say(f"{self.marker}.holding")
            time.sleep(self.seconds)
        self.count += 1
        return None

    def close(self):
        _say(f"{self.marker}.closing")
        if not self.hold:
            time.sleep(self.seconds)
        return {"worker": self.worker, "count": self.count}


def _say(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


class SlowCloseSinkFactory:
    def __init__(self, seconds: float, marker: str, hold: bool = False):
        self.seconds, self.marker, self.hold = seconds, marker, hold

    def __call__(self, worker: int):
        seconds = self.seconds[worker] if isinstance(self.seconds, tuple) else self.seconds
        return SlowCloseSink(worker, seconds, f"{self.marker}{worker}", self.hold)


class ListSink:
    """Keeps what it was given (batch id, arrays copied); fails on ``bad`` batch ids; its
    close returns the list, or raises when ``close_fails``."""

    def __init__(self, worker: int, bad=(), close_fails: bool = False):
        self.worker, self.bad, self.close_fails = worker, tuple(bad), close_fails
        self.seen = []

    def __call__(self, batch_id, arrays):
        if batch_id in self.bad:
            raise ValueError(f"bad batch {batch_id}")
        self.seen.append((batch_id, {k: v.copy() for k, v in arrays.items()}))
        return f"w{self.worker}:{batch_id}"

    def close(self):
        if self.close_fails:
            raise OSError(28, "No space left on device")
        return [b for b, _ in self.seen]


class ListSinkFactory:
    def __init__(self, bad=(), close_fails: bool = False, factory_fails: bool = False):
        self.bad, self.close_fails, self.factory_fails = tuple(bad), close_fails, factory_fails

    def __call__(self, worker: int):
        if self.factory_fails:
            raise PermissionError(13, "cannot open the shard folder")
        return ListSink(worker, self.bad, self.close_fails)


def whoami_sink_factory(worker: int):
    """Answers each batch with its process's multiprocessing name and daemon flag."""
    import multiprocessing

    def sink(batch_id, arrays):
        me = multiprocessing.current_process()
        return (me.name, me.daemon)

    return sink


class PicklesOnce:
    """A sink factory that can be pickled once only (``count`` pickles are allowed): the
    first consumer starts, the next cannot."""

    allowed = 1

    def __reduce__(self):
        if PicklesOnce.allowed <= 0:
            raise TypeError("cannot pickle this factory twice")
        PicklesOnce.allowed -= 1
        return (HashSinkFactory, ())


class TwoPartError(Exception):
    """An error that pickles but does not unpickle (its ``args`` hold one message, its
    ``__init__`` wants two), like many libraries' own."""

    def __init__(self, what: str, where: str):
        super().__init__(f"{what} at {where}")


def two_part_error_sink_factory(worker: int):
    def sink(batch_id, arrays):
        raise TwoPartError("disk gone", f"batch {batch_id}")

    return sink


class GateSink:
    """Batch 0 waits in the sink until ``<marker>.go`` exists (its pid in
    ``<marker>.holding`` meanwhile); returns each batch id; ``close`` counts them."""

    def __init__(self, worker: int, marker: str):
        self.worker, self.marker, self.count = worker, marker, 0

    def __call__(self, batch_id, arrays):
        if batch_id == 0:
            _say(f"{self.marker}.holding")
            deadline = time.monotonic() + 120
            while not os.path.exists(f"{self.marker}.go") and time.monotonic() < deadline:
                time.sleep(0.01)
        self.count += 1
        return batch_id

    def close(self):
        return {"worker": self.worker, "count": self.count}


class GateSinkFactory:
    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self, worker: int):
        return GateSink(worker, self.marker)


class _UnpicklableClose:
    """A sink whose close() returns what cannot be pickled (a lock)."""

    def __call__(self, batch_id, arrays):
        return None

    def close(self):
        import threading

        return threading.Lock()


def unpicklable_close_factory(worker: int):
    return _UnpicklableClose()


class ExitingSink:
    """Raises ``what`` (``SystemExit(0)``, ``KeyboardInterrupt()``) on batch 1."""

    def __init__(self, worker: int, what: BaseException):
        self.what = what

    def __call__(self, batch_id, arrays):
        if batch_id == 1:
            raise self.what


class ExitingSinkFactory:
    def __init__(self, what: BaseException):
        self.what = what

    def __call__(self, worker: int):
        return ExitingSink(worker, self.what)
