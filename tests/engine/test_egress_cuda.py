"""The egress engine on a CUDA GPU: pinned pool, copy rate, ordering, same result as CPU."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from cuda_helpers import busy_then_idle, cycles_per_second
from engine_sinks import HashSinkFactory, SleepySinkFactory, digest

from embedingest import EgressEngine
from embedingest.errors import ConfigError

pytestmark = pytest.mark.needs_cuda


def collect(device, batches, **kw):
    results = {}
    with EgressEngine(HashSinkFactory(), device=device,
                      on_result=lambda b, r: results.__setitem__(b, r[1]), **kw) as e:
        for bid, make in batches:
            e.submit(bid, make())
    return e, results


def test_pool_is_really_pinned_and_fast(no_leaks):
    n = 256 * 1024 * 1024 // 4  # 256 MiB of float32 a batch
    src = torch.randn(n, device="cuda")
    with EgressEngine(HashSinkFactory(), num_consumers=2, num_slots=3, device="cuda") as e:
        for i in range(8):
            e.submit(i, {"x": src})
        host = torch.from_numpy(e._pool.views(0)["x"])
        assert host.is_pinned()
    st = e.stats
    assert st.pinned
    # The ceiling of this machine, measured now: the same copy into memory pinned by
    # torch. Pageable copies reach about a quarter of it (14 against 55 GB/s on an H200).
    ceiling = copy_gbps(src, torch.empty(n, pin_memory=True))
    pageable = copy_gbps(src, torch.empty(n))
    assert st.copy_gbps > 0.6 * ceiling, (st.copy_gbps, ceiling, pageable)


def copy_gbps(src, dst, repeat: int = 5) -> float:
    """Best device-to-host rate of ``repeat`` copies of ``src`` into ``dst``."""
    best = 0.0
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = max(best, src.numel() * src.element_size() / (a.elapsed_time(b) / 1e3) / 1e9)
    return best


def test_copy_waits_for_compute_and_memory_is_not_reused_early(no_leaks):
    """Each output is produced after a long kernel and freed right after submit; the
    allocator then hands its memory to a tensor filled with -1. The sinks must still
    see exactly what was computed."""
    shape = (64, 1024, 256)
    expect = {}
    with EgressEngine(HashSinkFactory(), num_consumers=2, num_slots=2, device="cuda") as e:
        results = {}
        e.on_result = lambda b, r: results.__setitem__(b, r[1])
        for i in range(10):
            torch.cuda._sleep(20_000_000)
            out = torch.full(shape, float(i), device="cuda")
            e.submit(i, {"x": out})
            del out
            junk = torch.empty(shape, device="cuda")
            junk.fill_(-1.0)
            expect[i] = digest({"x": np.full(shape, float(i), np.float32)})
            del junk
    assert results == expect


def test_gpu_result_equals_cpu_result(no_leaks):
    g = torch.Generator().manual_seed(7)
    data = [torch.randn(n, 21, 16, 16, generator=g) for n in (8, 8, 8, 3)]
    ids = [torch.arange(len(d), dtype=torch.int64) + 100 * i for i, d in enumerate(data)]

    def batches(device):
        return [(i, (lambda d=d, k=k: {"logits": d.to(device), "ids": k}))
                for i, (d, k) in enumerate(zip(data, ids))]

    _, gpu = collect("cuda", batches("cuda"), num_consumers=2)
    _, cpu = collect("cpu", batches("cpu"), num_consumers=2)
    assert gpu == cpu and len(gpu) == 4


def test_bfloat16_and_channels_last_outputs(no_leaks):
    x = torch.randn(4, 21, 8, 8, device="cuda").to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    _, res = collect("cuda", [(0, lambda: {"logits": x})], num_consumers=1)
    ref = x.contiguous().cpu().view(torch.int16).numpy().view(np.uint16)
    assert res[0] == digest({"logits": ref})


def test_idle_fraction_is_measured_by_nvml(no_leaks):
    """About two seconds of back-to-back kernels: both measures call the GPU busy, and
    the reported fraction is NVML's own (its samples, not the CUDA-event fallback)."""
    with EgressEngine(HashSinkFactory(), num_consumers=2, device="cuda") as e:
        for i in range(10):
            e.mark_compute_start()
            torch.cuda._sleep(400_000_000)
            e.submit(i, {"x": torch.ones(1024, device="cuda")})
    st = e.stats
    assert st.compute_gap_fraction is not None and 0.0 <= st.compute_gap_fraction < 0.5
    assert st.gpu_idle_source == "nvml", e._path.sampler.error
    assert len(e._path.sampler.samples) >= 5
    # the samples from the first batch to the last answer: not the engine's wait before
    assert st.gpu_idle_fraction == e._path.sampler.idle_fraction(e._t_first, e._t_last)
    assert st.gpu_idle_fraction < 0.5


