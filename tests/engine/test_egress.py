"""The egress engine on CPU: delivery, back-pressure, errors, shutdown, statistics."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import numpy as np
import pytest
import torch
from conftest import child_pids
from fault_helpers import wait_for
from engine_sinks import (ExitingSinkFactory, FailingSinkFactory, GateSinkFactory, HashSinkFactory,
                          SlowCloseSinkFactory, SuicideSinkFactory, broken_factory, digest, slow_sink_factory,
                          two_part_error_sink_factory, unpicklable_close_factory, whoami_sink_factory)

from embedingest import EgressEngine
from embedingest.engine import consumer_group
from embedingest.errors import ConfigError, ConsumerDied, EngineError, RemoteTraceback


def make_batch(rng, n, dtype=np.float32):
    return {"x": rng.standard_normal((n, 3, 5)).astype(dtype),
            "ids": np.arange(n, dtype=np.int64) + rng.integers(0, 1 << 40)}


def run_engine(batches, **kw):
    results = []
    with EgressEngine(kw.pop("factory", HashSinkFactory()), device="cpu",
                      on_result=lambda b, r: results.append((b, r)), **kw) as engine:
        for bid, b in batches:
            engine.submit(bid, b)
    return engine, results


def test_every_batch_reaches_one_consumer_bit_exact(no_leaks):
    rng = np.random.default_rng(0)
    sizes = [16, 16, 5, 16, 1, 0, 16, 9]
    batches = [(i, make_batch(rng, n)) for i, n in enumerate(sizes)]
    engine, results = run_engine(batches, factory=HashSinkFactory(delays=(0.0, 0.03, 0.0)),
                                 num_consumers=3, num_slots=2)
    got = {}
    for bid, (worker, d) in results:
        assert bid not in got, f"batch {bid} delivered twice"
        got[bid] = d
    assert got == {bid: digest(b) for bid, b in batches}
    closed = [c for c in engine.closed_results if c]
    assert sum(c["count"] for c in closed) == len(batches)
    st = engine.stats
    assert st.batches == len(batches)
    assert st.bytes == sum(a.nbytes for _, b in batches for a in b.values())
    assert sum(st.batches_per_worker.values()) == len(batches)
    assert not st.pinned and st.gpu_idle_fraction is None


def test_torch_tensors_and_single_tensor_output(no_leaks):
    g = torch.Generator().manual_seed(1)
    outs = [torch.randn(4, 7, generator=g) for _ in range(3)] + [torch.randn(2, 7, generator=g)]
    engine, results = run_engine(list(enumerate(outs)), num_consumers=2)
    got = {bid: d for bid, (_, d) in results}
    assert got == {i: digest({"out": t.numpy()}) for i, t in enumerate(outs)}


@pytest.mark.parametrize("dtype, bits, host", [(torch.bfloat16, torch.int16, "uint16"),
                                               (torch.float8_e4m3fn, torch.uint8, "uint8"),
                                               (torch.float8_e5m2, torch.uint8, "uint8")])
def test_types_without_a_numpy_twin_arrive_as_raw_bits(no_leaks, dtype, bits, host):
    """bfloat16 and float8 travel as unsigned integers of their width (float8 on a CPU
    engine failed: ``TypeError: Got unsupported ScalarType``)."""
    t = torch.randn(3, 4).to(dtype)
    engine, results = run_engine([(0, {"h": t})], num_consumers=1)
    (_, (_, d)), = results
    assert d["h"][1] == host
    assert d == digest({"h": t.view(bits).numpy().view(host)})


def test_back_pressure_bounds_memory_to_the_slots(no_leaks):
    rng = np.random.default_rng(2)
    batches = [(i, make_batch(rng, 8)) for i in range(12)]
    engine, _ = run_engine(batches, factory=HashSinkFactory(delays=(0.05,)),
                           num_consumers=2, num_slots=3)
    recs = engine.stats.records
    assert len(recs) == 12
    assert {r.slot for r in recs} <= {0, 1, 2}
    # a slot is refilled only after the consumer that read it returned
    for slot in {r.slot for r in recs}:
        uses = sorted((r for r in recs if r.slot == slot), key=lambda r: r.seq)
        for a, b in zip(uses, uses[1:]):
            assert b.slot_t >= a.sink_end_t, f"slot {slot} reused while still being read"
            assert b.slot_t >= a.freed_t >= a.sink_end_t
    # never more batches between 'slot taken' and 'sink done' than there are slots
    events = sorted([(r.slot_t, 1) for r in recs] + [(r.sink_end_t, -1) for r in recs])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak <= 3
    assert engine.stats.producer_blocked_seconds > 0.1


def test_slots_sized_from_first_batch_and_larger_is_refused(no_leaks):
    with pytest.raises(ConfigError, match=r"has 9 rows but a slot holds at most 8"):
        with EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu") as e:
            e.submit(0, {"x": np.zeros((8, 2), np.float32)})
            e.submit(1, {"x": np.zeros((9, 2), np.float32)})


@pytest.mark.parametrize("bad, match", [
    ({"x": np.zeros((2, 3), np.float32)}, r"shape \(2, 3\)"),
    ({"x": np.zeros((2, 2), np.float64)}, r"dtype float64"),
    ({"y": np.zeros((2, 2), np.float32)}, r"arrays \['y'\]"),
])
def test_mismatched_batches_name_the_difference(no_leaks, bad, match):
    with pytest.raises(ConfigError, match=match):
        with EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu") as e:
            e.submit(0, {"x": np.zeros((4, 2), np.float32)})
            e.submit(1, bad)


@pytest.mark.parametrize("first, match", [
    ({"x": [1, 2, 3]}, r"^output 'x' is a list; submit a torch tensor or a numpy array \(or a dict of them\)$"),
    (7.5, r"^output 'out' is a float; submit a torch tensor"),
    ({"x": np.array([{"a": 1}, None], dtype=object)},
     r"^array 'x' holds Python objects \(dtype object\), which cannot be copied to another process"),
    ({1: np.zeros(3, np.float32)}, r"^output name 1 is of type int; name outputs with text \(e.g. '1'\)$"),
])
def test_what_is_not_an_array_of_values_is_refused_by_name(no_leaks, first, match):
    """A list (no shape) or an array of Python objects (pointers, meaningless in a consumer
    process) as a first batch: refused naming the output, before any slot is made."""
    with pytest.raises(ConfigError, match=match):
        with EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu") as e:
            e.submit(0, first)


def test_a_batch_id_that_does_not_pickle_is_named(no_leaks):
    """A lock or a lambda as batch id failed with pickle's own words, naming neither."""
    import threading

    with pytest.raises(ConfigError, match=r"^batch_id <unlocked _thread.lock object at .*> does not pickle \(TypeError: "
                                          r".*\), and it goes to the consumer processes with its batch: give text, a "
                                          r"number, or a tuple of them$"):
        with EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu") as e:
            e.submit(threading.Lock(), {"x": np.zeros(3, np.float32)})


