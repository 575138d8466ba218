"""The seed article's five inference loops, re-implemented as references.

Each loop is the article's method, in our own code: (1) synchronous ``.cpu()`` with the
processing in the loop; (2) plus consumer processes fed through a queue; (3) plus a
pre-allocated shared buffer pool; (4) plus "pinned" buffers made the article's way
(``pin_memory=True`` then ``share_memory_()``, which is *not* pinned), a non-blocking
copy and an event-monitor thread; (5) plus a dedicated egress stream. They let the
benchmark put embedingest's engine side by side with them in one run.
"""

from __future__ import annotations

import os
import queue
import threading

import torch
import torch.multiprocessing as tmp


def process_output(batch_id, logits: torch.Tensor) -> None:
    with open(os.devnull, "wb") as fh:
        fh.write(logits.numpy().tobytes())


def _tensor_worker(in_q) -> None:
    while True:
        item = in_q.get()
        if item is None:
            in_q.task_done()
            return
        batch_id, t = item
        process_output(batch_id, t)
        del t, item
        in_q.task_done()


def _pool_worker(pool, in_q, buf_q) -> None:
    while True:
        item = in_q.get()
        if item is None:
            in_q.task_done()
            return
        batch_id, b = item
        process_output(batch_id, pool[b])
        buf_q.put(b)
        in_q.task_done()


class SeedLoop:
    """One of the article's loops; ``step`` runs one batch, ``sync`` drains everything."""

    def __init__(self, level: int, shape: tuple, workers: int = 8):
        self.level, self.shape, self.workers = level, shape, workers
        self.ctx = tmp.get_context("spawn")
        self.procs = []
        self.pinned = False
        if level >= 2:
            self.out_q = self.ctx.JoinableQueue(maxsize=workers)
        if level == 2:
            self._start(_tensor_worker, (self.out_q,))
        if level >= 3:
            pin = level >= 4
            self.pool = [torch.empty(shape, pin_memory=pin).share_memory_() for _ in range(workers)]
            self.pinned = all(t.is_pinned() for t in self.pool)
            self.buf_q = self.ctx.Queue()
            for i in range(workers):
                self.buf_q.put(i)
            self._start(_pool_worker, (self.pool, self.out_q, self.buf_q))
        if level >= 4:
            self.events = [torch.cuda.Event() for _ in range(workers)]
            self.event_q: queue.Queue = queue.Queue()
            self.monitor = threading.Thread(target=self._monitor, daemon=True)
            self.monitor.start()
        if level >= 5:
            self.egress = torch.cuda.Stream()

    def _start(self, target, args) -> None:
        for _ in range(self.workers):
            p = self.ctx.Process(target=target, args=args, daemon=True)
            p.start()
            self.procs.append(p)

    def _monitor(self) -> None:
        while True:
            item = self.event_q.get()
            if item is None:
                self.event_q.task_done()
                return
            batch_id, b = item
            self.events[b].synchronize()
            self.out_q.put((batch_id, b))
            self.event_q.task_done()

    def step(self, batch_id, out: torch.Tensor) -> None:
        if self.level == 1:
            process_output(batch_id, out.cpu())
        elif self.level == 2:
            self.out_q.put((batch_id, out.cpu()))
        elif self.level == 3:
            b = self.buf_q.get()
            self.pool[b].copy_(out)
            self.out_q.put((batch_id, b))
        elif self.level == 4:
            b = self.buf_q.get()
            self.pool[b].copy_(out, non_blocking=True)
            self.events[b].record()
            self.event_q.put((batch_id, b))
        else:
            with torch.cuda.stream(self.egress):
                self.egress.wait_stream(torch.cuda.default_stream())
                out.record_stream(self.egress)
                b = self.buf_q.get()
                self.pool[b].copy_(out, non_blocking=True)
                self.events[b].record(self.egress)
                self.event_q.put((batch_id, b))

    def sync(self) -> None:
        torch.cuda.synchronize()
        if self.level >= 4:
            self.event_q.join()
        if self.level >= 2:
            self.out_q.join()

    def close(self) -> None:
        self.sync()
        if self.level >= 4:
            self.event_q.put(None)
            self.monitor.join()
        for _ in self.procs:
            self.out_q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self.pool = []
