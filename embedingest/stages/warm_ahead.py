"""A model's first call at each new input shape, made in a thread ahead of the batch loop.

cuDNN sets each convolution up for every new input shape on its first call: host time
(about 0.1 s for a DeepLabV3-ResNet50 forward) in the thread that drives the GPU, during
which the GPU runs nothing of the loop's. A loop that knows its coming shapes (a planned
batch) hands them here; a thread of its own makes one call at each, in order, on the
loop's stream, so the set-up is cached before the loop's batch of that shape arrives.
PyTorch releases the GIL inside its operators, so the thread's set-up runs beside the
loop's own work. Results do not change: the same cached set-up serves the loop's call.

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


class WarmAhead:
    """Runs ``call(key)`` once per new key given to :meth:`add`, in order, in a thread
    started by :meth:`start` (keys added before wait for it); :meth:`close` stops it
    (the call under way finishes). ``warmed``: the keys whose call returned."""

    def __init__(self, call: Callable[[Hashable], None], name: str = "embedingest-warm-ahead"):
        self._call = call
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._seen: set = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.warmed: list = []
        self.failure: BaseException | None = None

    def add(self, key: Hashable) -> None:
        """Warm ``key`` unless it was given before."""
        with self._lock:
            if key in self._seen or self._stop.is_set():
                return
            self._seen.add(key)
        self._queue.put(key)

    def start(self) -> WarmAhead:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            key = self._queue.get()
            if key is _END or self._stop.is_set():
                return
            try:
                self._call(key)
            except Exception as exc:  # noqa: BLE001 - the loop makes the same calls without it
                self.failure = exc
                self._stop.set()
                log.warning("warming the model's next input shape %s failed (%s: %s); the run goes on "
                            "and sets each new shape up on its first batch", key, type(exc).__name__, exc)
                return
            self.warmed.append(key)

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
