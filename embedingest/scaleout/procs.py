"""One process per device: start them, relay their progress, collect their results, and
make a child's failure, or Ctrl-C, the parent's.

Children are spawned (never forked: the parent may hold CUDA state and threads) and are
not daemons, because each starts its own DataLoader workers and engine consumers. A
child ignores SIGINT, so a Ctrl-C in the terminal reaches the parent only; the parent
then sends SIGTERM, which a child turns into KeyboardInterrupt once, so its engine stops
the usual way (sinks closed, segments committed) before it exits. A child also gets
SIGTERM when the parent dies, so none outlives its run.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from ..engine.consumers import _die_with_parent
from ..errors import EngineError, error_payload, rebuild_error

log = logging.getLogger("embedingest")


@dataclass
class DeviceJob:
    """The arguments of one child; ``name`` (e.g. ``"cuda:1"``) labels its errors, ``env``
    is added to its environment (e.g. ``CUDA_VISIBLE_DEVICES``)."""

    name: str
    args: tuple
    env: dict[str, str] = field(default_factory=dict)


def run_per_device(target: Callable, jobs: Sequence[DeviceJob], *,
                   on_progress: Callable[..., None] | None = None,
                   stop_timeout: float = 60.0) -> list:
    """Run ``target(*job.args, report)`` in one spawned process per job; return the
    results in job order.

    ``target`` must be a module-level function and its result picklable. In a child,
    ``report(*values)`` calls ``on_progress(job_index, *values)`` in the parent. The first
    child that fails stops the others (SIGTERM, SIGKILL after ``stop_timeout`` seconds)
    and its exception is raised here, with its own type and text when it unpickles, and
    the child's traceback as its cause. KeyboardInterrupt in the parent stops all
    children the same way and is re-raised.
    """
    with DeviceProcesses(None, [DeviceJob(job.name, (), job.env) for job in jobs],
                         stop_timeout=stop_timeout) as procs:
        return procs.run(target, [job.args for job in jobs], on_progress=on_progress)


class BatchedProgress:
    """A child's progress counts, summed and sent to the parent (``report``) at most every
    ``every`` seconds: one pipe message per batch would cost more than the batch's own
    bookkeeping. Call :meth:`flush` once at the end."""

    def __init__(self, report: Callable[..., None], every: float = 0.5):
        self.report, self.every = report, every
        self.pending: tuple | None = None
        self.at = time.monotonic()

    def add(self, *counts) -> None:
        self.pending = counts if self.pending is None else tuple(map(sum, zip(self.pending, counts)))
        if time.monotonic() - self.at > self.every:
            self.flush()

    def flush(self) -> None:
        if self.pending is not None and any(self.pending):
            self.report(*self.pending)
        self.pending, self.at = None, time.monotonic()


class DeviceProcesses:
    """One spawned process per job, started before its work is known.

    Each child first runs ``prepare(*job.args)`` (imports, CUDA, model loading: seconds)
    while the parent goes on (planning the run), then waits for its share of the work,
    given by :meth:`run`. A context manager: leaving it stops children that were given
    no work; errors and Ctrl-C behave as in :func:`run_per_device`.
    """

    def __init__(self, prepare: Callable | None, jobs: Sequence[DeviceJob], *,
                 stop_timeout: float = 60.0):
        self.jobs = list(jobs)
        self.stop_timeout = stop_timeout
        self.procs: list = []
        self.conns: list = []
        self._ran = False
        ctx = mp.get_context("spawn")
        level = log.getEffectiveLevel()
        try:
            for job in self.jobs:
                mine, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_child_main, name=f"embedingest-{job.name}",
                                   args=(prepare, job.args, theirs, os.getpid(), level))
                with _environ(job.env):
                    proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(mine)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> DeviceProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, target: Callable, work: Sequence[tuple | None], *,
            on_progress: Callable[..., None] | None = None) -> list:
        """Give child ``i`` the call ``target(prepared, *work[i], report)`` (without a
        ``prepare``: ``target(*work[i], report)``), or nothing when ``work[i]`` is None;
        return the results in job order (None for a child given nothing)."""
        self._ran = True
        try:
            for conn, args in zip(self.conns, work, strict=True):
                try:
                    conn.send(None if args is None else (target, args))
                except (BrokenPipeError, OSError):
                    pass  # the child already ended (its prepare failed): _collect says why
            return _collect(self.jobs, self.procs, self.conns, on_progress)
        except BaseException:
            _stop(self.procs, self.stop_timeout)
            raise

    def close(self) -> None:
        """Stop the children that were never given work; wait for all to end."""
        if not self._ran:
            _stop(self.procs, self.stop_timeout)
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def _collect(jobs, procs, conns, on_progress) -> list:
    results: dict[int, object] = {}
    live = set(range(len(procs)))
    while live:
        wait([conns[i] for i in live] + [procs[i].sentinel for i in live], timeout=1.0)
        for i in sorted(live):
            conn, ended = conns[i], False
            while conn.poll():
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    ended = True
                    break
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(i, *payload)
                elif kind == "ok":
                    results[i] = payload
                    break
                else:
                    raise _remote_error(jobs[i].name, *payload)
            if i in results:
                live.discard(i)
            elif ended or not procs[i].is_alive():
                procs[i].join(5)
                raise EngineError(
                    f"the process of device {jobs[i].name} ended (exit code "
                    f"{procs[i].exitcode}) without a result; a negative code is the signal "
                    "that killed it (-9: SIGKILL, often the OOM killer). Run the same "
                    "command again to resume")
    return [results[i] for i in range(len(procs))]


def _remote_error(name: str, data: bytes | None, text: str, tb: str) -> BaseException:
    return rebuild_error(data, f"device {name}: {text}", f"in the process of device {name}", tb)


def _stop(procs, timeout: float) -> None:
    """SIGTERM the live children, wait for them up to ``timeout`` s (a second Ctrl-C
    cuts the wait short), then SIGKILL what is left."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        log.warning("second interrupt: killing the device processes without waiting")
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """``extra`` in ``os.environ`` while a child is started (it inherits the environment)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _interrupt_once(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up that follows must finish
    raise KeyboardInterrupt


def _child_main(prepare, prepare_args, conn, parent_pid: int, level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _interrupt_once)
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")

    def report(*values) -> None:
        conn.send(("progress", values))

    try:
        _die_with_parent(parent_pid)
        prepared = prepare(*prepare_args) if prepare is not None else None
        try:
            work = conn.recv()
        except EOFError:
            return  # the parent is gone
        if work is None:
            msg = ("ok", None)
        else:
            target, args = work
            result = target(*args, report) if prepare is None else target(prepared, *args, report)
            msg = ("ok", result)
    except BaseException as exc:
        msg = ("error", error_payload(exc))
    try:
        conn.send(msg)
    except (BrokenPipeError, EOFError, OSError):
        pass  # the parent is gone or stopped listening
    finally:
        conn.close()
