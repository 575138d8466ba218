"""The CPU copy path: what counts as a torch tensor, host arrays, and the copy into a slot
with its timing. ``CudaCopyPath`` is tested on a GPU (``test_egress_cuda.py``)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from embedingest.engine.copy_paths import CudaCopyPath, HostCopyPath, Pending, _host_array, _is_torch
from embedingest.engine.layout import SlotLayout
from embedingest.engine.pool import HostPool
from embedingest.engine.telemetry import BatchRecord
from embedingest.errors import ConfigError


def fake_tensor(module: str, **attrs):
    """An object whose type claims to come from ``module``, with ``attrs`` as attributes."""
    return type("Fake", (), {"__module__": module, **attrs})()


@pytest.fixture
def pool():
    layout = SlotLayout.from_spec({"x": ((4, 3), np.float32), "ids": ((4,), np.int64),
                                   "h": ((4, 2), torch.bfloat16)})
    p = HostPool(layout, 2)
    try:
        yield p
    finally:
        p.close()


def record(submit_t: float) -> BatchRecord:
    return BatchRecord(seq=0, slot=0, nbytes=0, submit_t=submit_t, slot_t=submit_t)


def test_a_torch_tensor_is_one_with_is_cuda_from_a_torch_module():
    assert _is_torch(torch.zeros(2)) is True
    assert _is_torch(torch.zeros(2, dtype=torch.bfloat16)) is True
    assert _is_torch(fake_tensor("torch.fake", is_cuda=True)) is True
    assert _is_torch(torch.device("cpu")) is False  # from torch, without is_cuda
    assert _is_torch(fake_tensor("cupy", is_cuda=True)) is False  # is_cuda, not from torch
    assert _is_torch(fake_tensor("mytorch", is_cuda=True)) is False
    assert _is_torch(np.zeros(2)) is False
    assert _is_torch([1.0]) is False


def test_host_array_keeps_numpy_and_copies_tensors_bit_for_bit():
    a = np.arange(6, dtype=np.float32)
    assert _host_array(a) is a
    t = torch.arange(6, dtype=torch.float32, requires_grad=True) * 2  # needs detach
    got = _host_array(t)
    assert type(got) is np.ndarray and got.dtype == np.float32
    assert got.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    bf = torch.tensor([1.0, -2.5, 3.140625, 0.0, -0.0, 65280.0], dtype=torch.bfloat16)
    bits = _host_array(bf.requires_grad_())
    assert bits.dtype == np.uint16
    assert bits.tolist() == [0x3F80, 0xC020, 0x4049, 0x0000, 0x8000, 0x477F]
    assert bits.tolist() == bf.detach().view(torch.int16).numpy().view(np.uint16).tolist()
    listed = _host_array([[1, 2], [3, 4]])
    assert type(listed) is np.ndarray and listed.tolist() == [[1, 2], [3, 4]]


def test_a_pending_batch_starts_without_an_event_timing_or_tensors():
    rec = record(1.0)
    p = Pending(rec, "b0", {"x": 3})
    assert (p.record, p.batch_id, p.lengths, p.done_event, p.timing, p.keep) == (rec, "b0", {"x": 3}, None, (), [])
    q = Pending(rec, "b1", {})
    p.keep.append(1)
    assert q.keep == []


def test_the_host_path_copies_every_array_into_its_slot_and_counts_the_bytes(pool):
    path = HostCopyPath("cpu")
    assert (path.device, HostCopyPath.pins, path.spans(True), path.idle_fraction()) == ("cpu", False, [], None)
    assert path.idle_fraction(1.0, 2.0) is None
    path.open(pool)
    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    ids = np.array([7, 8, 9], dtype=np.int64)
    h = torch.tensor([[1.0, -2.5], [3.140625, -0.0], [65280.0, 0.5]], dtype=torch.bfloat16)
    before = {k: v.copy() for k, v in pool.views(1).items()}
    p = Pending(record(time.perf_counter()), 0, {"x": 3, "ids": 3, "h": 3})
    assert path.copy(pool, 1, {"x": x, "ids": ids, "h": h}, p) == 9 * 4 + 3 * 8 + 6 * 2
    v = pool.views(1)
    assert v["x"][:3].tolist() == x.tolist() and v["x"][3].tolist() == before["x"][3].tolist()
    assert v["ids"][:3].tolist() == [7, 8, 9] and v["ids"][3] == before["ids"][3]
    assert v["h"].dtype == np.uint16
    assert v["h"][:3].tolist() == h.view(torch.int16).numpy().view(np.uint16).tolist()
    assert v["h"][:3].tolist() == [[0x3F80, 0xC020], [0x4049, 0x8000], [0x477F, 0x3F00]]
    assert all((pool.views(0)[k] == 0).all() for k in ("x", "ids", "h"))
    path.stop()
    path.wait(p)
    path.release()
    assert (p.done_event, p.timing, p.keep) == (None, (), [])


def test_the_host_path_copies_only_the_batch_s_rows(pool):
    path = HostCopyPath("cpu")
    p = Pending(record(0.0), 0, {"x": 1, "ids": 2, "h": 0})
    x = np.full((1, 3), 5.0, dtype=np.float32)
    n = path.copy(pool, 0, {"x": x, "ids": np.array([1, 2]), "h": torch.zeros(0, 2, dtype=torch.bfloat16)}, p)
    assert n == 12 + 16 + 0
    v = pool.views(0)
    assert v["x"].tolist() == [[5.0] * 3] + [[0.0] * 3] * 3
    assert v["ids"].tolist() == [1, 2, 0, 0]
    assert (p.record.compute_start, p.record.compute_end) == (None, 0.0)  # no marks on a new path


def test_the_host_path_refuses_another_dtype_rather_than_casting_it(pool):
    path = HostCopyPath("cpu")
    p = Pending(record(0.0), 0, {"x": 1, "ids": 1, "h": 1})
    with pytest.raises(TypeError, match="Cannot cast"):
        path.copy(pool, 0, {"x": np.ones((1, 3), dtype=np.float64), "ids": np.array([1]),
                            "h": np.zeros((1, 2), dtype=np.uint16)}, p)


def test_a_device_tensor_is_refused_on_the_cpu_path_naming_it_and_the_fix():
    path = HostCopyPath("cpu")
    dev = fake_tensor("torch.fake", is_cuda=True, device="cuda:1")
    with pytest.raises(ConfigError) as e:
        path._copy_host({}, {"y": dev}, {"y": 1}, skip_device=False)
    assert str(e.value) == ("array 'y' is on cuda:1 but the engine runs on cpu; "
                            "build the engine with device='cuda'")
    views = {"x": np.zeros(3, dtype=np.int64)}
    assert path._copy_host(views, {"y": dev, "x": np.array([4, 5])}, {"y": 1, "x": 2}, skip_device=True) == 16
    assert views["x"].tolist() == [4, 5, 0]


def test_copy_refuses_a_device_tensor_before_anything_is_copied(pool):
    path = HostCopyPath("cpu")
    dev = fake_tensor("torch.fake", is_cuda=True, device="cuda:0")
    p = Pending(record(0.0), 0, {"x": 1, "ids": 1, "h": 1})
    with pytest.raises(ConfigError) as e:
        path.copy(pool, 0, {"x": dev, "ids": np.array([3]), "h": np.zeros((1, 2), dtype=np.uint16)}, p)
    assert str(e.value) == ("array 'x' is on cuda:0 but the engine runs on cpu; "
                            "build the engine with device='cuda'")
    assert pool.views(0)["ids"].tolist() == [0, 0, 0, 0]


def test_the_host_path_times_compute_and_copy_in_order_and_forgets_the_marks(pool):
    path = HostCopyPath("cpu")
    arrays = {"x": np.zeros((2, 3), dtype=np.float32), "ids": np.zeros(2, dtype=np.int64),
              "h": np.zeros((2, 2), dtype=np.uint16)}
    lengths = {"x": 2, "ids": 2, "h": 2}
    path.mark_compute_start()
    time.sleep(0.002)
    path.mark_compute_end()
    time.sleep(0.002)
    rec = record(time.perf_counter())
    path.copy(pool, 0, arrays, Pending(rec, 0, lengths))
    after = time.perf_counter()
    assert rec.compute_start < rec.compute_end < rec.submit_t <= rec.copy_start <= rec.copy_end <= after
    assert (path._compute_start, path._compute_end) == (None, None)
    # no marks: no compute start, and its end is the submit
    rec2 = record(time.perf_counter())
    path.copy(pool, 1, arrays, Pending(rec2, 1, lengths))
    assert (rec2.compute_start, rec2.compute_end) == (None, rec2.submit_t)
    assert rec2.submit_t <= rec2.copy_start <= rec2.copy_end
    # a start without an end: the end is the submit
    path.mark_compute_start()
    rec3 = record(time.perf_counter())
    path.copy(pool, 0, arrays, Pending(rec3, 2, lengths))
    assert rec3.compute_start < rec3.compute_end == rec3.submit_t


def test_spans_are_timed_in_order_on_the_host_clock_and_returned_as_a_copy():
    path = HostCopyPath("cpu")
    t0 = time.perf_counter()
    with path.span("decode"):
        time.sleep(0.002)
    with path.span("encode", stream=object()):
        pass
    t1 = time.perf_counter()
    got = path.spans(False)
    assert [s[0] for s in got] == ["decode", "encode"]
    (_, a0, b0), (_, a1, b1) = got
    assert t0 <= a0 and b0 - a0 >= 0.002 and b0 <= a1 <= b1 <= t1
    got.clear()
    assert path.spans(True) == [("decode", a0, b0), ("encode", a1, b1)]


def test_a_cuda_path_not_yet_opened_has_no_idle_share_and_no_spans():
    """A CUDA engine's stats are read before its first batch (during a run, or when no
    batch came): the path has no sampler yet and says so with None, not an error."""
    path = CudaCopyPath("cuda:0")
    assert path.idle_fraction() is None
    assert path.idle_fraction(1.0, 2.0) is None
    assert path.spans(pool_open=False) == []
    assert path.sampler is None


def test_a_tensor_on_another_gpu_is_refused_naming_both_devices():
    """The device check runs before anything touches CUDA, so it is checked here with a
    tensor that says it is on cuda:1 (a GPU test does it with two real GPUs)."""
    path = CudaCopyPath("cuda:0")
    path._device_index = 0
    elsewhere = fake_tensor("torch", device=torch.device("cuda:1"))
    with pytest.raises(ConfigError) as err:
        path._copy_device(0, [("x", elsewhere)], Pending(record(0.0), 0, {"x": 1}))
    assert str(err.value) == "array 'x' is on cuda:1, the engine on cuda:0; one engine serves one GPU"


def test_a_batch_of_host_arrays_on_the_cuda_path_is_copied_and_forgets_the_marks(pool):
    """Host arrays are copied in submit as on the CPU; the batch's compute marks are
    forgotten, so a later batch not marked does not carry this one's."""
    path = CudaCopyPath("cuda:0")
    path._compute_start, path._compute_end = "start mark", "end mark"
    p = Pending(record(0.0), 0, {"x": 1, "ids": 2, "h": 0})
    n = path.copy(pool, 0, {"x": np.full((1, 3), 2.0, dtype=np.float32), "ids": np.array([7, 8]),
                            "h": torch.zeros(0, 2, dtype=torch.bfloat16)}, p)
    assert n == 12 + 16
    assert pool.views(0)["ids"].tolist() == [7, 8, 0, 0]
    assert (path._compute_start, path._compute_end) == (None, None)
    assert p.done_event is None
    path.wait(p)  # nothing on the GPU to wait for
