"""Draw the engine's own records as a timeline picture, like a profiler's, without one.

One lane each for compute, host-to-device, device-to-host, hand-off (copy done until a
consumer starts) and every consumer; one box per batch, numbered. Built from the CUDA
events and host clocks the engine records anyway, so ``--timeline FILE`` costs nothing
while the run goes on.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from ..outfiles import atomic_write_bytes
from .telemetry import BatchRecord

LANE_COLORS = {
    "compute": (86, 156, 214),
    "h2d": (106, 190, 48),
    "d2h": (214, 90, 90),
    "hand-off": (78, 201, 176),
    "consumer": (220, 170, 60),
}


def lanes_of(records: Iterable[BatchRecord], spans: Iterable[tuple[str, float, float]] = (),
             last_n: int = 20) -> dict[str, list[tuple[float, float, int]]]:
    """Group the last ``last_n`` batches' intervals by lane: ``{lane: [(start, end, seq)]}``."""
    recs = sorted(records, key=lambda r: r.seq)[-last_n:]
    lanes: dict[str, list[tuple[float, float, int]]] = {"compute": [], "h2d": [], "d2h": [], "hand-off": []}
    for r in recs:
        if r.compute_end is not None:
            lanes["compute"].append((r.compute_start if r.compute_start is not None else r.compute_end,
                                     r.compute_end, r.seq))
        if r.copy_start is not None and r.copy_end is not None:
            lanes["d2h"].append((r.copy_start, r.copy_end, r.seq))
        if r.sink_start_t:
            lanes["hand-off"].append((r.copy_end or r.ready_t, r.sink_start_t, r.seq))
            lanes.setdefault(f"consumer {r.worker}", []).append((r.sink_start_t, r.sink_end_t, r.seq))
    if recs:
        lo = min(r.slot_t for r in recs)
        for name, a, b in spans:
            if b >= lo:
                lanes.setdefault(name, []).append((a, b, -1))
    return {k: v for k, v in lanes.items() if v or k in ("compute", "d2h")}


def render_timeline(records: Iterable[BatchRecord], path: str | Path, *,
                    spans: Iterable[tuple[str, float, float]] = (), last_n: int = 20,
                    title: str = "embedingest timeline", width: int = 1600) -> Path:
    """Write a PNG of the last ``last_n`` batches to ``path`` (atomically) and return it."""
    lanes = lanes_of(records, spans, last_n)
    items = [iv for ivs in lanes.values() for iv in ivs]
    if not items:
        raise ValueError("no batches recorded: nothing to draw")
    t0 = min(a for a, _, _ in items)
    t1 = max(b for _, b, _ in items)
    span = max(t1 - t0, 1e-6)
    left, right, top, lane_h = 130, 20, 50, 34
    height = top + lane_h * len(lanes) + 40
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    draw.text((10, 10), f"{title}  ({span * 1e3:.1f} ms shown, last {last_n} batches)", fill="black", font=font)

    def x(t: float) -> float:
        return left + (t - t0) / span * (width - left - right)

    for i, (lane, ivs) in enumerate(lanes.items()):
        y = top + i * lane_h
        draw.text((10, y + 10), lane, fill="black", font=font)
        draw.line([(left, y + lane_h - 2), (width - right, y + lane_h - 2)], fill=(230, 230, 230))
        color = LANE_COLORS.get(lane.split(" ")[0], LANE_COLORS["consumer"])
        for a, b, seq in ivs:
            xa, xb = x(a), max(x(b), x(a) + 1)
            draw.rectangle([xa, y + 4, xb, y + lane_h - 6], fill=color, outline=(40, 40, 40))
            if seq >= 0 and xb - xa > 18:
                draw.text((xa + 3, y + 10), str(seq), fill="black", font=font)
    for k in range(11):
        t = t0 + span * k / 10
        xx = x(t)
        draw.line([(xx, height - 35), (xx, height - 30)], fill="black")
        draw.text((xx - 12, height - 25), f"{(t - t0) * 1e3:.0f}ms", fill="black", font=font)
    path = Path(path)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    atomic_write_bytes(path, buf.getvalue())
    return path
