"""The egress engine: get model outputs off the GPU while the GPU keeps computing.

On CUDA, ``submit`` waits for a free slot of the pinned pool (back-pressure), makes a
dedicated egress stream wait for the compute stream, enqueues a ``non_blocking`` copy
into the slot and records an event; it returns at once. A monitor thread waits on the
events in order and hands each finished slot to the consumer processes; a collector
thread takes their answers and returns the slot to the free list. The device outputs
are kept referenced until their copy's event fires, so the caching allocator cannot
hand their memory to the next batch too early.

On CPU the same path runs without streams or events: the copy into the shared slot is
done in ``submit`` and everything else (processes, back-pressure, errors) is the same,
so CI tests all of it without a GPU.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

from ..config import EngineConfig, check_types
from ..errors import ConfigError, ConsumerDied, EngineError, rebuild_error
from .consumer_group import ConsumerGroup
from .copy_paths import CudaCopyPath, HostCopyPath, Pending
from .layout import SlotLayout, named_arrays
from .gpu_monitor import gpu_idle
from .markers import annotate
from .messages import Closed, Done, Failed, Ready, Skipped, Task
from .pool import HostPool
from .telemetry import BatchRecord, EngineStats

SinkFactory = Callable[[int], Callable]
_POLL = 0.1  # seconds between checks for failures while blocked

# Consumer processes one engine starts at the most: each is an interpreter of its own.
MAX_CONSUMERS = 1024


def refuse_while_bootstrapping(what: str) -> None:
    """Stop ``what`` (a job or an engine) when it is called while this process is being
    started by another one: a spawned process imports its parent's main script first,
    and a script that starts a run without an ``if __name__ == "__main__":`` guard would
    start it again in every process it starts."""
    if getattr(mp.current_process(), "_inheriting", False):
        # the parent's main module, being imported here under the name __mp_main__
        main = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main module"
        raise ConfigError(
            f"{what} was called while a process it started was importing {main}: put the "
            f"code that calls it under `if __name__ == \"__main__\":` (consumer processes "
            "are spawned, and a spawned process imports the main module first)")


def _refuse_unpicklable(batch_id) -> None:
    """ConfigError for a batch id the consumer processes cannot be sent (a lock, a lambda):
    the error named neither the id nor where it goes."""
    try:
        pickle.dumps(batch_id)
    except Exception as exc:
        raise ConfigError(f"batch_id {batch_id!r} does not pickle ({type(exc).__name__}: {exc}), and it goes to the "
                          "consumer processes with its batch: give text, a number, or a tuple of them") from None


class EgressEngine:
    """Move batches of outputs to CPU consumer processes through a bounded pinned pool.

    Args:
        sink_factory: picklable callable ``factory(worker_index) -> sink``, called once
            in each consumer process. ``sink(batch_id, arrays)`` receives a dict of
            numpy arrays viewing the slot, valid until it returns; a single tensor
            arrives as ``"out"``. ``sink.close()``, if present, runs at the end (also
            after a failure or Ctrl-C) and its return value lands in ``closed_results``.
        num_consumers: consumer processes.
        num_slots: host slots (``None``: twice the consumers). Memory is bounded by
            ``num_slots`` times one batch's outputs.
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` or a ``torch.device``; ``None``
            picks CUDA when available.
        slot_spec: ``{name: (shape, dtype)}`` with the largest batch's shapes, to size
            the slots up front; otherwise they are sized from the first batch.
        pin_memory: register the pool with CUDA (only turn off to measure the effect).
        shutdown_timeout: seconds consumers get to close their sinks when the run is
            stopped early (an error, Ctrl-C); at a normal end each close takes as
            long as it needs.
        on_result: ``callback(batch_id, value)`` for values sinks return, called in a
            background thread of this process.

    The parts: a :class:`~.copy_paths.HostCopyPath` or :class:`~.copy_paths.CudaCopyPath`
    fills the slots; a monitor thread waits for each copy in submission order and hands
    the slot to the :class:`~.consumer_group.ConsumerGroup`, whose collector thread
    brings the answers back here, where the slot is freed.
    """

    def __init__(self, sink_factory: SinkFactory, *, num_consumers: int = 4,
                 num_slots: int | None = None, device=None,
                 slot_spec: Mapping[str, tuple] | None = None, pin_memory: bool = True,
                 shutdown_timeout: float = 5.0,
                 on_result: Callable[[object, object], None] | None = None):
        refuse_while_bootstrapping("EgressEngine()")
        self.config = EngineConfig(num_consumers=num_consumers, num_slots=num_slots or 0,
                                   shutdown_timeout=shutdown_timeout, pin_memory=pin_memory)
        check_types(self.config)  # "2", 2.5 or True: named here, not a TypeError in the pool
        num_consumers = self.config.num_consumers
        if not 1 <= num_consumers <= MAX_CONSUMERS:
            raise ConfigError(f"num_consumers={num_consumers}: need at least 1 consumer process"
                              if num_consumers < 1 else
                              f"num_consumers={num_consumers}: at most {MAX_CONSUMERS} consumer processes")
        if self.config.slots() < 1:
            raise ConfigError(f"num_slots={num_slots}: need at least 1 slot")
        self.sink_factory = sink_factory
        self.on_result = on_result
        self.device = _resolve_device(device)
        self.cuda = self.device.startswith("cuda")
        self.closed_results: list = [None] * num_consumers
        self._closes: dict[int, tuple[float, float]] = {}  # worker -> when its sink's close ran
        self._shutdown_spans: list[tuple[str, float, float]] = []
        self._host_spans: list[tuple[str, float, float]] = []  # the caller's, see host_span
        self._ready: set[int] = set()  # consumers that said they started
        self._path = CudaCopyPath(self.device) if self.cuda else HostCopyPath(self.device)
        self._slot_spec = slot_spec
        self._pool: HostPool | None = None
        self._consumers: ConsumerGroup | None = None
        self._free: queue.Queue[int] = queue.Queue()
        self._pending: queue.Queue[Pending | None] = queue.Queue()
        self._monitor: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._failed = threading.Event()
        self._lock = threading.Condition()
        self._records: dict[int, BatchRecord] = {}
        self._inflight: dict[int, object] = {}
        self._seq = 0
        self._done = 0
        self._t_first: float | None = None
        self._t_last: float | None = None
        self._entered = False
        self._closed = False
        self._stats: EngineStats | None = None
        self._submitter: int | None = None  # the thread that submits (one only)

    # -- public API ----------------------------------------------------------------

    def __enter__(self) -> EgressEngine:
        if self._closed:
            raise EngineError("this engine was stopped (stop() or its with block ended): make a new one")
        if not self._entered:  # an engine started early (start()) is entered once
            self._entered = True
            if self._slot_spec is not None:
                self._open(SlotLayout.from_spec(self._slot_spec))
        return self

    def start(self) -> EgressEngine:
        """Make the pool and start the consumers now, before the ``with`` block (which then
        uses them): their start-up (a fresh interpreter each, the sink's imports) overlaps
        the caller's own, a model loading. Needs ``slot_spec``; an engine started and then
        not used is stopped with :meth:`stop`."""
        if self._slot_spec is None:
            raise ConfigError("start() needs the slots' sizes up front: give slot_spec")
        return self.__enter__()

    def stop(self) -> None:
        """Stop an engine started with :meth:`start` that will not be used (the caller
        failed before its batches): the consumers close their sinks and exit. An engine
        stopped cannot be entered again."""
        self._shutdown(abort=True)
        self._closed = True

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            try:
                self._drain()
            except BaseException:
                self._shutdown(abort=True)
                raise
            self._shutdown(abort=False)
            self._raise_failure()
        else:
            self._shutdown(abort=True)
        return False

    def mark_compute_start(self) -> None:
        """Mark on the compute stream where this batch's compute begins.

        Optional: with it, ``stats.compute_gap_fraction`` counts exactly the time the
        GPU waited between batches; without it, the wait is counted as compute.
        """
        self._path.mark_compute_start()

    def span(self, lane: str, stream=None):
        """Time the work enqueued in the block (on ``stream``, CUDA) for the timeline.

        A context manager, for the stages' own steps, e.g. the host-to-device prefetch:
        the engine draws them as lane ``lane`` beside its own lanes.
        """
        return self._path.span(lane, stream)

    def host_span(self, lane: str, start: float, end: float) -> None:
        """Record host work (``time.perf_counter()`` times) for the timeline and the trace,
        e.g. the batch loop waiting for its inputs, beside the GPU's lanes."""
        self._host_spans.append((lane, start, end))

    def submit(self, batch_id, outputs) -> None:
        """Queue ``outputs`` (a tensor, or a dict of tensors / numpy arrays) for the sinks.

        Returns as soon as the copy is enqueued; blocks only while every slot is busy.
        Raises the first failure of a consumer or of the engine's threads. Batches come
        from one thread: a submit from another is refused.
        """
        me = threading.get_ident()
        if self._submitter is None:
            self._submitter = me
        elif self._submitter != me:
            raise EngineError("submit() from a second thread: an engine takes its batches from one "
                              "thread (the one that submitted first); hand the outputs to it, e.g. "
                              "through a queue.Queue")
        if not self._entered or self._closed:
            raise EngineError("submit() outside the engine's 'with' block")
        self._raise_failure()
        self._path.mark_compute_end()  # before the first batch's wait for the pool
        arrays = named_arrays(outputs)
        _refuse_unpicklable(batch_id)
        if self._pool is None:
            empty = [k for k, v in arrays.items() if len(v.shape) and v.shape[0] == 0]
            if empty:
                raise ConfigError(f"the first batch's {empty[0]!r} has 0 rows, and the slots are sized "
                                  "from the first batch: submit one with rows first, or give slot_spec")
            self._open(SlotLayout.from_spec({k: (tuple(v.shape), v.dtype) for k, v in arrays.items()}))
        if self._seq == 0:
            self._pool.ready()  # made while the caller went on (see HostPool); its error here
        lengths = self._pool.layout.lengths(arrays)
        with annotate(f"submit {batch_id!r}"[:64], "submit"):
            t_submit = time.perf_counter()
            if self._t_first is None:
                self._t_first = t_submit
            slot = self._acquire_slot()
            seq = self._seq
            self._seq += 1
            rec = BatchRecord(seq=seq, slot=slot, nbytes=0, submit_t=t_submit,
                              slot_t=time.perf_counter())
            pending = Pending(rec, batch_id, lengths)
            with annotate("copy", "copy"):
                rec.nbytes = self._path.copy(self._pool, slot, arrays, pending)
            with self._lock:
                self._records[seq] = rec
            self._pending.put(pending)

    def flush(self) -> None:
        """Block until every batch submitted so far went through a sink.

        For checkpoints and for timing a steady state; raises a pending failure.
        """
        if not self._entered or self._closed:
            raise EngineError("flush() outside the engine's 'with' block")
        self._drain()

    def gpu_idle_fraction(self, since: float = 0.0, until: float = float("inf")) -> float | None:
        """The GPU's idle share measured by NVML between two ``time.perf_counter()``
        times; None on the CPU or where NVML is not available."""
        return self._path.idle_fraction(since, until)

    @property
    def stats(self) -> EngineStats:
        """Run summary; final after the ``with`` block, a snapshot during it."""
        if self._stats is not None:
            return self._stats
        return self._make_stats()

    # -- set-up --------------------------------------------------------------------

    def _open(self, layout: SlotLayout) -> None:
        """Make the pool, the copy path and the consumers; when a part cannot be made, what
        was made is released and the engine stays unopened (its exit then has nothing to stop)."""
        cfg = self.config
        with contextlib.ExitStack() as undo:
            pool = HostPool(layout, cfg.slots(), pin=self._path.pins and cfg.pin_memory, ahead=True)
            undo.callback(pool.close)
            self._path.open(pool)
            undo.callback(self._path.release)
            consumers = ConsumerGroup(self.sink_factory, cfg.num_consumers, pool.handle(),
                                      self._on_message, self._consumer_died)
            undo.pop_all()  # all made: kept
        self._pool, self._consumers = pool, consumers
        for i in range(cfg.slots()):
            self._free.put(i)
        self._monitor = threading.Thread(target=self._monitor_loop, name="embedingest-monitor", daemon=True)
        self._monitor.start()

    # -- producer side -------------------------------------------------------------

    def _acquire_slot(self) -> int:
        while True:
            try:
                return self._free.get(timeout=_POLL)
            except queue.Empty:
                self._raise_failure()

    # -- background threads --------------------------------------------------------

    def _monitor_loop(self) -> None:
        """Wait for each copy in submission order and hand the slot to the consumers."""
        try:
            while True:
                p = self._pending.get()
                if p is None:
                    return
                rec = p.record
                with annotate("wait copy", "handoff"):
                    self._path.wait(p)
                rec.ready_t = time.perf_counter()
                if self._consumers.aborting or self._failed.is_set():
                    self._finish(rec.seq, rec.slot)  # dropped: the run is stopping
                    continue
                with annotate("handoff", "handoff"):
                    with self._lock:
                        self._inflight[rec.seq] = p.batch_id
                    rec.dispatch_t = time.perf_counter()
                    self._consumers.dispatch(Task(rec.seq, rec.slot, p.batch_id, p.lengths))
        except BaseException as exc:
            self._fail(exc)

    def _on_message(self, msg) -> None:
        """A consumer's answer (collector thread)."""
        if isinstance(msg, Done):
            rec = self._records.get(msg.seq)
            if rec is not None:
                rec.sink_start_t, rec.sink_end_t, rec.worker = msg.sink_start, msg.sink_end, msg.worker
            batch_id = self._inflight.get(msg.seq)
            if self.on_result is not None and msg.result is not None:
                try:
                    self.on_result(batch_id, msg.result)
                except BaseException as exc:
                    self._fail(exc)
            self._finish(msg.seq, msg.slot)
        elif isinstance(msg, Skipped):
            self._finish(msg.seq, msg.slot)
        elif isinstance(msg, Failed):
            self._fail(rebuild_error(msg.payload,
                                     f"consumer {msg.worker} failed on batch {msg.batch_id!r}: {msg.summary}",
                                     f"in consumer {msg.worker}, batch {msg.batch_id!r}", msg.traceback))
        elif isinstance(msg, Ready):
            self._ready.add(msg.worker)
        elif isinstance(msg, Closed):
            self.closed_results[msg.worker] = msg.result
            if msg.close_end:
                self._closes[msg.worker] = (msg.close_start, msg.close_end)
        elif isinstance(msg, BaseException):
            self._fail(msg)

    def _finish(self, seq: int, slot: int) -> None:
        with self._lock:
            self._inflight.pop(seq, None)
            self._done += 1
            self._t_last = time.perf_counter()
            rec = self._records.get(seq)
            if rec is not None:
                rec.freed_t = self._t_last
            self._lock.notify_all()
        self._free.put(slot)

    def _consumer_died(self, w: int, p, seq: int, code: int | None) -> None:
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 \
            else f"exited with code {code}"
        with self._lock:
            batch = self._inflight.get(seq) if seq >= 0 else None
        held = f"while holding batch {batch!r} (seq {seq})" if seq >= 0 else "while idle"
        cause = ""
        if w not in self._ready and code is not None and code > 0:
            cause = "; it ended before it started (its error is printed above)"
            # the collector may report a death before the group is assigned: it imported main
            if self._consumers is None or self._consumers.imports_main:
                main = getattr(sys.modules.get("__main__"), "__file__", None) or "the main module"
                cause += (f". A spawned process imports the main module first: if {main} starts "
                          f"the run outside `if __name__ == \"__main__\":`, put it under that guard")
        self._fail(ConsumerDied(
            f"consumer {w} (pid {p.pid}) {how} {held}{cause}; the run was stopped. Outputs "
            "written before are kept; re-run to redo the rest", worker=w, exitcode=code,
            batch_id=batch))

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc
            self._failed.set()
            self._lock.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    # -- shutdown ------------------------------------------------------------------

    def _drain(self) -> None:
        """Wait until every submitted batch went through a sink (or a failure)."""
        if self._pool is None:
            return
        with self._lock:
            while self._done < self._seq and self._failure is None:
                self._lock.wait(timeout=_POLL)
        self._raise_failure()

    def _shutdown(self, abort: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is None:
            return
        try:
            if abort:
                self._consumers.drop_queued()
            self._pending.put(None)
            self._monitor.join()
            self._path.stop()  # no copy may still write into the pool
            t_stop = time.perf_counter()
            self._consumers.stop(self.config.shutdown_timeout, finished=not abort)
            self._shutdown_spans = [("engine: consumers end", t_stop, time.perf_counter())]
        finally:
            self._stats = self._make_stats()
            self._path.release()
            self._pool.close()
            self._consumers.close()

    def _make_stats(self) -> EngineStats:
        with self._lock:
            records = [r for r in self._records.values() if r.worker >= 0 or self._closed]
            wall = (self._t_last or time.perf_counter()) - self._t_first if self._t_first else 0.0
        records.sort(key=lambda r: r.seq)
        st = EngineStats.from_records(
            records, device=self.device, wall=wall,
            pinned=bool(self._pool and self._pool.pinned), num_slots=self.config.slots(),
            num_consumers=self.config.num_consumers,
            slot_bytes=self._pool.layout.slot_bytes if self._pool else 0)
        if self.cuda:  # from the first batch on: an engine started early idles until then
            measured = self._path.idle_fraction(self._t_first or 0.0, self._t_last or float("inf"))
            st.gpu_idle_fraction, st.gpu_idle_source = gpu_idle(measured, st.compute_gap_fraction)
        st.spans = self._path.spans(pool_open=self._pool is not None)
        for w, (a, b) in sorted(self._closes.items()):  # a sink's last writes: a run's tail
            st.spans.append((f"consumer {w} close", a, b))
            st.close_seconds[w] = b - a
        st.spans += self._shutdown_spans + self._host_spans
        return st


def _resolve_device(device) -> str:
    """The engine's device as a name. The engine sits below the stages and does not
    import them: jobs resolve ``--device`` values (auto, index checks, messages) with
    :func:`embedingest.stages.device.resolve_device` and pass the result; here only the
    library default (None: CUDA when torch sees a GPU) and the kind are checked."""
    if device is None:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    name = str(device)
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA GPU; use device='cpu'")
        return name
    if name != "cpu":
        raise ConfigError(f"device {name!r} is not supported; use 'cuda', 'cuda:N' or 'cpu'")
    return name
