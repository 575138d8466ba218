"""The timeline picture is drawn from a real CPU run's records."""

from __future__ import annotations

import time

import numpy as np
import pytest
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


def test_a_hand_off_starts_when_the_copy_ends_else_when_the_slot_was_ready():
    """The hand-off box begins at the copy's end when the copy was timed, at ``ready_t``
    otherwise; a stage span ending exactly at the first drawn batch's slot is kept."""
    from embedingest.engine.telemetry import BatchRecord

    timed = BatchRecord(seq=0, slot=0, nbytes=1, submit_t=1.0, slot_t=1.0, ready_t=1.5, sink_start_t=2.0,
                        sink_end_t=2.5, worker=0, copy_start=1.1, copy_end=1.3)
    untimed = BatchRecord(seq=1, slot=1, nbytes=1, submit_t=1.2, slot_t=1.2, ready_t=1.6, sink_start_t=2.5,
                          sink_end_t=3.0, worker=1)
    lanes = lanes_of([untimed, timed], [("load", 0.5, 1.0), ("load", 0.2, 0.9)])
    assert lanes == {"compute": [], "d2h": [(1.1, 1.3, 0)], "hand-off": [(1.3, 2.0, 0), (1.6, 2.5, 1)],
                     "consumer 0": [(2.0, 2.5, 0)], "consumer 1": [(2.5, 3.0, 1)], "load": [(0.5, 1.0, -1)]}


# The picture's layout, written out: lanes 34 px high from y=50, boxes from y+4 to y+28
# with a grey rule at y+32, boxes from x=130 to 20 px before the right edge, a batch's
# number 3 px into its box when the box is wider than 18 px, 11 ticks along the bottom.
COLORS = {"compute": (86, 156, 214), "h2d": (106, 190, 48), "d2h": (214, 90, 90),
          "hand-off": (78, 201, 176), "consumer": (220, 170, 60)}


def picture(width: int, title: str, lanes: list, ticks: list) -> Image.Image:
    """The expected picture: ``lanes`` as ``(name, color, [(x0, x1, label or None)])``,
    ``ticks`` as ``(x, label)``, drawn from the layout above."""
    from PIL import ImageDraw, ImageFont

    height = 50 + 34 * len(lanes) + 40
    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw, font = ImageDraw.Draw(img), ImageFont.load_default()
    draw.text((10, 10), title, fill=(0, 0, 0), font=font)
    for i, (name, color, boxes) in enumerate(lanes):
        y = 50 + 34 * i
        draw.text((10, y + 10), name, fill=(0, 0, 0), font=font)
        draw.line([(130, y + 32), (width - 20, y + 32)], fill=(230, 230, 230))
        for x0, x1, label in boxes:
            draw.rectangle([x0, y + 4, x1, y + 28], fill=color, outline=(40, 40, 40))
            if label is not None:
                draw.text((x0 + 3, y + 10), label, fill=(0, 0, 0), font=font)
    for x, label in ticks:
        draw.line([(x, height - 35), (x, height - 30)], fill=(0, 0, 0))
        draw.text((x - 12, height - 25), label, fill=(0, 0, 0), font=font)
    return img


def assert_same_picture(path, expected: Image.Image) -> None:
    from PIL import ImageChops

    got = Image.open(path)
    assert got.format == "PNG" and got.mode == "RGB" and got.size == expected.size
    diff = ImageChops.difference(got, expected).getbbox()
    assert diff is None, f"the pictures differ in the box {diff}"