def test_a_close_result_that_cannot_be_sent_back_is_named(no_leaks):
    """Before: 'ConsumerDied: consumer 0 ... exited with code 1 while idle', the pickling
    error only on the consumer's stderr."""
    with pytest.raises(EngineError, match=r"the sink's close\(\) in consumer 0 returned a lock, which cannot "
                                          r"be sent back to the engine \(TypeError: "):
        with EgressEngine(unpicklable_close_factory, num_consumers=1, device="cpu") as e:
            e.submit(0, {"x": np.zeros((2, 3), np.float32)})


def test_a_first_batch_of_no_rows_is_refused_by_name(no_leaks):
    """The slots are sized from the first batch: one of 0 rows made every slot hold 0 rows,
    and every later batch was refused."""
    with pytest.raises(ConfigError, match=r"^the first batch's 'x' has 0 rows, and the slots are sized from "
                                          r"the first batch: submit one with rows first, or give slot_spec$"):
        with EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu") as e:
            e.submit(0, {"x": np.zeros((0, 3), np.float32)})


@pytest.mark.parametrize("kwargs, match", [
    ({"num_consumers": "2"}, r"^num_consumers='2': must be an integer$"),
    ({"num_consumers": 2.5}, r"^num_consumers=2.5: must be an integer$"),
    ({"num_consumers": True}, r"^num_consumers=True: must be an integer$"),
    ({"num_consumers": 10**11}, r"^num_consumers=100000000000: at most 1024 consumer processes$"),
    ({"num_slots": 1.5}, r"^num_slots=1.5: must be an integer$"),
])
def test_engine_settings_of_the_wrong_kind_are_refused_by_name(kwargs, match):
    """Before: bare TypeErrors from the pool, True taken as one consumer, a MemoryError."""
    with pytest.raises(ConfigError, match=match):
        EgressEngine(HashSinkFactory(), device="cpu", **kwargs)
    assert EgressEngine(HashSinkFactory(), device="cpu", num_consumers=np.int64(2)).config.num_consumers == 2


def test_an_engine_stopped_before_use_cannot_be_entered(no_leaks):
    """stop() on an engine never started, then a with block: the block started consumers
    and a pool that nothing stopped (submit said 'outside the with block')."""
    engine = EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu",
                          slot_spec={"x": ((4, 2), "float32")})
    engine.stop()
    with pytest.raises(EngineError, match=r"^this engine was stopped"):
        with engine:
            pass


def test_a_submit_from_a_second_thread_is_refused(no_leaks):
    """Submits from several threads at once raced (a consumer reported dead holding the
    last batch, or a hang): batches come from one thread, a second one is told so."""
    rng = np.random.default_rng(9)
    errors = []
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu") as e:
        e.submit(0, make_batch(rng, 4))

        def other():
            try:
                e.submit(1, make_batch(rng, 4))
            except EngineError as exc:
                errors.append(str(exc))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        e.submit(2, make_batch(rng, 4))
    assert errors == ["submit() from a second thread: an engine takes its batches from one thread (the one "
                      "that submitted first); hand the outputs to it, e.g. through a queue.Queue"]
    assert e.stats.batches == 2


def test_declared_slot_spec_allows_any_batch_up_to_it(no_leaks):
    rng = np.random.default_rng(3)
    spec = {"x": ((32, 3, 5), "float32"), "ids": ((32,), "int64")}
    batches = [(i, make_batch(rng, n)) for i, n in enumerate([3, 32, 17])]
    engine, results = run_engine(batches, num_consumers=2, slot_spec=spec)
    assert {b: d for b, (_, d) in results} == {b: digest(x) for b, x in batches}
    assert engine.stats.slot_bytes >= 32 * 15 * 4


def test_sink_exception_reaches_caller_with_traceback(no_leaks):
    """The sink's error stops the producer at a later ``submit`` (it does not go on to
    its end), with the consumer's traceback as the cause."""
    submitted = 0
    with pytest.raises(OSError) as info:
        with EgressEngine(FailingSinkFactory(bad=3), num_consumers=2, device="cpu") as e:
            for i in range(10_000):  # 50 s at least: the failure is seen long before
                e.submit(i, {"x": np.full((4,), i, np.float32)})
                submitted += 1
                time.sleep(0.005)
    assert 3 < submitted < 10_000
    assert info.value.errno == errno.ENOSPC
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert re.match(r"in consumer [01], batch 3:\nTraceback ", cause.tb), cause.tb[:80]
    assert "engine_sinks.py" in cause.tb and "batch 3" in cause.tb


def test_a_sink_error_that_does_not_unpickle_is_raised_as_an_engine_error(no_leaks):
    """The sink's exception pickles but cannot be re-made here: an EngineError says which
    consumer failed on which batch with what, the consumer's traceback as its cause."""
    with pytest.raises(EngineError) as info:
        with EgressEngine(two_part_error_sink_factory, num_consumers=1, device="cpu") as e:
            e.submit("b0", {"x": np.zeros(3, np.float32)})
    assert type(info.value) is EngineError
    assert str(info.value) == "consumer 0 failed on batch 'b0': TwoPartError: disk gone at batch b0"
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert cause.tb.startswith("in consumer 0, batch 'b0':\nTraceback ") and "TwoPartError" in cause.tb


