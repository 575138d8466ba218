"""Stops that Python would swallow: a KeyboardInterrupt raised by a signal handler while a
finalizer (``__del__``) or an import lock's callback runs is printed as "Exception ignored"
and dropped. The CLI (Ctrl-C, SIGINT) and device processes (SIGTERM) deliver it again.
Imports nothing heavy: the CLI installs it before the job's imports."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


def redeliver_swallowed_interrupts(signum: int, before=None):
    """A ``sys.unraisablehook`` for a process stopped by ``signum`` through a
    KeyboardInterrupt: one that landed while a finalizer (``__del__``) or an import lock's
    callback ran is swallowed there by Python (an "Exception ignored" traceback), and the
    process would go on as if no stop was asked. The hook delivers ``signum`` again instead,
    from a thread a moment later (a signal sent from the hook would be handled inside it):
    its handler then raises in the process's own code, or, landing in such a place again,
    comes back here. ``before()`` runs first (to put the signal's handler back)."""

    def hook(args) -> None:
        if args.exc_type is not None and issubclass(args.exc_type, KeyboardInterrupt):
            if before is not None:
                before()
            again = getattr(args.exc_type, "signum", signum)  # a Terminated: SIGTERM again
            resend = threading.Timer(0.01, os.kill, (os.getpid(), again))
            resend.daemon = True
            resend.start()
            return
        sys.__unraisablehook__(args)

    return hook


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``docker stop``, ``kill``, a batch system's end of a job),
    raised where a Ctrl-C's KeyboardInterrupt would be, so a run stops the same way:
    its work committed so far kept, its processes stopped, a line that says so."""

    signum = signal.SIGTERM


def _children_ended(signum, frame) -> None:
    """SIGCHLD while a run stops: nothing to do (see :func:`sigterm_interrupts`)."""


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """In the block, SIGTERM to this process raises :class:`Terminated` in its main
    thread. A process forked meanwhile (a DataLoader worker, a header reader) that gets
    SIGTERM dies of it as before: its parent stops it so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        # A SIGTERM sent to the whole process group (a batch system's) ends the DataLoader's
        # workers too; the run is stopping, so their deaths are not news: torch's SIGCHLD
        # handler would raise about them in the middle of the stop.
        # (A handler that does nothing, not SIG_DFL: one of their SIGCHLDs may be pending.)
        signal.signal(signal.SIGCHLD, _children_ended)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Children started in the block (device processes, engine consumers) start with
    SIGINT blocked, and a Ctrl-C meanwhile reaches this process once the block ends, not
    in the middle of a start (the child not yet known to be stopped).

    A blocked signal stays blocked through fork and exec: a Ctrl-C in the terminal reaches
    the whole process group, and a child still importing would die of it with a traceback;
    it holds it instead, until it ignores SIGINT itself (which discards it).

    This process's handler is not SIG_IGN meanwhile: an ignored SIGINT is discarded, and
    one was, in a thread that does not block it (tokenizers' thread pool, the engine's
    pool thread: the kernel hands it to such a thread while this one blocks it), or here
    once multiprocessing's resource tracker had unblocked it (:func:`_resource_tracker_started`).
    A handler notes it instead, whichever thread takes it, and it is delivered again at the end."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    _resource_tracker_started()
    previous = signal.getsignal(signal.SIGINT)
    caught: list[int] = []
    # Only the main thread sets handlers; one set outside Python (None) could not be put back.
    noted = (threading.current_thread() is threading.main_thread()
             and previous not in (None, signal.SIG_IGN))
    if noted:
        signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        # The mask first: the handler put back may raise, the one that notes never does.
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if noted:
            signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _resource_tracker_started() -> None:
    """multiprocessing starts its resource tracker at a process's first spawn and then
    unblocks SIGINT (``SIG_UNBLOCK``, not the mask as it was): started before SIGINT is
    blocked, so the children spawned after it still start with SIGINT blocked."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
