"""The egress engine on a CUDA GPU: pinned pool, copy rate, ordering, same result as CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_sinks import HashSinkFactory, SleepySinkFactory, digest

from embedingest import EgressEngine

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
    import time

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
    import time

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
    import gc
    import weakref

    with EgressEngine(HashSinkFactory(), num_consumers=1, num_slots=2, device="cuda") as e:
        e.submit(0, {"x": torch.ones(1024, device="cuda")})
        views = [weakref.ref(t) for slot in e._path._host_tensors for t in slot.values()]
    gc.collect()
    assert len(views) == 2
    assert [v() for v in views] == [None, None]
