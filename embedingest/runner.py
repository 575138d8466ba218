"""The batch loop every job runs on one device: build-index (:mod:`~embedingest.jobs.build_index.encode`,
in its device processes too), segment (:mod:`~embedingest.jobs.segment.run`) and the Ray
actors (:class:`~embedingest.jobs.build_index.ray.EmbedBatches`).

It sits above the stages and the engine and below the jobs. A job says what is special
about its batches (:class:`BatchSteps`: what to copy to the device, the forward and what
it hands to the engine, what to do once a batch is handed over); the loop does the rest
in the same order for all: start the egress engine, copy batch i+1 to the device while
batch i computes (:func:`~embedingest.stages.prefetch.prefetch`), report the inputs a
batch skipped, mark the compute start, forward, submit, and time each step.

The timing (the ``timing`` field of the summaries, see the README) has the same keys
for every job, in seconds: ``start_s`` (the engine's consumers started, and whatever the
job started before, from ``started``), ``first_batch_s`` (waiting for the first batch:
the loader's start-up), ``input_wait_s`` (waiting for later batches: when it is large
the CPUs that read and prepare the inputs are the bound), ``first_forward_s`` (the first
forward and its hand-over, with CUDA's lazy set-up), ``forward_submit_s`` (the others),
``close_s`` (closing the engine: the consumers' last writes). A job adds its own keys
in :attr:`BatchSteps.done`. Each wait for a batch is also an engine host span ("loop: wait
for input"), so a trace shows when in the run the loop starved.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .engine import EgressEngine
from .stages.prefetch import prefetch

LOOP_KEYS = ("start_s", "first_batch_s", "input_wait_s", "first_forward_s", "forward_submit_s",
             "close_s")

# Waits for the next batch longer than this go into the trace as spans of their own.
WAIT_SPAN_MIN = 5e-4


@dataclass
class BatchSteps:
    """What a job does with each batch (an item of its loader)."""

    # item -> its tensors on the device (non-blocking copies), or None: nothing to run.
    send: Callable[[Any], Any]
    # (batch_no, item, on_device) -> the (key, arrays) parts to submit to the engine.
    forward: Callable[[int, Any, Any], Iterable[tuple[Any, dict]]]
    # item -> (where, reason) of each input the loader skipped in it.
    skipped: Callable[[Any], Iterable[tuple[str, str]]]
    # Called once a batch is handed over: metadata, counts, progress.
    done: Callable[[Any], None] | None = None


def run_batches(sinks, batches: Iterable, steps: BatchSteps, *, device: str | torch.device,
                slot_spec: dict, num_consumers: int, num_slots: int | None,
                on_skip: Callable[[str, str], None], timing: dict | None = None,
                started: float | None = None, engine: EgressEngine | None = None):
    """Run every batch of ``batches`` through ``steps`` on ``device`` and an egress engine
    writing to ``sinks`` (a sink factory); return the closed engine (its ``stats``, its
    consumers' ``closed_results``).

    ``on_skip(where, reason)`` is told of each skipped input; ``timing`` (a dict) receives
    the loop's timing (:data:`LOOP_KEYS`), ``start_s`` counted from ``started`` (a
    ``time.perf_counter()``; default: now). The loader is closed on the way out, whatever
    stops the loop, so its workers are shut down here, not whenever it is collected.
    ``engine``: an engine for ``sinks`` made (and perhaps started) by the caller, used
    instead of a new one.
    """
    timing = timing if timing is not None else {}
    timing.update(dict.fromkeys(LOOP_KEYS, 0.0))
    t_start = time.perf_counter() if started is None else started
    if engine is None:
        engine = EgressEngine(sinks, num_consumers=num_consumers, num_slots=num_slots, device=str(device),
                              slot_spec=slot_spec)
    with engine, torch.inference_mode(), contextlib.ExitStack() as stack:
        moved_batches = stack.enter_context(
            contextlib.closing(prefetch(batches, steps.send, device, engine.span)))
        timing["start_s"] = time.perf_counter() - t_start
        first_forward = True
        for batch_no in itertools.count():
            t_wait = time.perf_counter()
            item, on_device = next(moved_batches, (None, None))
            t_got = time.perf_counter()
            timing["first_batch_s" if batch_no == 0 else "input_wait_s"] += t_got - t_wait
            if t_got - t_wait > WAIT_SPAN_MIN:
                engine.host_span("loop: wait for input", t_wait, t_got)
            if item is None:
                break
            for where, reason in steps.skipped(item):
                on_skip(where, reason)
            if on_device is not None:
                engine.mark_compute_start()
                for key, arrays in steps.forward(batch_no, item, on_device):
                    engine.submit(key, arrays)
                timing["first_forward_s" if first_forward else "forward_submit_s"] += (
                    time.perf_counter() - t_got)
                first_forward = False
            if steps.done is not None:
                steps.done(item)
        t_close = time.perf_counter()
    timing["close_s"] = time.perf_counter() - t_close
    return engine
