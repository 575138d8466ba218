"""One process per device: start them, relay their progress, collect their results, and
make a child's failure, or Ctrl-C, the parent's.

Children are spawned, or forked when :func:`fork_is_safe` says the parent holds no CUDA
state and no other thread (a forked child skips seconds of interpreter start and
imports). They are not daemons, because each starts its own DataLoader workers and
engine consumers. A child ignores SIGINT, so a Ctrl-C in the terminal reaches the parent
only; the parent then sends SIGTERM, which a child turns into KeyboardInterrupt once, so
its engine stops the usual way (sinks closed, shards committed) before it exits. A
child also gets SIGTERM when the parent dies, so none outlives its run.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait

from ..engine.consumers import _die_with_parent
from ..errors import EngineError, error_payload, rebuild_error
from ..interrupts import children_ignore_sigint, redeliver_swallowed_interrupts
from ..terminal import log_to_stderr

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


def fork_is_safe() -> bool:
    """Whether a child forked from this process now could use CUDA and its own threads.

    Not when another thread runs here (a fork copies its locks, held or not), nor once
    this process has touched CUDA (``torch.cuda.is_available()`` counts: it initialises
    the driver, which a forked child cannot use). torch marks such a child itself, so a
    throw-away fork asks it.
    """
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return False
    import torch

    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    if in_bad_fork is None or torch.cuda.is_initialized():
        return False
    pid = os.fork()
    if pid == 0:  # the probe: whatever happens, it must not go on running the caller's code
        code = 1
        try:
            code = 1 if in_bad_fork() else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def start_method(devices: Sequence[str]) -> str:
    """Fork GPU processes when :func:`fork_is_safe`; spawn CPU ones, which compute with
    torch's CPU thread pool, and a pool this process may have started does not survive
    a fork."""
    return "fork" if all(d != "cpu" for d in devices) and fork_is_safe() else "spawn"


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
    """One process per job, started before its work is known.

    Each child first runs ``prepare(*job.args)`` (imports, CUDA, model loading: seconds),
    which returns ``(state, info)``: ``state`` stays in the child for its work, ``info``
    (small, picklable) comes to the parent as :meth:`info`. Meanwhile the parent goes on
    (planning the run), then hands out work with :meth:`call` (one child) or :meth:`run`
    (all of them); a child serves calls until the parent leaves. A context manager:
    leaving it ends the children (those still preparing by SIGTERM); errors and Ctrl-C
    behave as in :func:`run_per_device`.

    ``start_method`` is ``"spawn"`` (a fresh interpreter: always safe) or ``"fork"``,
    which skips the child's interpreter start and imports but is only safe from a
    process with no other threads and no CUDA state (see :func:`fork_is_safe`).
    """

    def __init__(self, prepare: Callable | None, jobs: Sequence[DeviceJob], *,
                 start_method: str = "spawn", stop_timeout: float = 60.0):
        self.jobs = list(jobs)
        self.stop_timeout = stop_timeout
        self.procs: list = []
        self.conns: list = []
        self._info: dict[int, object] = {}
        self._busy: set[int] = set()
        self._results: dict[int, object] = {}
        ctx = mp.get_context(start_method)
        level = log.getEffectiveLevel()
        try:
            for job in self.jobs:
                mine, theirs = ctx.Pipe(duplex=True)
                # A forked child inherits the parent's ends of its siblings' pipes: it closes them.
                siblings = list(self.conns) if start_method == "fork" else []
                proc = ctx.Process(target=_child_main, name=f"embedingest-{job.name}",
                                   args=(prepare, job.args, theirs, os.getpid(), level, siblings))
                # Kept before SIGINT is let through again: a Ctrl-C during the start is
                # delivered as the block ends, and close() must then know this child.
                with _environ(job.env), children_ignore_sigint():
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

    def info(self, i: int) -> object:
        """The ``info`` child ``i``'s prepare returned, once it is ready (a failure of any
        child while waiting is raised here)."""
        self._guarded(lambda: i in self._info)
        return self._info[i]

    def call(self, i: int, target: Callable, args: tuple, *,
             on_progress: Callable[..., None] | None = None) -> object:
        """Child ``i`` runs ``target(state, *args, report)``; return its result."""
        return self.run(target, [args if j == i else None for j in range(len(self.jobs))],
                        on_progress=on_progress)[i]

    def run(self, target: Callable, work: Sequence[tuple | None], *,
            on_progress: Callable[..., None] | None = None) -> list:
        """Give child ``i`` the call ``target(state, *work[i], report)`` (without a
        ``prepare``: ``target(*work[i], report)``), or nothing when ``work[i]`` is None;
        return the results in job order (None for a child given nothing)."""
        if len(work) != len(self.jobs):
            raise ValueError(f"{len(work)} work items for {len(self.jobs)} device processes")
        self._results = {}
        for i, args in enumerate(work):
            if args is None:
                continue
            self._busy.add(i)
            # A child whose prepare failed has ended: _pump reads and raises why.
            with contextlib.suppress(OSError):
                self.conns[i].send((target, args))
        self._guarded(lambda: not self._busy, on_progress)
        return [self._results.get(i) for i in range(len(self.jobs))]

    def close(self) -> None:
        """End the children: a ready, idle one is told to leave; any other (still
        preparing, or busy after an error) is stopped. Wait for all to end."""
        for i, conn in enumerate(self.conns):
            with contextlib.suppress(EOFError, OSError):
                while conn.poll():  # a "ready" not read yet
                    kind, payload = conn.recv()
                    if kind == "ready":
                        self._info[i] = payload
            if i in self._info and i not in self._busy:
                with contextlib.suppress(OSError):
                    conn.send(None)
        _stop([p for i, p in enumerate(self.procs) if i not in self._info or i in self._busy],
              self.stop_timeout)
        deadline = time.monotonic() + self.stop_timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        _stop(self.procs, 0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def _guarded(self, done: Callable[[], bool], on_progress=None) -> None:
        """Handle the children's messages until ``done()``; on any error (a child's, or
        Ctrl-C here) stop them all and raise it."""
        try:
            while not done():
                self._pump(on_progress)
        except BaseException:
            _stop(self.procs, self.stop_timeout)
            self._busy.clear()
            raise

    def _pump(self, on_progress) -> None:
        wait(self.conns + [p.sentinel for p in self.procs], timeout=1.0)
        for i, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            ended = False
            while conn.poll():
                try:
                    kind, payload = conn.recv()
                except EOFError:
                    ended = True
                    break
                if kind == "progress":
                    if on_progress is not None:
                        on_progress(i, *payload)
                elif kind == "ready":
                    self._info[i] = payload
                elif kind == "ok":
                    self._results[i] = payload
                    self._busy.discard(i)
                else:
                    raise _remote_error(self.jobs[i].name, *payload)
            if ended or (not proc.is_alive() and not conn.poll()):
                proc.join(5)
                raise EngineError(
                    f"the process of device {self.jobs[i].name} ended (exit code "
                    f"{proc.exitcode}) without a result; a negative code is the signal "
                    "that killed it (-9: SIGKILL, often the OOM killer). Run the same "
                    "command again to resume")


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


_stop_from_finalizer = redeliver_swallowed_interrupts(
    signal.SIGTERM, lambda: signal.signal(signal.SIGTERM, _interrupt_once))


def _child_main(prepare, prepare_args, conn, parent_pid: int, level: int, siblings) -> None:
    """A device process: prepare, say ready, then serve calls until told to leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _interrupt_once)
    sys.unraisablehook = _stop_from_finalizer
    for other in siblings:
        other.close()
    log_to_stderr(level)

    def report(*values) -> None:
        conn.send(("progress", values))

    try:
        _die_with_parent(parent_pid)
        state, info = prepare(*prepare_args) if prepare is not None else (None, None)
        conn.send(("ready", info))
        while (work := _receive(conn)) is not None:
            target, args = work
            result = target(*args, report) if prepare is None else target(state, *args, report)
            conn.send(("ok", result))
    except BaseException as exc:
        _report_error(conn, exc)
    finally:
        conn.close()


def _report_error(conn, exc: BaseException) -> None:
    """Send the child's error to the parent. The parent stops every child on the first
    error it reads, and this one is ending anyway, so a SIGTERM no longer interrupts the
    send (it would print a second traceback over the error the user should read). A
    parent that is gone or no longer listening is not told."""
    with contextlib.suppress(OSError, KeyboardInterrupt):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        conn.send(("error", error_payload(exc)))


def _receive(conn):
    """The next call, or None when the parent says leave (or is gone)."""
    try:
        return conn.recv()
    except EOFError:
        return None