@pytest.mark.parametrize("what", [SystemExit(0), SystemExit(7), KeyboardInterrupt()])
def test_a_sink_that_exits_or_is_interrupted_fails_the_run_and_does_not_end_the_caller(no_leaks, what):
    """Re-raised as it was, a sink's ``sys.exit(0)`` ended the caller's script with status 0
    and not a word (two of five batches written); a KeyboardInterrupt looked like Ctrl-C."""
    with pytest.raises(EngineError) as info:
        with EgressEngine(ExitingSinkFactory(what), num_consumers=1, device="cpu") as e:
            for i in range(5):
                e.submit(i, {"x": np.zeros(3, np.float32)})
                time.sleep(0.05)
    if isinstance(info.value, ConsumerDied):  # the exit seen before its message: named so too
        assert re.match(r"consumer 0 \(pid \d+\) exited with code \d+ while holding batch 1 ", str(info.value))
    else:
        assert type(info.value) is EngineError
        assert str(info.value) == (f"consumer 0 failed on batch 1: {type(what).__name__}: {what} (an exit or "
                                   "interrupt in consumer 0, batch 1 is an error of the run, not an exit of this "
                                   "process)")
        assert isinstance(info.value.__cause__, RemoteTraceback)


def test_error_in_sink_factory_is_raised(no_leaks):
    with pytest.raises(ValueError, match="cannot open the output store for worker"):
        with EgressEngine(broken_factory, num_consumers=2, device="cpu") as e:
            for i in range(50):
                e.submit(i, {"x": np.zeros(3, np.float32)})
                time.sleep(0.02)


def test_killed_consumer_is_detected_and_named(no_leaks):
    """The death stops the run at a later ``submit``: the producer does not go on to its
    end (the slots the dead consumer held never come back, so it cannot run far ahead,
    however slowly the machine starts the consumers)."""
    submitted = 0
    with pytest.raises(ConsumerDied) as info:
        with EgressEngine(SuicideSinkFactory(bad=5), num_consumers=3, device="cpu") as e:
            for i in range(20_000):  # 40 s at least: the death is seen long before
                e.submit(i, {"x": np.zeros((2, 2), np.float32)})
                submitted += 1
                time.sleep(0.002)
    assert 5 < submitted < 20_000
    err = info.value
    assert err.exitcode == -signal.SIGKILL
    assert err.batch_id == 5
    assert f"consumer {err.worker}" in str(err) and "SIGKILL" in str(err) and "batch 5" in str(err)


def test_consumers_are_named_daemon_processes(no_leaks):
    """The name is how the fault hooks and the process listings find a consumer; daemon,
    so a process that exits without stopping them does not wait for them at exit."""
    seen = []
    with EgressEngine(whoami_sink_factory, num_consumers=2, device="cpu",
                      on_result=lambda batch_id, value: seen.append(value)) as e:
        for i in range(8):
            e.submit(i, {"x": np.zeros(2, np.float32)})
        collectors = [t for t in threading.enumerate() if t.name == "embedingest-collector"]
        assert len(collectors) == 1 and collectors[0].daemon
        monitors = [t for t in threading.enumerate() if t.name == "embedingest-monitor"]
        assert len(monitors) == 1 and monitors[0].daemon
    assert set(seen) == {("embedingest-consumer-0", True), ("embedingest-consumer-1", True)}


def test_a_sink_factory_that_cannot_be_pickled_is_refused_saying_why(no_leaks):
    local = lambda worker: None  # noqa: E731 - a lambda cannot be pickled for a spawned process
    with pytest.raises(EngineError, match=r"^cannot start consumer 0: .*; the sink factory must be "
                                          r"picklable \(a top-level function or class\)$"):
        with EgressEngine(local, num_consumers=2, device="cpu") as e:
            e.submit(0, {"x": np.zeros(2, np.float32)})


def test_a_consumer_that_cannot_start_stops_those_started_before_it(no_leaks, monkeypatch):
    """Consumer 0 starts, consumer 1 cannot (its factory does not pickle): the error says
    so, and consumer 0 is stopped, not left running (``no_leaks`` counts the children).
    Two pickles pass: the first is the check whether the consumers need the main script."""
    from engine_sinks import PicklesOnce

    monkeypatch.setattr(PicklesOnce, "allowed", 2)
    with pytest.raises(EngineError, match=r"^cannot start consumer 1: cannot pickle this factory twice"):
        with EgressEngine(PicklesOnce(), num_consumers=3, device="cpu") as e:
            e.submit(0, {"x": np.zeros(2, np.float32)})  # no_leaks: consumer 0 was stopped


def test_a_consumer_killed_while_idle_fails_the_run(no_leaks):
    """Killed with no batch in hand, its sink never closed (its shard never committed):
    the run must fail, naming it, not end as if all was written."""
    with pytest.raises(ConsumerDied, match=r"consumer 1 \(pid \d+\) was killed by SIGKILL while idle") as info:
        with EgressEngine(HashSinkFactory(), num_consumers=2, device="cpu") as e:
            e.submit(0, {"x": np.zeros(2, np.float32)})
            e.flush()
            os.kill(e._consumers.procs[1].pid, signal.SIGKILL)  # the engine reaps it (no second join here)
    assert info.value.worker == 1 and info.value.exitcode == -signal.SIGKILL


def test_caller_exception_stops_consumers_and_propagates(no_leaks):
    with pytest.raises(KeyError, match="boom"):
        with EgressEngine(slow_sink_factory, num_consumers=2, device="cpu") as e:
            for i in range(5):
                e.submit(i, {"x": np.zeros(3, np.float32)})
            raise KeyError("boom")


