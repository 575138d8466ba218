"""build-index on several devices of one host: the encode step of
:func:`~embedingest.jobs.build_index.build_index`, one process per device.

The parent has already planned the run (removals done, units to index marked pending)
and trained the index if its factory needs it. Each child gets a share of the units,
balanced by bytes, and runs the single-device encode step unchanged: its own encoder,
DataLoader, egress engine and consumers, segments under its own run id.

Chunk rows go straight from each child into the one ``metadata.sqlite``. SQLite in WAL
mode lets one writer at a time commit while the others wait on the busy timeout; each
child commits a batch of rows every two seconds, so the waits are short, and a unit is
still marked done in the same transaction order as on one device. That keeps resume
exactly as fine-grained as a single-device run, which a merge of per-child databases at
the end would lose (a crash before the merge would redo every unit), and it needs no
merge step. The parent writes the one manifest afterwards, from the folder's segments.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import IndexConfig
from ..engine.telemetry import EngineStats
from ..report import SkipReport
from ..sinks.faiss_shards import new_run_id
from ..sources.text_dataset import Unit
from .devices import child_env, share_of_cpus, split_by_size, usable_cpus
from .procs import DeviceJob, run_per_device

BUSY_TIMEOUT_MS = 600_000  # a child waits this long for another child's commit
_PROGRESS_EVERY = 0.5


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


def encode_on_devices(devices: list[str], units: list[Unit], sizes: list[int], cfg: IndexConfig,
                      out: Path, dtype: str, chunk_tokens: int, trained: str | None,
                      counts: dict, report: SkipReport, progress: bool) -> MultiDeviceStats:
    """Encode ``units`` (of ``sizes`` bytes) on ``devices``, one process each; add the
    children's counts to ``counts`` and their skipped inputs to ``report``."""
    from tqdm import tqdm

    groups = [g for g in split_by_size(sizes, len(devices)) if g]
    used = devices[:len(groups)]
    child_cfg = dataclasses.replace(cfg, devices="",
                                    num_workers=share_of_cpus(cfg.num_workers, len(used)))
    threads = max(1, usable_cpus() // len(used))
    base = new_run_id()
    jobs = []
    for i, (device, group) in enumerate(zip(used, groups)):
        env, local = child_env(device)
        jobs.append(DeviceJob(device, (local, dtype, [units[j] for j in group], child_cfg,
                                       str(out), chunk_tokens, trained, f"{base}_d{i}", threads,
                                       time.time()),
                              env))
    bar = tqdm(total=len(units), unit="unit", disable=not progress, dynamic_ncols=True)
    t0, chunks = time.perf_counter(), 0

    def on_progress(_, units_done: int, chunks_done: int) -> None:
        nonlocal chunks
        chunks += chunks_done
        bar.update(units_done)
        rate = chunks / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(devices=len(used), chunks_s=f"{rate:,.0f}", refresh=False)

    try:
        results = run_per_device(_encode_part, jobs, on_progress=on_progress)
    finally:
        bar.close()
    for r in results:
        for key, value in r["counts"].items():
            counts[key] += value
        report.entries.extend(r["skipped"])
    return MultiDeviceStats(used, [r["stats"] for r in results], [r["timing"] for r in results])


def _encode_part(device: str, dtype: str, units: list[Unit], cfg: IndexConfig, out: str,
                 chunk_tokens: int, trained: str | None, run_id: str, threads: int,
                 started_at: float, report_progress) -> dict:
    """The child: the single-device encode step on this process's share of the units."""
    t_begin = time.time()
    import torch

    from ..index.store import IndexStore
    from ..jobs.build_index import _encode_all
    from ..stages.encoder import TextEncoder

    if device == "cpu":
        torch.set_num_threads(threads)
    t_import = time.time()
    encoder = TextEncoder.load(cfg.model, device=device, dtype=dtype, cuda_graphs=cfg.cuda_graphs)
    t_model = time.time()
    report = SkipReport()
    counts = {"chunks": 0, "docs": 0, "units_done": 0}
    pending = {"units": 0, "chunks": 0, "at": time.monotonic()}

    def on_item(units_done: int, chunks: int) -> None:
        pending["units"] += units_done
        pending["chunks"] += chunks
        if time.monotonic() - pending["at"] > _PROGRESS_EVERY:
            report_progress(pending["units"], pending["chunks"])
            pending.update(units=0, chunks=0, at=time.monotonic())

    store = IndexStore(out)
    try:
        store.db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        main_loop: dict = {}
        stats = _encode_all(units, encoder, store, report, cfg, Path(out), device, chunk_tokens,
                            trained, counts, False, run_id=run_id, on_item=on_item, timing=main_loop)
    finally:
        store.close()
    if pending["units"] or pending["chunks"]:
        report_progress(pending["units"], pending["chunks"])
    t_end = time.time()
    timing = {"process_start_s": t_begin - started_at, "imports_s": t_import - t_begin,
              "model_load_s": t_model - t_import, "encode_s": t_end - t_model,
              "engine_wall_s": stats.wall_seconds, **main_loop}
    return {"counts": counts, "stats": stats, "skipped": report.entries,
            "timing": {k: round(v, 3) for k, v in timing.items()}}
