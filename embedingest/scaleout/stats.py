"""What is generic in running one job on several devices: the per-device engine stats
merged into one summary, shaped like a single device's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..engine.telemetry import EngineStats


@dataclass
class MultiDeviceStats:
    """The engine stats of every device process, shaped like one ``EngineStats`` for the
    caller: ``records`` and ``spans`` are the first device's (for the timeline)."""

    devices: list[str]
    per_device: list[EngineStats]
    timing: list[dict] = dataclasses.field(default_factory=list)  # each child's start-up and work

    @property
    def records(self):
        return self.per_device[0].records

    @property
    def spans(self):
        return self.per_device[0].spans

    def summary(self) -> dict:
        parts = [s.summary() | {"device": d} for d, s in zip(self.devices, self.per_device)]
        for part, timing in zip(parts, self.timing):
            part["timing"] = timing
        total_bytes = sum(p["bytes"] for p in parts)
        wall = max(p["wall_seconds"] for p in parts)

        def mean(key):
            values = [p[key] for p in parts if p[key] is not None]
            return sum(values) / len(values) if values else None

        return {
            "device": ",".join(self.devices), "batches": sum(p["batches"] for p in parts),
            "bytes": total_bytes, "wall_seconds": wall,
            "batches_per_second": sum(p["batches"] for p in parts) / wall if wall else 0.0,
            "bytes_per_second": total_bytes / wall if wall else 0.0,
            "copy_gbps": (sum(p["copy_gbps"] * p["bytes"] for p in parts) / total_bytes
                          if total_bytes else 0.0),
            "producer_blocked_seconds": sum(p["producer_blocked_seconds"] for p in parts),
            "gpu_idle_fraction": mean("gpu_idle_fraction"),
            "compute_gap_fraction": mean("compute_gap_fraction"),
            "pinned": all(p["pinned"] for p in parts),
            "num_consumers": sum(p["num_consumers"] for p in parts),
            "per_device": parts,
        }
