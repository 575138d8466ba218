"""The consumer process: map the pool, build the sink, run it on each slot handed over.

This module imports numpy only (never torch), so a consumer starts in a fraction of a
second and costs little memory. A consumer ignores SIGINT (the producer coordinates
Ctrl-C), turns SIGTERM into a clean exit that still closes its sink, and asks the
kernel to send it SIGTERM if the producer dies, so no consumer outlives its run.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback

from ..errors import EngineError, error_payload
from .markers import annotate
from .messages import Closed, Done, Failed, Ready, Skipped

_PR_SET_PDEATHSIG = 1


class _Stop(SystemExit):
    """Raised by the SIGTERM handler so ``finally`` blocks (sink.close) still run."""


def _on_sigterm(signum, frame):
    raise _Stop(128 + signum)


def _parent_death_signal(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig)
        except OSError:
            pass


def _die_with_parent(parent_pid: int) -> None:
    _parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise _Stop(1)


def loader_context():
    """The multiprocessing context for DataLoader workers: fork on Linux (None elsewhere:
    the platform's default).

    A process that was itself spawned (a device process of ``--devices``) has spawn as
    its default start method, so its DataLoader workers would each start a fresh
    interpreter and import torch and transformers: seconds each, a dozen at once per
    device. Forked workers start at once; they never touch CUDA."""
    import multiprocessing

    return multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None


def exit_with_parent(parent_pid: int, worker_id: int = 0) -> None:
    """``worker_init_fn`` for DataLoaders (as ``functools.partial(exit_with_parent,
    os.getpid())``): the worker gets SIGKILL when the process that started it dies, and
    leaves Ctrl-C to that process.

    PyTorch's own parent check is armed only after the dataset's iterator is made (our
    datasets load a tokenizer there), so a parent killed before that left the worker
    running forever. A worker that takes Ctrl-C (sent to the whole process group) as
    KeyboardInterrupt leaves its loop before the loader is shut down, then waits at exit
    to flush a queue nobody reads, and the loader's shutdown waits 5 s for it; ignoring
    SIGINT, it goes as soon as the main process shuts the loader down.

    A worker hands a batch's tensors over through multiprocessing's resource sharer (a
    thread serving file descriptors); when the main process exits on Ctrl-C in the middle
    of that hand-over, the thread's connection breaks and Python would print its traceback
    under the run's "interrupted" line, in the moment before the worker is killed with its
    parent. Such an error is dropped (:func:`quiet_resource_sharer`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.excepthook = quiet_resource_sharer
    sys.excepthook = quiet_resource_sharer_sys
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _broken_handover(exc_type, tb) -> bool:
    """Whether an error is a broken connection in multiprocessing's resource sharer (the
    process at the other end went away, or its handshake broke off: the run is stopping)."""
    if not issubclass(exc_type, (OSError, EOFError, multiprocessing.AuthenticationError)):
        return False
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("resource_sharer.py"):
            return True
        tb = tb.tb_next
    return False


def quiet_resource_sharer(args) -> None:
    """``threading.excepthook`` of a loader worker (and of the CLI's process, which hands
    the pool's descriptor to the consumers the same way): a broken hand-over in the
    resource sharer's thread is no error; anything else is reported as Python does."""
    if not _broken_handover(args.exc_type, args.exc_traceback):
        threading.__excepthook__(args)


def quiet_resource_sharer_sys(exc_type, exc, tb) -> None:
    """The same as ``sys.excepthook``, which the resource sharer's thread calls itself on
    an error of its loop (so ``threading.excepthook`` never sees it); anything else is
    reported as Python does."""
    if not _broken_handover(exc_type, tb):
        sys.__excepthook__(exc_type, exc, tb)


def _error_message(worker: int, seq, batch_id, exc: BaseException) -> Failed:
    return Failed(worker, seq, batch_id, *error_payload(exc))


def _send(conn, msg) -> None:
    """Send to the producer; when it is gone nothing is listening, and that is no error
    (a send to a closed pipe raises BrokenPipeError, an OSError)."""
    with contextlib.suppress(OSError):
        conn.send(msg)


def consumer_process(*args) -> None:
    """A consumer process's target: :func:`consumer_main`, then the process ends at once
    with ``os._exit``. By then its sink is closed (its files committed) and its last
    message sent; the interpreter's own finalization (the sink's libraries and the index
    it held, freed object by object) would only delay the end of the run, which waits for
    every consumer to exit. Its status: 0, a ``SystemExit``'s code (143 after SIGTERM; 1
    for one that is not a number, as Python's own), or 1 with the traceback printed for an
    error that escaped."""
    code = 0
    try:
        consumer_main(*args)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def consumer_main(worker: int, sink_factory, handle, conn, abort, parent_pid: int) -> None:
    """Run one consumer until it reads the ``None`` sentinel, is stopped, or fails.

    ``conn`` carries :class:`~.messages.Task` in and the other messages out; ``abort``
    is a shared byte that, once set, makes the consumer hand slots back without running
    the sink.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    sink = None
    seq = batch_id = None
    try:
        _die_with_parent(parent_pid)
        slots = handle.attach()
        sink = sink_factory(worker)
        _send(conn, Ready(worker, os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break  # the producer is gone
            if msg is None:
                break
            seq, slot, batch_id, lengths = msg  # a Task
            if abort[0]:
                _send(conn, Skipped(worker, seq, slot))
            else:
                views = slots[slot]
                arrays = {name: views[name][:n] for name, n in lengths.items()}
                t0 = time.perf_counter()
                with annotate(f"sink {batch_id!r}"[:64], "sink"):
                    result = sink(batch_id, arrays)
                t1 = time.perf_counter()
                del arrays
                _send(conn, Done(worker, seq, slot, t0, t1, result))
            seq = batch_id = None
    except _Stop:
        pass
    except BaseException as exc:  # report everything, including errors in the factory
        _send(conn, _error_message(worker, seq, batch_id, exc))
    finally:
        closed, t_close, t_closed = None, 0.0, 0.0
        close = getattr(sink, "close", None)
        if close is not None:
            try:
                t_close = time.perf_counter()
                closed = close()
                t_closed = time.perf_counter()
            except _Stop:
                _send(conn, _error_message(worker, None, "close", EngineError(
                    f"consumer {worker} was stopped (SIGTERM) while closing its sink, so what "
                    "the sink had not yet written out is lost; re-run to redo it")))
            except BaseException as exc:
                _send(conn, _error_message(worker, None, "close", exc))
        try:
            _send(conn, Closed(worker, closed, t_close, t_closed))
        except Exception as exc:  # what close() returned does not pickle: say so, and close
            _send(conn, _error_message(worker, None, "close", EngineError(
                f"the sink's close() in consumer {worker} returned a {type(closed).__name__}, which "
                f"cannot be sent back to the engine ({type(exc).__name__}: {exc}); return plain "
                "data (numbers, text, lists, dicts)")))
            _send(conn, Closed(worker, None, t_close, t_closed))
        conn.close()
