"""Stops that Python would swallow: a KeyboardInterrupt raised by a signal handler while a
finalizer (``__del__``) or an import lock's callback runs is printed as "Exception ignored"
and dropped. The CLI (Ctrl-C, SIGINT) and device processes (SIGTERM) deliver it again.
Imports nothing heavy: the CLI installs it before the job's imports."""

from __future__ import annotations

import os
import sys
import threading


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
            resend = threading.Timer(0.01, os.kill, (os.getpid(), signum))
            resend.daemon = True
            resend.start()
            return
        sys.__unraisablehook__(args)

    return hook
