"""Property test of the egress engine on CPU: whatever the batch sizes, slots, consumers
and sink speeds, every batch reaches exactly one sink once, bit for bit."""

from __future__ import annotations

import time

import numpy as np
from conftest import child_pids
from fault_helpers import (
    DelayedDigestSinkFactory,
    array_digest,
    new_shm_files,
    shm_listing,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedingest import EgressEngine

DTYPES = ["float32", "float16", "int64", "uint8"]


@st.composite
def runs(draw):
    rows = draw(st.integers(1, 9))  # a slot's rows (the largest batch)
    sizes = draw(st.lists(st.integers(0, rows), min_size=1, max_size=24))
    dtype = draw(st.sampled_from(DTYPES))
    width = draw(st.integers(1, 40))
    return {
        "rows": rows, "sizes": sizes, "dtype": dtype, "width": width,
        "num_consumers": draw(st.integers(1, 3)),
        "num_slots": draw(st.integers(1, 4)),
        "delays": tuple(draw(st.lists(st.sampled_from([0.0, 0.0, 0.002, 0.01, 0.03]),
                                      min_size=1, max_size=3))),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def batch(rng, n, rows, width, dtype):
    if dtype.startswith("float"):
        x = rng.standard_normal((n, width)).astype(dtype)
    else:
        x = rng.integers(0, np.iinfo(dtype).max, (n, width), dtype=dtype, endpoint=True)
    return {"x": x, "ids": np.arange(n, dtype=np.int64) + int(rng.integers(0, 2**40))}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_every_batch_reaches_one_sink_exactly_once_bit_exact(case):
    shm_before, kids_before = shm_listing(), child_pids()
    rng = np.random.default_rng(case["seed"])
    # the first batch is a full one (the slots are sized from it), the rest any size
    sizes = [case["rows"], *case["sizes"]]
    batches = [(i, batch(rng, n, case["rows"], case["width"], case["dtype"])) for i, n in enumerate(sizes)]
    results = []
    with EgressEngine(DelayedDigestSinkFactory(case["delays"]), device="cpu",
                      num_consumers=case["num_consumers"], num_slots=case["num_slots"],
                      on_result=lambda b, r: results.append((b, r))) as engine:
        for bid, arrays in batches:
            engine.submit(bid, arrays)
    got: dict[int, dict] = {}
    for bid, (_, digest) in results:
        assert bid not in got, f"batch {bid} reached a sink twice"
        got[bid] = digest
    assert got == {bid: array_digest(a) for bid, a in batches}
    seen = sorted(b for c in engine.closed_results if c for b in c["seen"])
    assert seen == list(range(len(batches)))  # each exactly once over all consumers
    assert engine.stats.batches == len(batches)
    assert {r.slot for r in engine.stats.records} <= set(range(case["num_slots"]))
    deadline = time.monotonic() + 10
    while child_pids() - kids_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child_pids() - kids_before, "consumer processes left behind"
    assert not new_shm_files(shm_before)