def test_the_picture_of_records_made_by_hand(tmp_path):
    """Every box, label, rule and tick where the layout puts it, with the lanes' colours.
    Times are chosen so that one pixel is 1/1024 s exactly (1024 px for 1 s): each box's
    edges are whole pixels. Batch 5 is before the last 3; the "load" span ended before
    them; "tokenize" has no colour of its own."""
    from embedingest.engine.telemetry import BatchRecord

    def t(px: int) -> float:
        return 100.0 + px / 1024

    recs = [
        BatchRecord(seq=7, slot=1, nbytes=1, submit_t=t(50), slot_t=t(50), ready_t=t(129), sink_start_t=t(200),
                    sink_end_t=t(210), worker=0, compute_start=t(100), compute_end=t(119), copy_start=t(119),
                    copy_end=t(129)),
        BatchRecord(seq=5, slot=2, nbytes=1, submit_t=t(0), slot_t=t(0), compute_start=t(600), compute_end=t(700)),
        BatchRecord(seq=6, slot=0, nbytes=1, submit_t=t(0), slot_t=t(0), ready_t=t(60), sink_start_t=t(100),
                    sink_end_t=t(300), worker=1, compute_start=t(0), compute_end=t(40), copy_start=t(40),
                    copy_end=t(58)),
        BatchRecord(seq=8, slot=0, nbytes=1, submit_t=t(150), slot_t=t(150), ready_t=t(320), sink_start_t=t(400),
                    sink_end_t=t(1024), worker=1, compute_end=t(300)),
    ]
    spans = [("h2d", t(500), t(600)), ("load", 99.0, 99.5), ("tokenize", t(10), t(200))]
    out = render_timeline(recs, str(tmp_path / "t.png"), spans=spans, last_n=3, title="a run", width=1174)
    assert out == tmp_path / "t.png"
    expected = picture(1174, "a run  (1000.0 ms shown, last 3 batches)", [
        ("compute", COLORS["compute"], [(130, 170, "6"), (230, 249, "7"), (430, 431, None)]),  # 19 px: numbered
        ("h2d", COLORS["h2d"], [(630, 730, None)]),  # a span has no number
        ("d2h", COLORS["d2h"], [(170, 188, None), (249, 259, None)]),  # 18 px: too narrow for one
        ("hand-off", COLORS["hand-off"], [(188, 230, "6"), (259, 330, "7"), (450, 530, "8")]),
        ("consumer 1", COLORS["consumer"], [(230, 430, "6"), (530, 1154, "8")]),
        ("consumer 0", COLORS["consumer"], [(330, 340, None)]),
        ("tokenize", COLORS["consumer"], [(140, 330, None)]),
    ], [(130 + 102.4 * k, f"{100 * k}ms") for k in range(11)])
    assert_same_picture(out, expected)


def test_the_picture_of_a_short_run_in_a_narrow_frame(tmp_path):
    """A quarter of a second over 128 px (a pixel is 1/512 s): batch 0's number is drawn,
    the ticks stop at the last one (the frame would have room for a twelfth), a lane takes
    its colour from its name's first word."""
    from embedingest.engine.telemetry import BatchRecord

    rec = BatchRecord(seq=0, slot=0, nbytes=1, submit_t=100.0, slot_t=100.0, compute_start=100.0,
                      compute_end=100.25)
    out = render_timeline([rec], tmp_path / "n.png", spans=[("h2d 1", 100.0625, 100.125)], width=278)
    expected = picture(278, "embedingest timeline  (250.0 ms shown, last 20 batches)",
                       [("compute", COLORS["compute"], [(130, 258, "0")]), ("d2h", COLORS["d2h"], []),
                        ("h2d 1", COLORS["h2d"], [(162, 194, None)])],
                       [(130 + 12.8 * k, f"{25 * k}ms") for k in range(11)])
    assert_same_picture(out, expected)


def test_the_picture_s_defaults_its_size_and_title(tmp_path):
    """1600 px wide, titled "embedingest timeline", the last 20 of 25 batches."""
    from embedingest.engine.telemetry import BatchRecord

    recs = [BatchRecord(seq=i, slot=0, nbytes=1, submit_t=100.0 + i / 32, slot_t=100.0 + i / 32,
                        compute_start=100.0 + i / 32, compute_end=100.0 + (i + 0.5) / 32) for i in range(25)]
    out = render_timeline(recs, tmp_path / "d.png")
    got = Image.open(out)
    assert got.size == (1600, 50 + 34 * 2 + 40)  # the compute and d2h lanes
    title = picture(1600, "embedingest timeline  (609.4 ms shown, last 20 batches)", [], [])
    band = (0, 0, 1600, 50)
    assert got.convert("RGB").crop(band).tobytes() == title.crop(band).tobytes()


def test_nothing_to_draw_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"^no batches recorded: nothing to draw$"):
        render_timeline([], tmp_path / "e.png")
    assert not (tmp_path / "e.png").exists()