def test_pools_are_unregistered_between_runs(no_leaks):
    for run in range(3):
        _, res = collect("cuda", [(0, lambda: {"x": torch.full((1 << 20,), float(run), device="cuda")})],
                         num_consumers=1)
        assert res[0] == digest({"x": np.full((1 << 20,), float(run), np.float32)})


def test_a_wait_for_a_free_slot_is_not_counted_as_compute(no_leaks):
    """One slot and a sink that takes 0.3 s: each submit after the first waits for the
    slot while the GPU has nothing to do. The compute span of a batch ends where its
    kernels end, before that wait, so the gaps show (before, the end was marked after
    the wait and the GPU looked busy all along)."""
    with EgressEngine(SleepySinkFactory(0.3), num_consumers=1, num_slots=1, device="cuda") as e:
        for i in range(4):
            e.mark_compute_start()
            torch.cuda._sleep(20_000_000)  # a few ms of kernel
            e.submit(i, {"x": torch.ones(1024, device="cuda")})
    st = e.stats
    assert st.producer_blocked_seconds > 0.6
    assert st.compute_gap_fraction > 0.7, st.compute_gap_fraction
    for r in st.records[1:]:
        assert r.compute_end < r.slot_t - 0.1, (r.compute_end, r.slot_t)
        assert r.freed_t >= r.sink_end_t > r.sink_start_t >= r.dispatch_t


def test_an_engine_started_early_counts_the_gpu_idle_from_its_first_batch(no_leaks):
    """start() opens the pool and the consumers before the batches (build-index does, to
    overlap their start with the model's load); the second of idle GPU before the first
    batch is not counted against the run, and the batches reach the sinks as usual."""
    results = {}
    e = EgressEngine(HashSinkFactory(), num_consumers=2, device="cuda",
                     slot_spec={"x": ((1024,), "float32")},
                     on_result=lambda b, r: results.__setitem__(b, r[1])).start()
    assert e._consumers is not None and len(e._consumers.procs) == 2
    time.sleep(1.0)
    with e:
        for i in range(10):
            e.mark_compute_start()
            torch.cuda._sleep(200_000_000)
            e.submit(i, {"x": torch.full((1024,), float(i), device="cuda")})
    assert sorted(results) == list(range(10))
    assert e.stats.gpu_idle_source == "nvml" and e.stats.gpu_idle_fraction < 0.5


