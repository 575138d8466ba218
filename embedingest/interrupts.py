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
    """SIGINT ignored while children start (device processes, engine consumers), so each
    starts ignoring it (an ignored signal stays ignored through exec, and Python then
    installs no handler): a Ctrl-C in the terminal reaches the whole process group, and a
    spawned child still importing would die of it with a traceback before it could ignore
    it itself.

    Here it is blocked too, so a Ctrl-C meanwhile stays pending (Linux keeps a blocked
    signal even when ignored) and arrives once the handler is back. That holds when no
    other thread takes it: the CLI imports torch and numpy with SIGINT blocked, so their
    threads keep it blocked (:func:`embedingest.cli.common.import_interruptibly`)."""
    previous = signal.getsignal(signal.SIGINT)
    # Not from another thread, nor over a handler set outside Python (it could not be put back).
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    held = (signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            if hasattr(signal, "pthread_sigmask") else None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
