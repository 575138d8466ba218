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