def test_a_close_slower_than_the_shutdown_timeout_still_completes_at_a_normal_end(
        tmp_path, no_leaks, monkeypatch, caplog):
    """``shutdown_timeout`` is for runs stopped early. At a normal end every sink's close
    runs to its end (the last commit of a large shard on a slow disk): a deadline there
    cut the close with SIGTERM, and the run reported success with that shard lost. The
    wait says which consumer it is for (here every 0.5 s), so a close that never ends
    shows."""
    monkeypatch.setattr(consumer_group, "_CLOSE_NOTE", 0.5)
    with EgressEngine(SlowCloseSinkFactory(2.0, str(tmp_path / "c")), num_consumers=2,
                      device="cpu", shutdown_timeout=0.2) as e:
        for i in range(6):
            e.submit(i, {"x": np.full((4,), i, np.float32)})
    assert sorted(r["worker"] for r in e.closed_results) == [0, 1]
    assert sum(r["count"] for r in e.closed_results) == 6
    notes = [m for m in caplog.messages if m.startswith("waiting for consumer")]
    assert notes, caplog.messages
    assert all(re.fullmatch(r"waiting for consumer [01] \(pid \d+\) to close its sink: [0-9] s so far", m)
               for m in notes), notes


def test_every_consumer_s_close_is_waited_for_not_only_the_first(tmp_path, no_leaks, caplog):
    """Consumer 0 closes at once, consumer 1 takes 2 s: the wait goes on to consumer 1
    (its close is not cut by the 0.2-s timeout after consumer 0 is done), and says
    nothing, being shorter than the 30 s between notes (the collector thread reaping a
    consumer at the same moment made the wait log a note after a second)."""
    with EgressEngine(SlowCloseSinkFactory((0.0, 2.0), str(tmp_path / "c")), num_consumers=2,
                      device="cpu", shutdown_timeout=0.2) as e:
        for i in range(4):
            e.submit(i, {"x": np.full((4,), i, np.float32)})
    assert [r["worker"] for r in e.closed_results] == [0, 1]
    assert not [m for m in caplog.messages if m.startswith("waiting for consumer")]
    # each close is timed, in the stats and as a span after that consumer's last batch
    st = e.stats
    assert sorted(st.close_seconds) == [0, 1] and st.close_seconds[0] < 2.0 <= st.close_seconds[1]
    assert st.summary()["close_seconds"] == {str(w): round(v, 4) for w, v in st.close_seconds.items()}
    spans = {lane: (a, b) for lane, a, b in st.spans if lane.endswith(" close")}
    assert sorted(spans) == ["consumer 0 close", "consumer 1 close"]
    for w in (0, 1):
        a, b = spans[f"consumer {w} close"]
        assert b - a == st.close_seconds[w]
        assert a >= max(r.sink_end_t for r in st.records if r.worker == w)


def test_a_close_cut_by_sigterm_fails_the_run(tmp_path, no_leaks):
    """A consumer stopped while its sink closes (someone's SIGTERM) lost what the sink had
    not written out: the run must fail, not report the close as done."""
    marker = tmp_path / "c"
    with pytest.raises(EngineError, match="stopped .SIGTERM. while closing its sink") as info:
        with EgressEngine(SlowCloseSinkFactory(60.0, str(marker)), num_consumers=1,
                          device="cpu") as e:
            e.submit(0, {"x": np.zeros(4, np.float32)})
            e.flush()
            closing = tmp_path / "c0.closing"
            threading.Thread(target=_sigterm_when_written, args=(closing,), daemon=True).start()
    assert "consumer 0" in str(info.value)
    assert e.closed_results == [None]


def test_a_consumer_stopped_with_batches_in_hand_fails_the_run(tmp_path, no_leaks):
    """A consumer stopped by someone's SIGTERM closes its sink and exits cleanly, but the
    batch it was in and the one queued behind it never ran: the run fails naming the
    batch, instead of waiting for them for ever."""
    t0 = time.monotonic()
    with pytest.raises(ConsumerDied, match="while holding batch 0") as info:
        with EgressEngine(SlowCloseSinkFactory(60.0, str(tmp_path / "c"), hold=True),
                          num_consumers=1, num_slots=2, device="cpu") as e:
            e.submit(0, {"x": np.zeros(4, np.float32)})
            e.submit(1, {"x": np.ones(4, np.float32)})
            _sigterm_when_written(tmp_path / "c0.holding")
    assert info.value.exitcode == 0 and info.value.batch_id == 0
    assert time.monotonic() - t0 < 45  # not the 60-s sleep of a sink left to run on


def _sigterm_when_written(path) -> None:
    wait_for(path.exists, 120, what=str(path))
    os.kill(int(path.read_text()), signal.SIGTERM)


def test_submit_outside_the_block_is_an_error(no_leaks):
    e = EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu")
    with pytest.raises(EngineError, match=r"^submit\(\) outside the engine's 'with' block$"):
        e.submit(0, np.zeros(2))
    with pytest.raises(EngineError, match=r"^flush\(\) outside the engine's 'with' block$"):
        e.flush()
    with e:
        e.submit(0, np.zeros(2, np.float32))
        e.flush()
    for call in (lambda: e.submit(1, np.zeros(2, np.float32)), e.flush):  # after the block too
        with pytest.raises(EngineError, match="outside the engine's 'with' block"):
            call()


def test_caller_exception_drops_the_batches_not_yet_in_a_sink(no_leaks):
    """docs/RELIABILITY.md: on a caller's exception (or Ctrl-C) the slots not yet handed
    to a sink are dropped. Eight batches are queued behind one consumer that is still
    starting (a spawned interpreter: far longer than the eight submits); at most the one
    it may have in hand reaches its sink, not all eight."""
    with pytest.raises(KeyError, match="stop"):
        with EgressEngine(HashSinkFactory(delays=(0.2,)), num_consumers=1, num_slots=8,
                          device="cpu") as e:
            for i in range(8):
                e.submit(i, {"x": np.full((4,), i, np.float32)})
            raise KeyError("stop")
    (closed,) = e.closed_results
    assert closed is not None and closed["count"] <= 1, closed
    assert e.stats.batches == 8  # all eight were taken into slots, and their slots freed
    assert all(r.freed_t >= r.slot_t > 0 for r in e.stats.records), e.stats.records


