"""A model's first call at each new input shape, made in a thread ahead of the batch loop.

cuDNN sets each convolution up for every new input shape on its first call: host time
(about 0.1 s for a DeepLabV3-ResNet50 forward) in the thread that drives the GPU, during
which the GPU runs nothing of the loop's. A loop that knows its coming shapes (a planned
batch) hands them here; a thread of its own makes one call at each, in order, on the
loop's stream, so the set-up is cached before the loop's batch of that shape arrives.
PyTorch releases the GIL inside its operators, so the thread's set-up runs beside the
loop's own work. Results do not change: the same cached set-up serves the loop's call.

Before its batch of a shape the loop calls :meth:`WarmAhead.claim`: a shape warmed goes
at once, one being warmed is waited for (it is further along than the loop would be), and
one not reached yet is the loop's own (the thread skips it), so no set-up is made twice.

A call that fails (out of memory, say) is reported once and ends the warming: the loop
then pays the set-ups itself, as it would without this.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable

log = logging.getLogger("embedingest")

_END = object()
QUEUED, RUNNING, DONE, CLAIMED = "queued", "running", "done", "claimed"


class WarmAhead:
    """Runs ``call(key)`` once per new key given to :meth:`add`, in order, in a thread
    started by :meth:`start` with the ``call`` (keys added before wait for it: the model
    may not be on its device yet), skipping keys the loop claimed first (:meth:`claim`);
    :meth:`close` stops it (the call under way finishes). ``warmed``: the keys whose call
    returned."""

    def __init__(self, name: str = "embedingest-warm-ahead"):
        self._call: Callable[[Hashable], None] | None = None
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._state: dict = {}
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.warmed: list = []
        self.failure: BaseException | None = None

    def add(self, key: Hashable) -> None:
        """Warm ``key`` unless it was given (or claimed) before."""
        with self._changed:
            if key in self._state or self._stop.is_set():
                return
            self._state[key] = QUEUED
        self._queue.put(key)

    def claim(self, key: Hashable, timeout: float = 60.0) -> None:
        """The loop is about to run ``key``: wait while the thread is warming it (at most
        ``timeout`` s), else take it from the thread."""
        with self._changed:
            if self._state.get(key) == RUNNING:
                self._changed.wait_for(lambda: self._state.get(key) != RUNNING, timeout)
            if self._state.get(key) != DONE:
                self._state[key] = CLAIMED

    def start(self, call: Callable[[Hashable], None]) -> WarmAhead:
        if self._thread is None and not self._stop.is_set():
            self._call = call
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            key = self._queue.get()
            if key is _END:
                return
            with self._changed:
                if self._stop.is_set():
                    return
                if self._state.get(key) != QUEUED:  # the loop got to it first
                    continue
                self._state[key] = RUNNING
            try:
                self._call(key)
            except Exception as exc:  # noqa: BLE001 - the loop makes the same calls without it
                self.failure = exc
                self._stop.set()
                log.warning("warming the model's next input shape %s failed (%s: %s); the run goes on "
                            "and sets each new shape up on its first batch", key, type(exc).__name__, exc)
                with self._changed:
                    self._state[key] = CLAIMED
                    self._changed.notify_all()
                return
            with self._changed:
                self._state[key] = DONE
                self.warmed.append(key)
                self._changed.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking keys and wait for the call under way (at most ``timeout`` s)."""
        self._stop.set()
        self._queue.put(_END)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> WarmAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