def test_submit_does_not_wait_for_the_gpu_and_times_are_the_gpu_s_on_the_host_clock(no_leaks):
    """Each batch's kernel runs about 0.1 s. ``submit`` only enqueues the copy on the
    egress stream, so it returns long before the kernel ends (a blocking copy would wait
    for it); the record's compute span, from CUDA events put on the host clock, is the
    kernel's own length and ends after ``submit`` returned."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(200_000_000)
    b.record()
    b.synchronize()
    kernel_s = a.elapsed_time(b) / 1e3
    assert kernel_s > 0.02, kernel_s
    returned = []
    with EgressEngine(HashSinkFactory(), num_consumers=1, num_slots=4, device="cuda") as e:
        for i in range(3):
            e.mark_compute_start()
            torch.cuda._sleep(200_000_000)
            out = {"x": torch.ones(1024, device="cuda")}
            t0 = time.perf_counter()
            e.submit(i, out)
            returned.append((t0, time.perf_counter()))
            torch.cuda.synchronize()
    records = e.stats.records
    assert len(records) == 3
    for r in records:
        assert 0.7 * kernel_s < r.compute_end - r.compute_start < 1.5 * kernel_s, (r, kernel_s)
        assert r.copy_end >= r.copy_start >= r.compute_end - 1e-3
    # the first submit may wait for the pool made ahead; the later ones find it ready
    for r, (t0, t1) in zip(records[1:], returned[1:], strict=True):
        assert t1 - t0 < 0.3 * kernel_s, (t1 - t0, kernel_s)
        assert r.compute_end > t1, (r, t1)


def test_a_batch_s_copy_runs_beside_the_next_batch_s_work(no_leaks):
    """The copies run on a stream of their own: the next batch's work starts while a
    256 MiB output is still on its way to the host (on the compute stream it would queue
    behind the copy, and the GPU would compute nothing while it lasts). Each later
    batch's compute start, a CUDA event on the compute stream, comes before the middle of
    the previous batch's copy."""
    src = torch.randn(256 * 1024 * 1024 // 4, device="cuda")
    with EgressEngine(HashSinkFactory(), num_consumers=2, num_slots=3, device="cuda") as e:
        for i in range(4):
            e.mark_compute_start()
            torch.cuda._sleep(1_000_000)
            e.submit(i, {"x": src})
    records = sorted(e.stats.records, key=lambda r: r.seq)
    for before, after in zip(records, records[1:]):
        assert before.copy_end - before.copy_start > 1e-3, before
        assert after.compute_start < (before.copy_start + before.copy_end) / 2, (before, after)


def test_release_lets_go_of_the_tensors_over_the_pool(no_leaks):
    """After a run the pinned pool is unregistered and unmapped; no tensor the engine
    made over it may outlive that (a read through one would touch freed memory)."""
    with EgressEngine(HashSinkFactory(), num_consumers=1, num_slots=2, device="cuda") as e:
        e.submit(0, {"x": torch.ones(1024, device="cuda")})
        views = [weakref.ref(t) for slot in e._path._host_tensors for t in slot.values()]
    gc.collect()
    assert len(views) == 2
    assert [v() for v in views] == [None, None]


def test_each_batch_counts_the_bytes_of_all_its_outputs(no_leaks):
    """Two device outputs and a host one: a batch's bytes are the three's, exactly."""
    with EgressEngine(HashSinkFactory(), num_consumers=1, num_slots=2, device="cuda") as e:
        for i in range(3):
            e.submit(i, {"x": torch.ones(1024, device="cuda"),
                         "y": torch.ones(16, 8, dtype=torch.float16, device="cuda"),
                         "ids": np.arange(4, dtype=np.int64)})
    assert [r.nbytes for r in e.stats.records] == [4096 + 256 + 32] * 3


def test_the_nvml_sampler_stops_with_the_engine(no_leaks):
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cuda") as e:
        e.submit(0, {"x": torch.ones(1024, device="cuda")})
        sampler = e._path.sampler
        assert sampler.running, sampler.error
    assert not sampler.running
    assert [t for t in threading.enumerate() if t.name == "embedingest-nvml"] == []


def test_gpu_spans_are_the_kernels_on_the_host_clock_and_none_before_the_pool(no_leaks):
    """A lane marked with ``span`` is timed by CUDA events and reported on the host
    clock. Before the first batch opens the pool there is no reference event to convert
    with, so a snapshot of the stats then holds no GPU lane (and raises nothing)."""
    cycles = cycles_per_second()
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cuda") as e:
        t0 = time.perf_counter()
        with e.span("forward"):
            torch.cuda._sleep(int(0.1 * cycles))
        torch.cuda.synchronize()
        assert [s for s in e.stats.spans if s[0] == "forward"] == []
        e.submit(0, {"x": torch.ones(1024, device="cuda")})
        with e.span("forward"):
            torch.cuda._sleep(int(0.1 * cycles))
        torch.cuda.synchronize()
        t1 = time.perf_counter()
    spans = [s for s in e.stats.spans if s[0] == "forward"]
    assert len(spans) == 2, spans
    for _, a, b in spans:
        assert t0 - 1e-3 <= a < b <= t1 + 1e-3, (t0, a, b, t1)
        assert 0.07 < b - a < 0.15, (a, b)
    assert spans[0][2] <= spans[1][1] + 1e-3


def test_the_idle_share_of_a_window_counts_only_that_window(no_leaks):
    """Two seconds of one long kernel, then two seconds of nothing, read through the
    engine: each window's share comes from its own samples (NVML averages over up to a
    second, so the first second of each phase is left out)."""
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cuda") as e:
        e.submit(0, {"x": torch.ones(1024, device="cuda")})  # opens the pool and the sampler
        e.flush()
        t0, t1, t2 = busy_then_idle(2.0)
        busy, idle = e.gpu_idle_fraction(t0 + 1.0, t1), e.gpu_idle_fraction(t1 + 1.0, t2)
    assert busy is not None and idle is not None
    assert busy < 0.2 and idle > 0.8, (busy, idle)


def test_waiting_for_a_copy_leaves_the_cpu_free(no_leaks):
    """The monitor thread waits for each copy's event, which is a blocking one: the wait
    sleeps in the driver instead of spinning a core for as long as the GPU computes (the
    tokenizer workers and the sinks need those cores)."""
    cycles = cycles_per_second()
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cuda") as e:
        e.submit(0, {"x": torch.ones(1024, device="cuda")})
        e.flush()
        cpu0, t0 = time.process_time(), time.perf_counter()
        e.mark_compute_start()
        torch.cuda._sleep(int(1.0 * cycles))
        e.submit(1, {"x": torch.ones(1024, device="cuda")})
        e.flush()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    assert wall > 0.8, wall
    assert cpu < 0.3 * wall, (cpu, wall)


def test_event_times_stay_on_the_host_clock_seconds_after_the_pool_opened(no_leaks):
    """Event times are put on the host clock through one reference event recorded when
    the pool opened. A compute start marked four seconds later still lands between the
    host's times around it (a conversion off by a thousandth would be 4 ms early)."""
    cycles = cycles_per_second()
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cuda") as e:
        e.submit(0, {"x": torch.ones(1024, device="cuda")})
        torch.cuda._sleep(int(4.0 * cycles))
        torch.cuda.synchronize()
        before = time.perf_counter()
        e.mark_compute_start()
        torch.cuda.synchronize()
        after = time.perf_counter()
        e.submit(1, {"x": torch.ones(1024, device="cuda")})
    rec = sorted(e.stats.records, key=lambda r: r.seq)[1]
    assert before - 1e-3 <= rec.compute_start <= after + 1e-3, (before, rec.compute_start, after)


def test_every_cuda_call_of_the_copy_path_that_picks_a_gpu_names_the_engine_s(no_leaks, monkeypatch):
    """On one GPU the engine's device is the current one, so a copy path that took the
    current device's stream, the current stream for its events, the current GPU's NVML
    handle or index would pass every other test of one GPU, and mix two GPUs on a host
    with more (``test_an_engine_on_a_gpu_that_is_not_the_current_one`` runs that where
    there are two). Here each call the copy path itself makes that picks a GPU is
    watched: every one names the engine's, and none asks which GPU is current."""
    from embedingest.engine import copy_paths

    calls = []

    def by_the_path(depth: int = 2) -> bool:
        return sys._getframe(depth).f_code.co_filename == copy_paths.__file__

    def watch(owner, name):
        real = getattr(owner, name)

        def spy(*args, **kwargs):
            if by_the_path():
                calls.append((name, args, kwargs))
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, spy)

    for name in ("current_stream", "current_device", "synchronize"):
        watch(torch.cuda, name)
    watch(torch.cuda.Event, "record")
    real_stream, real_sampler = torch.cuda.Stream, copy_paths.UtilizationSampler

    class Stream(real_stream):
        def __new__(cls, device=None, priority=0, **kwargs):
            if by_the_path():
                calls.append(("Stream", (device,), {}))
            return super().__new__(cls, device=device, priority=priority, **kwargs)

    class Sampler(real_sampler):
        def __init__(self, device=None, *args, **kwargs):
            if by_the_path():
                calls.append(("UtilizationSampler", (device,), {}))
            super().__init__(device, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(copy_paths, "UtilizationSampler", Sampler)
    results = {}
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cuda:0",
                      on_result=lambda b, r: results.__setitem__(b, r[1])) as e:
        for i in range(3):
            e.mark_compute_start()
            x = torch.full((1024,), float(i), device="cuda:0")
            with e.span("forward"):
                x = x + 0
            e.submit(i, {"x": x})
    assert results == {i: digest({"x": np.full(1024, float(i), np.float32)}) for i in range(3)}
    names = [name for name, _, _ in calls]
    assert "current_device" not in names, "an engine given cuda:0 asked which GPU is current"
    assert names.count("Stream") == 1 and names.count("UtilizationSampler") == 1, names
    assert names.count("current_stream") >= 7 and names.count("record") >= 13, names
    for name, args, kwargs in calls:
        if name == "record":  # event.record(stream): the event is args[0]
            stream = args[1] if len(args) > 1 else kwargs.get("stream")
            assert stream is not None and stream.device == torch.device("cuda:0"), (args, kwargs)
        else:
            picked = args[0] if args else next(iter(kwargs.values()), None)
            assert picked is not None and torch.device(picked) == torch.device("cuda:0"), (name, args, kwargs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_an_engine_on_a_gpu_that_is_not_the_current_one(no_leaks):
    """A library user's engine on cuda:1 while cuda:0 is current: its stream, events,
    NVML samples and device check are all cuda:1's (one made for the current device
    instead would mix two GPUs' events, or read the idle GPU). A tensor on cuda:0 is
    refused naming both devices."""
    assert torch.cuda.current_device() == 0
    cycles = cycles_per_second(1)
    results = {}
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cuda:1",
                      on_result=lambda b, r: results.__setitem__(b, r[1])) as e:
        for i in range(6):
            e.mark_compute_start()
            with torch.cuda.device(1):
                torch.cuda._sleep(int(0.4 * cycles))
            e.submit(i, {"x": torch.full((1024,), float(i), device="cuda:1")})
    assert results == {i: digest({"x": np.full(1024, float(i), np.float32)}) for i in range(6)}
    for r in e.stats.records:
        assert 0.28 < r.compute_end - r.compute_start < 0.6, r
        assert r.copy_end >= r.copy_start >= r.compute_end - 1e-3, r
    assert e.stats.gpu_idle_source == "nvml" and e.stats.gpu_idle_fraction < 0.5
    with pytest.raises(ConfigError) as err:
        with EgressEngine(HashSinkFactory(), num_consumers=1, device="cuda:1") as e2:
            e2.submit(0, {"x": torch.ones(1024, device="cuda:1")})
            e2.submit(1, {"x": torch.ones(1024, device="cuda:0")})
    assert str(err.value) == "array 'x' is on cuda:0, the engine on cuda:1; one engine serves one GPU"
