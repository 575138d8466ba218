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
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import numpy as np

from ..config import EngineConfig
from ..errors import ConfigError, ConsumerDied, EngineError, rebuild_error
from .consumers import consumer_main
from .layout import SlotLayout
from .gpu_monitor import UtilizationSampler, gpu_idle
from .markers import annotate
from .pool import HostPool
from .telemetry import BatchRecord, EngineStats

SinkFactory = Callable[[int], Callable]
_POLL = 0.1  # seconds between checks for failures while blocked


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "is_cuda")


def _host_array(x) -> np.ndarray:
    """A numpy view (or copy, for device tensors on a CPU engine) of a CPU array."""
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.cpu().view(torch.int16).numpy().view(np.uint16)
        return x.cpu().numpy()
    return np.asarray(x)


@dataclass
class _Pending:
    record: BatchRecord
    batch_id: object
    lengths: dict[str, int]
    done_event: object = None  # CUDA event recorded after the copy
    timing: tuple = ()  # (compute_start, compute_end, copy_start) events
    keep: list = field(default_factory=list)  # device tensors alive until the copy ends


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
        shutdown_timeout: seconds consumers get to close their sinks when stopping.
        on_result: ``callback(batch_id, value)`` for values sinks return, called in a
            background thread of this process.
    """

    def __init__(self, sink_factory: SinkFactory, *, num_consumers: int = 4,
                 num_slots: int | None = None, device=None,
                 slot_spec: Mapping[str, tuple] | None = None, pin_memory: bool = True,
                 shutdown_timeout: float = 5.0,
                 on_result: Callable[[object, object], None] | None = None):
        if num_consumers < 1:
            raise ConfigError(f"num_consumers={num_consumers}: need at least 1 consumer process")
        self.config = EngineConfig(num_consumers=num_consumers, num_slots=num_slots or 0,
                                   shutdown_timeout=shutdown_timeout, pin_memory=pin_memory)
        if self.config.slots() < 1:
            raise ConfigError(f"num_slots={num_slots}: need at least 1 slot")
        self.sink_factory = sink_factory
        self.on_result = on_result
        self.device = _resolve_device(device)
        self.cuda = self.device.startswith("cuda")
        self._slot_spec = slot_spec
        self.closed_results: list = [None] * num_consumers
        self._pool: HostPool | None = None
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
        self._procs: list = []
        self._compute_start = None
        self._stats: EngineStats | None = None
        self._sampler: UtilizationSampler | None = None
        self._spans: list[tuple] = []

    # -- public API ----------------------------------------------------------------

    def __enter__(self) -> EgressEngine:
        self._entered = True
        if self._slot_spec is not None:
            self._open(SlotLayout.from_spec(self._slot_spec))
        return self

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
        if not self.cuda:
            self._compute_start = time.perf_counter()
            return
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._compute_start = ev

    @contextlib.contextmanager
    def span(self, lane: str, stream=None):
        """Time the work enqueued in the block (on ``stream``, CUDA) for the timeline.

        For the stages' own steps, e.g. the host-to-device prefetch: the engine draws them
        as lane ``lane`` beside its own lanes.
        """
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self._spans.append((lane, t0, time.perf_counter()))
            return
        import torch

        stream = stream or torch.cuda.current_stream(self.device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        yield
        b.record(stream)
        self._spans.append((lane, a, b))

    def submit(self, batch_id, outputs) -> None:
        """Queue ``outputs`` (a tensor, or a dict of tensors / numpy arrays) for the sinks.

        Returns as soon as the copy is enqueued; blocks only while every slot is busy.
        Raises the first failure of a consumer or of the engine's threads.
        """
        if not self._entered or self._closed:
            raise EngineError("submit() outside the engine's 'with' block")
        self._raise_failure()
        arrays = dict(outputs) if isinstance(outputs, Mapping) else {"out": outputs}
        if self._pool is None:
            self._open(SlotLayout.from_spec({k: (tuple(v.shape), v.dtype) for k, v in arrays.items()}))
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
            pending = _Pending(rec, batch_id, lengths)
            with annotate("copy", "copy"):
                t0 = time.perf_counter()
                rec.nbytes = self._copy(slot, arrays, lengths, pending)
                if not self.cuda:
                    rec.copy_start, rec.copy_end = t0, time.perf_counter()
                    rec.compute_start, rec.compute_end = self._compute_start, t_submit
                    self._compute_start = None
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

    @property
    def stats(self) -> EngineStats:
        """Run summary; final after the ``with`` block, a snapshot during it."""
        if self._stats is not None:
            return self._stats
        return self._make_stats()

    # -- set-up --------------------------------------------------------------------

    def _open(self, layout: SlotLayout) -> None:
        cfg = self.config
        self._pool = HostPool(layout, cfg.slots(), pin=self.cuda and cfg.pin_memory)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(cfg.slots()):
            self._free.put(i)
        self._pending: queue.Queue[_Pending | None] = queue.Queue()
        if self.cuda:
            self._setup_cuda(layout)
        ctx = mp.get_context("spawn")
        # Pipes and a lock-free shared flag only: no named semaphores, so nothing is
        # ever created in /dev/shm, whatever way the run ends.
        self._abort = ctx.RawArray("b", 1)
        self._conns, self._closed_ok = [], [False] * cfg.num_consumers
        self._outstanding: list[list[int]] = [[] for _ in range(cfg.num_consumers)]
        self._next_worker = 0
        handle = self._pool.handle()
        for w in range(cfg.num_consumers):
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=consumer_main, name=f"embedingest-consumer-{w}", daemon=True,
                            args=(w, self.sink_factory, handle, theirs, self._abort, os.getpid()))
            try:
                p.start()
            except Exception as exc:
                raise EngineError(f"cannot start consumer {w}: {exc}; the sink factory must "
                                  "be picklable (a top-level function or class)") from exc
            finally:
                theirs.close()
            self._procs.append(p)
            self._conns.append(mine)
        self._monitor = threading.Thread(target=self._monitor_loop, name="embedingest-monitor", daemon=True)
        self._collector = threading.Thread(target=self._collect_loop, name="embedingest-collector", daemon=True)
        self._monitor.start()
        self._collector.start()

    def _setup_cuda(self, layout: SlotLayout) -> None:
        import torch

        dev = torch.device(self.device)
        self._device_index = dev.index if dev.index is not None else torch.cuda.current_device()
        self._stream = torch.cuda.Stream(device=dev)
        self._host_tensors = []
        for i in range(self._pool.num_slots):
            views = self._pool.views(i)
            ts = {}
            for f in layout.fields:
                v = views[f.name]
                if f.source_dtype == "bfloat16":
                    ts[f.name] = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16)
                else:
                    ts[f.name] = torch.from_numpy(v)
            self._host_tensors.append(ts)
        torch.cuda.synchronize(dev)
        self._ref_event = torch.cuda.Event(enable_timing=True)
        self._ref_event.record(torch.cuda.current_stream(dev))
        self._ref_event.synchronize()
        self._ref_t = time.perf_counter()
        self._sampler = UtilizationSampler(dev).start()

    # -- producer side -------------------------------------------------------------

    def _acquire_slot(self) -> int:
        while True:
            try:
                return self._free.get(timeout=_POLL)
            except queue.Empty:
                self._raise_failure()

    def _copy(self, slot: int, arrays: dict, lengths: dict, pending: _Pending) -> int:
        nbytes = 0
        views = self._pool.views(slot)
        device_items = []
        for name, a in arrays.items():
            n = lengths[name]
            if self.cuda and _is_torch(a) and a.is_cuda:
                device_items.append((name, a, n))
                continue
            if _is_torch(a) and a.is_cuda:
                raise ConfigError(f"array {name!r} is on {a.device} but the engine runs on "
                                  f"{self.device}; build the engine with device='cuda'")
            src = _host_array(a)
            np.copyto(views[name][:n], src, casting="no")
            nbytes += src.nbytes
        if device_items:
            nbytes += self._copy_cuda(slot, device_items, pending)
        return nbytes

    def _copy_cuda(self, slot: int, items: list, pending: _Pending) -> int:
        import torch

        compute = torch.cuda.current_stream(self.device)
        end = torch.cuda.Event(enable_timing=True)
        end.record(compute)
        start_copy = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True, blocking=True)
        self._stream.wait_event(end)
        host = self._host_tensors[slot]
        nbytes = 0
        for name, t, _ in items:
            if t.device.index != self._device_index:
                raise ConfigError(f"array {name!r} is on {t.device}, the engine on "
                                  f"cuda:{self._device_index}; one engine serves one GPU")
        with torch.cuda.stream(self._stream):
            start_copy.record(self._stream)
            for name, t, n in items:
                host[name][:n].copy_(t, non_blocking=True)
                nbytes += t.numel() * t.element_size()
            done.record(self._stream)
        pending.done_event = done
        pending.timing = (self._compute_start, end, start_copy)
        pending.keep = [t for _, t, _ in items]
        self._compute_start = None
        return nbytes

    # -- background threads --------------------------------------------------------

    def _gpu_time(self, ev) -> float | None:
        if ev is None:
            return None
        return self._ref_t + self._ref_event.elapsed_time(ev) / 1e3

    def _monitor_loop(self) -> None:
        """Wait for each copy in submission order and hand the slot to the consumers."""
        try:
            while True:
                p = self._pending.get()
                if p is None:
                    return
                rec = p.record
                if p.done_event is not None:
                    with annotate("wait copy", "handoff"):
                        p.done_event.synchronize()
                    cstart, cend, copy_start = p.timing
                    rec.compute_start = self._gpu_time(cstart)
                    rec.compute_end = self._gpu_time(cend)
                    rec.copy_start = self._gpu_time(copy_start)
                    rec.copy_end = self._gpu_time(p.done_event)
                    p.keep.clear()
                rec.ready_t = time.perf_counter()
                if self._abort[0] or self._failed.is_set():
                    self._finish(rec.seq, rec.slot)
                    continue
                with annotate("handoff", "handoff"):
                    with self._lock:
                        self._inflight[rec.seq] = p.batch_id
                        w = self._pick_worker()
                        self._outstanding[w].append(rec.seq)
                    rec.dispatch_t = time.perf_counter()
                    try:
                        self._conns[w].send((rec.seq, rec.slot, p.batch_id, p.lengths))
                    except OSError:
                        self._procs[w].join(timeout=1.0)
                        self._consumer_died(w, self._procs[w])
        except BaseException as exc:
            self._fail(exc)

    def _pick_worker(self) -> int:
        """The consumer with the fewest batches outstanding, in turn among equals."""
        n = len(self._conns)
        order = [(self._next_worker + i) % n for i in range(n)]
        w = min(order, key=lambda i: len(self._outstanding[i]))
        self._next_worker = (w + 1) % n
        return w

    def _collect_loop(self) -> None:
        """Take consumer answers, free slots, and notice consumers that die."""
        alive = dict(enumerate(self._procs))
        conns = dict(enumerate(self._conns))
        while alive:
            by_obj = {c: w for w, c in conns.items()}
            by_obj.update({p.sentinel: w for w, p in alive.items()})
            try:
                ready = wait(list(by_obj), timeout=0.5)
            except OSError:
                ready = []
            for obj in ready:
                w = by_obj[obj]
                if obj in conns.values():
                    self._drain_conn(w, conns)
                elif w in alive:
                    self._drain_conn(w, conns)
                    p = alive.pop(w)
                    p.join(timeout=1.0)
                    if not self._closed_ok[w]:
                        self._consumer_died(w, p)

    def _drain_conn(self, w: int, conns: dict) -> None:
        conn = conns.get(w)
        if conn is None:
            return
        try:
            while conn.poll():
                self._handle(conn.recv())
        except (EOFError, OSError):
            conns.pop(w, None)
        except BaseException as exc:  # a message that cannot be read
            conns.pop(w, None)
            self._fail(EngineError(f"cannot read the answer of consumer {w}: {exc!r}"))

    def _handle(self, msg: tuple) -> None:
        kind, w = msg[0], msg[1]
        if kind in ("done", "skipped"):
            with self._lock:
                if msg[2] in self._outstanding[w]:
                    self._outstanding[w].remove(msg[2])
        if kind == "done":
            _, _, seq, slot, t0, t1, result = msg
            rec = self._records.get(seq)
            if rec is not None:
                rec.sink_start_t, rec.sink_end_t, rec.worker = t0, t1, w
            batch_id = self._inflight.get(seq)
            if self.on_result is not None and result is not None:
                try:
                    self.on_result(batch_id, result)
                except BaseException as exc:
                    self._fail(exc)
            self._finish(seq, slot)
        elif kind == "skipped":
            self._finish(msg[2], msg[3])
        elif kind == "error":
            _, _, seq, batch_id, payload, summary, tb = msg
            self._fail(rebuild_error(payload, f"consumer {w} failed on batch {batch_id!r}: {summary}",
                                     f"in consumer {w}, batch {batch_id!r}", tb))
        elif kind == "closed":
            self._closed_ok[w] = True
            self.closed_results[w] = msg[2]

    def _finish(self, seq: int, slot: int) -> None:
        with self._lock:
            self._inflight.pop(seq, None)
            self._done += 1
            self._t_last = time.perf_counter()
            self._lock.notify_all()
        self._free.put(slot)

    def _consumer_died(self, w: int, p) -> None:
        code = p.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 \
            else f"exited with code {code}"
        with self._lock:
            seq = self._outstanding[w][0] if self._outstanding[w] else -1
            batch = self._inflight.get(seq) if seq >= 0 else None
        held = f"while holding batch {batch!r} (seq {seq})" if seq >= 0 else "while idle"
        self._fail(ConsumerDied(
            f"consumer {w} (pid {p.pid}) {how} {held}; the run was stopped. Outputs written "
            "before are kept; re-run to redo the rest", worker=w, exitcode=code, batch_id=batch))

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
                self._abort[0] = 1
            self._pending.put(None)
            self._monitor.join()
            if self.cuda:
                self._stream.synchronize()  # no copy may still write into the pool
                self._sampler.stop()
            for c in self._conns:
                with contextlib.suppress(OSError):  # that consumer is already gone
                    c.send(None)
            self._stop_consumers(self.config.shutdown_timeout)
            self._collector.join(timeout=5.0)
        finally:
            self._stats = self._make_stats()
            self._host_tensors = []
            self._pool.close()
            for c in self._conns:
                c.close()

    def _stop_consumers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: the consumer still closes its sink
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=1.0)

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
        if self.cuda:
            st.gpu_idle_fraction, st.gpu_idle_source = gpu_idle(self._sampler, st.compute_gap_fraction)
        st.spans = [s for s in (self._resolve_span(*sp) for sp in list(self._spans)) if s]
        return st

    def _resolve_span(self, lane, a, b):
        if not self.cuda:
            return (lane, a, b)
        if self._pool is None or not (a.query() and b.query()):
            return None
        return (lane, self._gpu_time(a), self._gpu_time(b))


def _resolve_device(device) -> str:
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
