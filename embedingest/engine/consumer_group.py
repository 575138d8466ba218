"""The consumer processes of one engine: started with the pool's handle, each batch handed
to the least busy one, their answers collected by a thread, a death noticed at once, and
stopped within a deadline.

Pipes and a lock-free shared flag only: no named semaphores, so nothing is ever created
in /dev/shm, whatever way the run ends.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from ..errors import EngineError
from ..interrupts import children_ignore_sigint
from .consumers import consumer_process
from .lean_spawn import needs_main, spawning_without_main
from .messages import Closed, Done, Skipped, Task
from .pool import PoolHandle


log = logging.getLogger("embedingest")

_CLOSE_NOTE = 30.0  # seconds between two "waiting for consumer N" lines at a run's end
_START_FAILED_STOP = 5.0  # seconds the consumers started before one that could not start get


class ConsumerGroup:
    """``num_consumers`` processes running ``consumer_main`` (through ``consumer_process``) on one pool.

    ``on_message(msg)`` gets every answer (in the collector thread); ``on_death(worker,
    process, seq, exitcode)`` is called when a consumer ends without having closed its sink, or
    with batches it never ran (stopped by someone else's SIGTERM), with the oldest batch it
    held (-1 when idle). ``imports_main``: whether the consumers import the parent's main
    script (only where the sink factory needs it: :mod:`.lean_spawn`).
    """

    def __init__(self, sink_factory, num_consumers: int, handle: PoolHandle,
                 on_message: Callable, on_death: Callable):
        self._on_message = on_message
        self._on_death = on_death
        ctx = mp.get_context("spawn")
        self.abort = ctx.RawArray("b", 1)  # set: consumers hand slots back unused
        self.procs: list = []
        self._conns: list = []
        self._closed_ok = [False] * num_consumers
        self._outstanding: list[list[int]] = [[] for _ in range(num_consumers)]
        self._next = 0
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()
        self._collector: threading.Thread | None = None
        self.imports_main = needs_main(sink_factory)
        for w in range(num_consumers):
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=consumer_process, name=f"embedingest-consumer-{w}", daemon=True,
                            args=(w, sink_factory, handle, theirs, self.abort, os.getpid()))
            try:
                with children_ignore_sigint(), spawning_without_main(not self.imports_main):
                    p.start()
            except Exception as exc:
                mine.close()
                self.stop(_START_FAILED_STOP)  # those started before it
                self.close()
                raise EngineError(f"cannot start consumer {w}: {exc}; the sink factory must "
                                  "be picklable (a top-level function or class)") from exc
            finally:
                theirs.close()
            self.procs.append(p)
            self._conns.append(mine)
        self._collector = threading.Thread(target=self._collect_loop, name="embedingest-collector",
                                           daemon=True)
        self._collector.start()

    def dispatch(self, task: Task) -> None:
        """Send ``task`` to the consumer with the fewest batches outstanding."""
        with self._lock:
            w = self._pick()
            self._outstanding[w].append(task.seq)
        try:
            self._conns[w].send(task)
        except OSError:
            self._died(w, self.procs[w], self.exitcode(self.procs[w], 1.0))

    def _pick(self) -> int:
        """The consumer with the fewest batches outstanding, in turn among equals."""
        n = len(self._conns)
        order = [(self._next + i) % n for i in range(n)]
        w = min(order, key=lambda i: len(self._outstanding[i]))
        self._next = (w + 1) % n
        return w

    def _collect_loop(self) -> None:
        """Take answers and notice consumers that die."""
        alive = dict(enumerate(self.procs))
        conns = dict(enumerate(self._conns))
        while alive:
            by_obj = {c: w for w, c in conns.items()}
            by_obj.update({p.sentinel: w for w, p in alive.items()})
            try:
                ready = wait(list(by_obj), timeout=0.5)
            except OSError:
                ready = []
            for obj in ready:
                w = by_obj[obj]
                if obj in conns.values():
                    self._drain(w, conns)
                elif w in alive:
                    self._drain(w, conns)
                    p = alive.pop(w)
                    code = self.exitcode(p, 2.0)
                    with self._lock:
                        lost = bool(self._outstanding[w]) and not self.aborting
                    if lost or not self._closed_ok[w]:
                        self._died(w, p, code)

    def _drain(self, w: int, conns: dict) -> None:
        conn = conns.get(w)
        if conn is None:
            return
        try:
            while conn.poll():
                msg = conn.recv()
                if isinstance(msg, (Done, Skipped)):
                    with self._lock:
                        if msg.seq in self._outstanding[w]:
                            self._outstanding[w].remove(msg.seq)
                self._on_message(msg)
                if isinstance(msg, Closed):  # after the engine took it: a waiter then sees both
                    self._closed_ok[w] = True
        except (EOFError, OSError):
            conns.pop(w, None)
        except BaseException as exc:  # a message that cannot be read
            conns.pop(w, None)
            self._on_message(EngineError(f"cannot read the answer of consumer {w}: {exc!r}"))

    def exitcode(self, p, timeout: float = 0.0) -> int | None:
        """Consumer ``p``'s exit code, waiting up to ``timeout`` seconds for its end; None
        while it runs. Every wait for a consumer goes through here: multiprocessing's
        ``join`` is not safe from two threads at once (the one that loses the race to reap
        the process reads it as running)."""
        deadline = time.monotonic() + timeout
        while True:
            wait([p.sentinel], max(0.0, deadline - time.monotonic()))
            with self._reap_lock:
                code = p.exitcode
            if code is not None or time.monotonic() >= deadline:
                return code
            time.sleep(0.005)  # its pipes closed a moment before the kernel reaped it

    def _signal(self, p, kill: bool) -> None:
        with self._reap_lock:
            if p.exitcode is None:
                if kill:
                    p.kill()
                else:
                    p.terminate()

    def _died(self, w: int, p, code: int | None) -> None:
        with self._lock:
            seq = self._outstanding[w][0] if self._outstanding[w] else -1
        self._on_death(w, p, seq, code)

    @property
    def aborting(self) -> bool:
        return bool(self.abort[0])

    def drop_queued(self) -> None:
        """From now on consumers hand the slots they are given back without running the
        sink (the run is stopping: Ctrl-C, a failure)."""
        self.abort[0] = 1

    def stop(self, timeout: float, finished: bool = False) -> None:
        """Ask every consumer to finish, then stop what is left: SIGTERM after ``timeout``
        seconds (the sink still closes), SIGKILL 2 s later.

        ``finished``: the run ended normally, so each consumer gets as long as its sink's
        ``close`` takes (the last commit of a large shard, a slow disk); a deadline here
        would cut that commit and lose its rows. The deadline applies only once the wait
        itself is interrupted (Ctrl-C)."""
        for c in self._conns:
            with contextlib.suppress(OSError):  # that consumer is already gone
                c.send(None)
        if finished:
            try:
                self._wait_for_closes()
            finally:
                self._stop_within(timeout)
        else:
            self._stop_within(timeout)

    def _wait_for_closes(self) -> None:
        """Wait for every consumer to exit, saying every ``_CLOSE_NOTE`` seconds which one
        the run is waiting for (a close that never ends shows, instead of a silent hang)."""
        t0 = time.monotonic()
        for w, p in enumerate(self.procs):
            while self.exitcode(p, _CLOSE_NOTE) is None:
                log.warning("waiting for consumer %d (pid %d) to close its sink: %.0f s so far",
                            w, p.pid, time.monotonic() - t0)

    def _stop_within(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            self.exitcode(p, max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            self._signal(p, kill=False)
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            if self.exitcode(p, max(0.0, deadline - time.monotonic())) is None:
                self._signal(p, kill=True)
                self.exitcode(p, 1.0)
        if self._collector is not None:  # None: a consumer could not start
            self._collector.join(timeout=5.0)

    def close(self) -> None:
        for c in self._conns:
            c.close()