def test_empty_run_starts_nothing(no_leaks):
    before = child_pids()
    with EgressEngine(HashSinkFactory(), num_consumers=2, device="cpu") as e:
        assert child_pids() == before, "consumers were started before the first batch"
        assert e.stats.slot_bytes == 0, "a pool was made before the first batch"
    assert child_pids() == before
    assert e.stats.batches == 0 and e.closed_results == [None, None]


CTRL_C_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np
    sys.path.insert(0, {tests!r})
    from engine_sinks import slow_sink_factory
    from embedingest import EgressEngine
    if __name__ == "__main__":
        with EgressEngine(slow_sink_factory, num_consumers=3, num_slots=4, device="cpu",
                          shutdown_timeout=60) as e:
            i = 0
            while True:
                e.submit(i, {{"x": np.zeros((64, 64), np.float32)}})
                if i == 10:
                    print("running", flush=True)
                i += 1
""")


def test_ctrl_c_stops_everything_without_waiting_out_a_timeout(tmp_path, no_leaks):
    """Ctrl-C ends the run once the batches in hand are done (measured about 2 s on two
    loaded cores). The engine's consumers get a 60-s shutdown timeout here, so a stop that
    waited for any timeout (a consumer not told to stop, one left for SIGTERM) takes
    over 60 s: the 30-s bound tells the two apart on however loaded a machine."""
    script = tmp_path / "run.py"
    script.write_text(CTRL_C_SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__))))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        kids = child_pids(proc.pid)
        assert len(kids) >= 3
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # like Ctrl-C in a terminal: the whole group
        proc.wait(timeout=90)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in proc.stderr.read()
    wait_for(lambda: not [p for p in kids if _alive(p)], 10, what="the consumers to end")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_engine_started_early_runs_its_batches_with_the_same_consumers(no_leaks):
    """start() makes the pool and the consumers before the ``with`` block; entering it then
    starts nothing more."""
    e = EgressEngine(HashSinkFactory(), num_consumers=2, device="cpu",
                     slot_spec={"x": ((8,), "float32")}).start()
    pids = [p.pid for p in e._consumers.procs]
    assert all(p.is_alive() for p in e._consumers.procs)
    with e:
        assert [p.pid for p in e._consumers.procs] == pids
        for i in range(6):
            e.submit(i, {"x": np.full((8,), i, np.float32)})
    assert e.stats.batches == 6 and sum(e.stats.batches_per_worker.values()) == 6


def test_an_engine_started_and_not_used_is_stopped(tmp_path, no_leaks):
    """The caller failed before its first batch: stop() has each consumer close its sink
    and exit."""
    e = EgressEngine(SlowCloseSinkFactory(0.0, str(tmp_path / "c")), num_consumers=2, device="cpu",
                     slot_spec={"x": ((4,), "float32")},
                     shutdown_timeout=120.0).start()  # a loaded machine may take seconds to start them
    procs = list(e._consumers.procs)
    e.stop()
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(r["worker"] for r in e.closed_results) == [0, 1]
    assert e.stats.batches == 0
    with pytest.raises(EngineError, match="outside the engine's 'with' block"):
        e.submit(0, {"x": np.zeros(4, np.float32)})


def test_start_returns_while_the_pool_is_prepared_and_the_first_batch_waits_for_it(no_leaks, monkeypatch):
    """The pool's pages are faulted in (and registered with CUDA) in a thread: start()
    returns before that is done, so the caller's own start-up (a model to the device)
    runs meanwhile; the first submit waits for it, and the batch arrives whole."""
    from embedingest.engine.pool import HostPool

    gate, touching = threading.Event(), threading.Event()
    real_touch = HostPool._touch

    def held_touch(pool):
        touching.set()
        assert gate.wait(60)
        real_touch(pool)

    monkeypatch.setattr(HostPool, "_touch", held_touch)
    results = []
    e = EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu", slot_spec={"x": ((8,), "float32")},
                     on_result=lambda b, r: results.append(r)).start()
    assert touching.wait(60) and not gate.is_set()  # start() is back, the pool not ready
    submitted = threading.Event()

    def first_batch():
        e.submit(0, {"x": np.arange(8, dtype=np.float32)})
        submitted.set()

    with e:
        worker = threading.Thread(target=first_batch, daemon=True)
        worker.start()
        assert not submitted.wait(0.2)  # waits for the pool, not for a slot
        gate.set()
        worker.join(60)
        assert submitted.is_set()
    assert [d for _, d in results] == [digest({"x": np.arange(8, dtype=np.float32)})]


def test_the_first_batch_s_wait_for_the_pool_is_not_counted_as_its_compute(no_leaks, monkeypatch):
    """The first submit waits for the pool made ahead; the batch's compute ended when
    submit was called, so its compute end is marked before that wait (after it, the
    wait would count as compute, and a GPU run's first span would include the pinning)."""
    from embedingest.engine.pool import HostPool

    gate = threading.Event()
    real_touch = HostPool._touch

    def held_touch(pool):
        assert gate.wait(60)
        real_touch(pool)

    monkeypatch.setattr(HostPool, "_touch", held_touch)
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu") as e:
        e.mark_compute_start()
        threading.Timer(0.5, gate.set).start()
        called = time.perf_counter()
        e.submit(0, {"x": np.arange(8, dtype=np.float32)})
    rec = e.stats.records[0]
    assert called <= rec.compute_end < rec.submit_t
    assert rec.submit_t - rec.compute_end > 0.3, rec


def test_a_pool_that_cannot_be_prepared_fails_the_first_submit_and_stops_cleanly(no_leaks, monkeypatch):
    """What failed in the preparing thread (here the page faults; on a GPU the
    registration, past the locked-memory limit) is raised by the first submit, as itself,
    and the engine's exit stops its consumers."""
    from embedingest.engine.pool import HostPool

    def failing_touch(pool):
        raise EngineError("cudaHostRegister of 0.00 GB failed with CUDA error 2")

    monkeypatch.setattr(HostPool, "_touch", failing_touch)
    engine = EgressEngine(HashSinkFactory(), num_consumers=2, device="cpu", slot_spec={"x": ((4,), "float32")})
    with pytest.raises(EngineError, match="cudaHostRegister of 0.00 GB failed with CUDA error 2"):
        with engine:
            engine.submit(0, {"x": np.zeros(4, np.float32)})
    assert all(not p.is_alive() for p in engine._consumers.procs)
    assert engine.stats.batches == 0


def test_start_needs_the_slot_sizes():
    with pytest.raises(ConfigError, match=r"^start\(\) needs the slots' sizes up front: give slot_spec$"):
        EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu").start()


# -- the stop paths, with copies that end late (the mutation run's tests) --------------

def _copies_end_when(engine, gated, until=None, error=None):
    """Make the copies of the batches ``gated`` end only once ``until()`` is true, or
    fail with ``error``: on the GPU a copy may still run on its stream when the run
    stops, so the monitor thread meets it after the stop; on the CPU the copy is over
    when ``submit`` returns, and this puts the GPU's case back."""
    def wait(pending):
        if pending.batch_id in gated:
            if error is not None:
                raise error
            wait_for(until, 120, what="the gate of the copies")
    engine._path.wait = wait


def test_batches_whose_copy_ends_after_the_caller_s_error_are_dropped(no_leaks):
    """Batch 0 reaches its sink; the copies of 1-4 end only once the run is stopping (the
    caller's error): they are dropped, never handed to a consumer, and their slots are
    given back (docs/RELIABILITY.md: on an error the slots not yet in a sink are dropped)."""
    got, first = [], threading.Event()

    def on_result(batch_id, value):
        got.append(batch_id)
        first.set()

    e = EgressEngine(HashSinkFactory(), num_consumers=1, num_slots=5, device="cpu", on_result=on_result)
    _copies_end_when(e, {1, 2, 3, 4}, until=lambda: e._consumers.aborting)
    with pytest.raises(KeyError, match="stop"):
        with e:
            for i in range(5):
                e.submit(i, {"x": np.full((4,), i, np.float32)})
            assert first.wait(120)
            raise KeyError("stop")
    assert got == [0]
    assert e.closed_results == [{"worker": 0, "count": 1}]
    recs = e.stats.records
    assert [r.seq for r in recs] == [0, 1, 2, 3, 4] and e.stats.batches == 5
    assert recs[0].worker == 0 and recs[0].dispatch_t >= recs[0].ready_t > 0
    for r in recs[1:]:
        assert r.worker == -1 and r.dispatch_t == 0.0, r  # never handed to a consumer
        assert r.freed_t >= r.ready_t >= r.slot_t > 0, r  # its slot given back


def test_a_batch_whose_copy_ends_after_a_failure_is_dropped(no_leaks):
    """``on_result`` fails on batch 0; the copy of batch 1 ends after that failure but
    before the run is stopped: batch 1 is dropped, not run by the sink, and the failure
    is what the block's end raises."""
    def on_result(batch_id, value):
        raise ValueError(f"no room for the result of batch {batch_id}")

    e = EgressEngine(HashSinkFactory(), num_consumers=1, num_slots=2, device="cpu", on_result=on_result)
    _copies_end_when(e, {1}, until=lambda: e._failed.is_set())
    with pytest.raises(ValueError, match=r"^no room for the result of batch 0$"):
        with e:
            e.submit(0, {"x": np.zeros(4, np.float32)})
            e.submit(1, {"x": np.ones(4, np.float32)})
            with e._lock:  # batch 1 went through the monitor: dropped, or (wrongly) run by the sink
                assert e._lock.wait_for(lambda: e._done == 2, timeout=120)
    assert e.closed_results == [{"worker": 0, "count": 1}]
    r0, r1 = e.stats.records
    assert r0.worker == 0 and r1.worker == -1 and r1.dispatch_t == 0.0 and r1.freed_t > 0


def test_an_error_of_a_copy_reaches_the_caller_and_the_closes_are_cut(tmp_path, no_leaks):
    """The monitor thread's error (here the copy of batch 1 failing) is raised at the
    block's end, and the run stops as on any error: the sink's close (60 s here) is cut
    at ``shutdown_timeout``, not waited for as at a normal end."""
    e = EgressEngine(SlowCloseSinkFactory(60.0, str(tmp_path / "c")), num_consumers=1,
                     num_slots=2, device="cpu", shutdown_timeout=1.0)
    _copies_end_when(e, {1}, error=RuntimeError("the copy of batch 1 failed"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^the copy of batch 1 failed$"):
        with e:
            e.submit(0, {"x": np.zeros(4, np.float32)})
            e.submit(1, {"x": np.ones(4, np.float32)})
    assert time.monotonic() - t0 < 45  # not the 60-s close
    assert e.closed_results == [None]  # the close was stopped by SIGTERM


def test_stop_cuts_a_slow_close_at_the_shutdown_timeout(tmp_path, no_leaks):
    """stop() is a run stopped early: each sink's close (60 s here) gets
    ``shutdown_timeout``, then SIGTERM; the consumers exit cleanly (status 0) with their
    closes reported as not done."""
    e = EgressEngine(SlowCloseSinkFactory(60.0, str(tmp_path / "c")), num_consumers=2, device="cpu",
                     slot_spec={"x": ((4,), "float32")}, shutdown_timeout=1.0).start()
    wait_for(lambda: e._ready == {0, 1}, 120, what="the consumers to start")
    procs = list(e._consumers.procs)
    t0 = time.monotonic()
    e.stop()
    assert time.monotonic() - t0 < 45  # not the 60-s closes
    assert [p.exitcode for p in procs] == [0, 0]
    assert e.closed_results == [None, None]
    assert (tmp_path / "c0.closing").exists() and (tmp_path / "c1.closing").exists()


class _Dead:
    pid = 4242


def _died(ready, w, seq, code, inflight=None, imports_main=None):
    """``EgressEngine._consumer_died`` on a stand-in engine: the error it reports
    (``imports_main``: its consumers', None: no group yet)."""
    failures = []
    stub = type("Stub", (), {})()
    stub._lock, stub._inflight, stub._ready = threading.Condition(), inflight or {}, set(ready)
    stub._consumers = None if imports_main is None else types.SimpleNamespace(imports_main=imports_main)
    stub._fail = failures.append
    EgressEngine._consumer_died(stub, w, _Dead(), seq, code)
    (err,) = failures
    assert isinstance(err, ConsumerDied)
    return err


def test_a_consumer_that_ends_before_it_started_points_at_the_main_module_guard(monkeypatch):
    """A consumer that exits with an error status before its Ready (the spawned process
    failed importing the main script) is named with the likely cause, word for word."""
    end = "; the run was stopped. Outputs written before are kept; re-run to redo the rest"
    guard = ("; it ended before it started (its error is printed above). A spawned process "
             "imports the main module first: if {} starts the run outside "
             "`if __name__ == \"__main__\":`, put it under that guard")
    main = type(sys)("__main__")
    main.__file__ = "/jobs/run.py"
    monkeypatch.setitem(sys.modules, "__main__", main)
    err = _died({0}, 1, -1, 1)
    assert str(err) == "consumer 1 (pid 4242) exited with code 1 while idle" + guard.format("/jobs/run.py") + end
    assert (err.worker, err.exitcode, err.batch_id) == (1, 1, None)
    del main.__file__  # an interactive session: no file
    assert str(_died((), 0, -1, 2)) == ("consumer 0 (pid 4242) exited with code 2 while idle"
                                        + guard.format("the main module") + end)
    # started (its Ready came), killed, or a clean exit: no such cause
    assert str(_died((), 1, -1, 1, imports_main=True)) == ("consumer 1 (pid 4242) exited with code 1 while "
                                                           "idle" + guard.format("the main module") + end)
    # consumers that never imported the main script: the guard is no cause
    assert str(_died((), 1, -1, 1, imports_main=False)) == (
        "consumer 1 (pid 4242) exited with code 1 while idle; it ended before it started (its error "
        "is printed above)" + end)
    assert str(_died({1}, 1, -1, 1)) == "consumer 1 (pid 4242) exited with code 1 while idle" + end
    assert str(_died((), 1, -1, -9)) == "consumer 1 (pid 4242) was killed by SIGKILL while idle" + end
    assert str(_died((), 1, -1, 0)) == "consumer 1 (pid 4242) exited with code 0 while idle" + end
    assert str(_died((), 1, -1, None)) == "consumer 1 (pid 4242) exited with code None while idle" + end
    err = _died({0}, 0, 0, 0, inflight={0: "batch-a"})
    assert str(err) == "consumer 0 (pid 4242) exited with code 0 while holding batch 'batch-a' (seq 0)" + end
    assert (err.worker, err.exitcode, err.batch_id) == (0, 0, "batch-a")


def test_the_stats_during_and_after_a_run_hold_its_own_figures(no_leaks):
    """A snapshot in the block counts every batch a sink finished, whichever consumer ran
    it; the wall time runs from the first submit to the last slot freed; the summary after
    the block is final (made once); the stage spans, the host spans and the closes are in
    its spans."""
    from embedingest.engine.layout import SlotLayout

    e = EgressEngine(HashSinkFactory(delays=(0.0, 0.01)), num_consumers=2, num_slots=3, device="cpu")
    with e:
        for i in range(6):
            with e.span("h2d"):
                batch = {"x": np.full((4,), i, np.float32)}
            e.submit(i, batch)
        e.flush()
        st = e.stats
        assert st.batches == 6 and [r.seq for r in st.records] == list(range(6))
        assert set(st.batches_per_worker) == {0, 1} and sum(st.batches_per_worker.values()) == 6
        assert st.wall_seconds == max(r.freed_t for r in st.records) - st.records[0].submit_t > 0
        assert e._inflight == {}  # no batch id kept once its slot is back
        e.host_span("wait for input", 1.5, 2.25)
    final = e.stats
    assert final is e.stats
    assert final.wall_seconds == st.wall_seconds  # no batch since the snapshot
    assert (final.device, final.pinned, final.num_slots, final.num_consumers) == ("cpu", False, 3, 2)
    assert final.slot_bytes == SlotLayout.from_spec({"x": ((4,), np.float32)}).slot_bytes > 0
    lanes = [lane for lane, _, _ in final.spans]
    assert lanes == ["h2d"] * 6 + ["consumer 0 close", "consumer 1 close", "engine: consumers end",
                                   "wait for input"]
    assert final.spans[-1] == ("wait for input", 1.5, 2.25)
    t_stop, t_end = final.spans[-2][1:]
    assert max(r.freed_t for r in final.records) <= t_stop <= t_end


def test_the_stats_of_an_engine_given_no_batch():
    e = EgressEngine(HashSinkFactory(), num_consumers=2, device="cpu")
    with e:
        pass
    st = e.stats
    assert (st.batches, st.wall_seconds, st.slot_bytes, st.num_slots, st.num_consumers) == (0, 0.0, 0, 4, 2)
    assert st.spans == [] and st.records == []


def test_the_engine_s_defaults_and_the_settings_it_refuses():
    """Nothing is started by the constructor, so these need no processes."""
    e = EgressEngine(HashSinkFactory(), device="cpu")
    c = e.config
    assert (c.num_consumers, c.num_slots, c.shutdown_timeout, c.pin_memory) == (4, 0, 5.0, True)
    assert c.slots() == 8 and e.closed_results == [None] * 4
    e = EgressEngine(HashSinkFactory(), num_consumers=1, num_slots=1, device="cpu", shutdown_timeout=0.5,
                     pin_memory=False)
    c = e.config
    assert (c.num_consumers, c.num_slots, c.shutdown_timeout, c.pin_memory, c.slots()) == (1, 1, 0.5, False, 1)
    assert EgressEngine(HashSinkFactory(), num_consumers=2, num_slots=3, device="cpu").config.slots() == 3
    with pytest.raises(ConfigError, match=r"^num_consumers=0: need at least 1 consumer process$"):
        EgressEngine(HashSinkFactory(), num_consumers=0, device="cpu")
    with pytest.raises(ConfigError, match=r"^num_slots=-1: need at least 1 slot$"):
        EgressEngine(HashSinkFactory(), num_consumers=1, num_slots=-1, device="cpu")


def test_the_device_by_name(monkeypatch):
    """The library default is CUDA where torch sees a GPU; names are checked, not guessed.
    (CUDA is made to look available: the constructor touches no GPU.)"""
    from embedingest.engine.copy_paths import CudaCopyPath, HostCopyPath

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    e = EgressEngine(HashSinkFactory(), device=None)
    assert (e.device, e.cuda, type(e._path), e._path.device) == ("cpu", False, HostCopyPath, "cpu")
    with pytest.raises(ConfigError, match=r"^device 'cuda:1' asked for, but torch sees no CUDA GPU; "
                                          r"use device='cpu'$"):
        EgressEngine(HashSinkFactory(), device="cuda:1")
    with pytest.raises(ConfigError, match=r"^device 'tpu' is not supported; use 'cuda', 'cuda:N' or 'cpu'$"):
        EgressEngine(HashSinkFactory(), device="tpu")
    assert EgressEngine(HashSinkFactory(), device=torch.device("cpu")).device == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    e = EgressEngine(HashSinkFactory(), device=None)
    assert (e.device, e.cuda, type(e._path), e._path.device) == ("cuda", True, CudaCopyPath, "cuda")
    e = EgressEngine(HashSinkFactory(), device="cuda:1")
    assert (e.device, e.cuda, type(e._path), e._path.device) == ("cuda:1", True, CudaCopyPath, "cuda:1")
    e = EgressEngine(HashSinkFactory(), device="cpu")  # asked for, though a GPU is there
    assert (e.device, e.cuda, type(e._path), e._path.device) == ("cpu", False, HostCopyPath, "cpu")


def test_an_engine_made_while_a_spawned_process_imports_the_main_module_is_refused(monkeypatch):
    """A script without the ``__main__`` guard would start its run again in every consumer
    it spawns: the engine made during that import says what to do, word for word."""
    import multiprocessing

    said = ("EgressEngine() was called while a process it started was importing {}: put the code "
            "that calls it under `if __name__ == \"__main__\":` (consumer processes are spawned, "
            "and a spawned process imports the main module first)")
    main = type(sys)("__mp_main__")
    main.__file__ = "/jobs/run.py"
    monkeypatch.setitem(sys.modules, "__mp_main__", main)
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(ConfigError) as info:
        EgressEngine(HashSinkFactory(), device="cpu")
    assert str(info.value) == said.format("/jobs/run.py")
    monkeypatch.delitem(sys.modules, "__mp_main__")
    with pytest.raises(ConfigError) as info:
        EgressEngine(HashSinkFactory(), device="cpu")
    assert str(info.value) == said.format("the main module")
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", False)
    assert EgressEngine(HashSinkFactory(), device="cpu").device == "cpu"
    monkeypatch.delattr(multiprocessing.current_process(), "_inheriting")
    assert EgressEngine(HashSinkFactory(), device="cpu").device == "cpu"


def test_flush_returns_once_every_batch_went_through_a_sink(no_leaks):
    """Each batch takes its sink 0.2 s: flush() returns only once all of them were
    answered, at every call."""
    got = []
    with EgressEngine(HashSinkFactory(delays=(0.2,)), num_consumers=1, num_slots=4, device="cpu",
                      on_result=lambda b, r: got.append(b)) as e:
        for i in range(3):
            e.submit(i, {"x": np.full((4,), i, np.float32)})
        e.flush()
        assert got == [0, 1, 2]
        e.submit(3, {"x": np.full((4,), 3, np.float32)})
        e.flush()
        assert got == [0, 1, 2, 3]


def test_batches_a_consumer_holds_when_the_run_stops_are_handed_back_unrun(tmp_path, no_leaks):
    """Batches 1-3 wait in the consumer's queue behind batch 0 when the caller fails: the
    consumer finishes batch 0, then hands the other three back without running the sink;
    their slots are freed and the consumer closes its sink normally."""
    marker = str(tmp_path / "g")
    got = []
    with pytest.raises(KeyError, match="stop"):
        with EgressEngine(GateSinkFactory(marker), num_consumers=1, num_slots=4, device="cpu",
                          on_result=lambda b, r: got.append(r)) as e:
            for i in range(4):
                e.submit(i, {"x": np.full((4,), i, np.float32)})
            wait_for(lambda: os.path.exists(marker + ".holding") and len(e._inflight) == 4, 120,
                     what="batch 0 in the sink and 1-3 handed to the consumer")

            def open_the_gate_once_stopping():
                wait_for(lambda: e._consumers.aborting, 120, what="the stop")
                open(marker + ".go", "w").close()

            threading.Thread(target=open_the_gate_once_stopping, daemon=True).start()
            raise KeyError("stop")
    assert got == [0]
    assert e.closed_results == [{"worker": 0, "count": 1}]
    recs = e.stats.records
    assert [r.worker for r in recs] == [0, -1, -1, -1]
    for r in recs:
        assert r.dispatch_t > 0 and r.freed_t >= r.dispatch_t, r  # handed over, then given back
