"""The timeline picture is drawn from a real CPU run's records."""

from __future__ import annotations

import time

import numpy as np
from engine_sinks import HashSinkFactory
from PIL import Image

from embedingest import EgressEngine
from embedingest.engine.timeline import lanes_of, render_timeline


def test_timeline_png_from_a_cpu_run(tmp_path, no_leaks):
    with EgressEngine(HashSinkFactory(delays=(0.01, 0.02)), num_consumers=2, num_slots=3,
                      device="cpu") as e:
        for i in range(12):
            with e.span("h2d"):
                time.sleep(0.002)
            e.submit(i, {"x": np.full((4, 4), i, np.float32)})
    st = e.stats
    lanes = lanes_of(st.records, st.spans, last_n=10)
    assert {"hand-off", "consumer 0", "consumer 1", "h2d", "d2h"} <= set(lanes)
    seqs = sorted(s for lane in ("consumer 0", "consumer 1") for _, _, s in lanes[lane])
    assert seqs == list(range(2, 12))  # the last ten batches, each in one consumer lane
    for lane, ivs in lanes.items():
        assert all(b >= a for a, b, _ in ivs), lane
    out = render_timeline(st.records, tmp_path / "t.png", spans=st.spans, last_n=10)
    img = Image.open(out)
    assert img.format == "PNG" and img.width == 1600 and img.height > 150
    assert len(img.getcolors(maxcolors=100000)) > 5  # boxes were drawn, not a blank page


def test_lanes_from_records_made_by_hand():
    """Lanes in drawing order (compute, h2d, d2h, hand-off, then consumers and other
    spans); the last 20 batches by default; spans ending before those batches are left out."""
    from embedingest.engine.telemetry import BatchRecord

    recs = [BatchRecord(seq=i, slot=0, nbytes=1, submit_t=float(i), slot_t=float(i), ready_t=i + 0.2,
                        sink_start_t=i + 0.5, sink_end_t=i + 0.7, worker=i % 2,
                        compute_start=i + 0.0, compute_end=i + 0.1, copy_start=i + 0.1, copy_end=i + 0.2)
            for i in range(25)]
    spans = [("h2d", 4.0, 4.5), ("h2d", 9.0, 9.5), ("load", 0.0, 1.0)]
    lanes = lanes_of(recs, spans)
    assert list(lanes) == ["compute", "h2d", "d2h", "hand-off", "consumer 1", "consumer 0"]
    assert [s for _, _, s in lanes["compute"]] == list(range(5, 25))
    assert lanes["h2d"] == [(9.0, 9.5, -1)]  # 4.0-4.5 ended before batch 5's slot
    assert lanes["compute"][0] == (5.0, 5.1, 5)
    assert lanes["d2h"][0] == (5.1, 5.2, 5) and lanes["hand-off"][0] == (5.2, 5.5, 5)
    assert lanes["consumer 1"][0] == (5.5, 5.7, 5)
    unmarked = [BatchRecord(seq=0, slot=0, nbytes=1, submit_t=0.0, slot_t=0.0, compute_end=2.0)]
    assert lanes_of(unmarked) == {"compute": [(2.0, 2.0, 0)], "d2h": []}
    half = [BatchRecord(seq=0, slot=0, nbytes=1, submit_t=0.0, slot_t=0.0, copy_start=1.0),
            BatchRecord(seq=1, slot=0, nbytes=1, submit_t=0.0, slot_t=0.0, copy_end=1.0)]
    assert lanes_of(half) == {"compute": [], "d2h": []}  # a copy span needs both ends
