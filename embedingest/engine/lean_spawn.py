"""Consumers spawned without the parent's main script, where their sink factory does not need it.

A spawned process imports its parent's ``__main__`` before it unpickles its work: that is how
a sink defined in the user's script reaches it. A sink from a package needs none of it, and
a script that imports torch, pandas or its data at the top had each consumer do the same
before its first batch, seconds in which the engine's slots filled and the loop waited.
Where the pickled factory names nothing of ``__main__``, the consumers are started from the
preparation data ``multiprocessing`` gives a spawned child, less its main-module entries
(the parent's ``sys.path`` and working folder are kept).
"""

from __future__ import annotations

import contextlib
import threading
from multiprocessing import reduction, spawn

_MAIN_ENTRIES = ("init_main_from_path", "init_main_from_name")
_here = threading.local()
_install_lock = threading.Lock()


def needs_main(obj) -> bool:
    """Whether unpickling ``obj`` in a fresh interpreter may need the parent's ``__main__``:
    its pickle names the module (a class or function defined in the script), or it cannot
    be pickled here (the start then fails as it would have, with its own error)."""
    try:
        data = bytes(reduction.ForkingPickler.dumps(obj))
    except Exception:
        return True
    return b"__main__" in data


@contextlib.contextmanager
def spawning_without_main(skip: bool):
    """Processes this thread spawns in the block skip the parent's main module where ``skip``;
    other threads' spawns are untouched."""
    _install()
    _here.skip = skip
    try:
        yield
    finally:
        _here.skip = False


def _install() -> None:
    """Wrap ``multiprocessing.spawn.get_preparation_data`` once (the spawning ``Popen``
    classes call it through the module), dropping the main-module entries for a thread
    inside :func:`spawning_without_main`."""
    with _install_lock:
        if getattr(spawn.get_preparation_data, "_lean", False):
            return
        real = spawn.get_preparation_data

        def get_preparation_data(name):
            data = real(name)
            if getattr(_here, "skip", False):
                for key in _MAIN_ENTRIES:
                    data.pop(key, None)
            return data

        get_preparation_data._lean = True
        spawn.get_preparation_data = get_preparation_data
