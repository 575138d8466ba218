"""build-index on several devices of one host: the encode step of
:func:`~embedingest.jobs.build_index.build_index`, one process per device.

The children start first and load the encoder, each on its device; the parent holds no
model and never touches CUDA, so on a GPU host it can fork them (no interpreter start
and no torch import in each: seconds that one GPU does not pay either). It takes what the
manifest needs from the first child's encoder (:class:`EncoderOnDevices`), plans the run
(removals done, units to index marked pending), has the first child train the index if
its factory needs it, then gives each child a share of the units, balanced by bytes.
Each runs the single-device encode step unchanged: its own DataLoader, egress engine and
consumers, segments under its own run id.

Chunk rows go straight from each child into the one ``metadata.sqlite``. SQLite in WAL
mode lets one writer at a time commit while the others wait on the busy timeout; each
child's metadata thread (``index/writer.py``) commits a batch of rows a few times a
second, so the waits are short, and a unit is
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
from .procs import BatchedProgress, DeviceJob, DeviceProcesses, start_method


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


@dataclass
class EncoderOnDevices:
    """The parent's view of the encoder its device processes hold: what the manifest and
    the chunking need, from the first child's :meth:`TextEncoder.info`."""

    description: dict

    def info(self) -> dict:
        return self.description

    @property
    def dim(self) -> int:
        return int(self.description["dim"])

    @property
    def max_seq_length(self) -> int:
        return int(self.description["max_seq_length"])

    def release(self) -> None:
        """Nothing to free here: the children hold the model."""


def start_device_processes(devices: list[str], cfg: IndexConfig, dtype: str) -> DeviceProcesses:
    """Start one process per device now; each loads the encoder on its device while the
    caller plans the run, then serves :func:`encoder_on_devices`, :func:`train_on_device`
    and :func:`encode_on_devices`."""
    threads = max(1, usable_cpus() // len(devices))
    method = start_method(devices)
    if method == "fork":
        # Once here, for the children to share: it is the bulk of loading an encoder, and
        # children importing it at once contend for the same cores and files.
        from ..stages.encoder import import_model_code

        import_model_code(cfg.model)
    jobs = []
    for device in devices:
        env, local = child_env(device)
        jobs.append(DeviceJob(device, (local, dtype, cfg.model, cfg.cuda_graphs, threads, time.time(),
                                      method), env))
    return DeviceProcesses(_load_encoder, jobs, start_method=method)


def encoder_on_devices(procs: DeviceProcesses) -> EncoderOnDevices:
    """The encoder as the first device process loaded it (waits until it has)."""
    return EncoderOnDevices(procs.info(0))


def train_on_device(procs: DeviceProcesses, out: Path, manifest, units: list[Unit], cfg: IndexConfig,
                    chunk_tokens: int) -> str | None:
    """Train the index factory in the first device process, as one device would."""
    return procs.call(0, _train_part, (str(out), manifest, units, cfg, chunk_tokens))


def encode_on_devices(procs: DeviceProcesses, units: list[Unit], sizes: list[int], cfg: IndexConfig,
                      out: Path, chunk_tokens: int, trained: str | None, counts: dict,
                      report: SkipReport, progress: bool) -> MultiDeviceStats:
    """Encode ``units`` (of ``sizes`` bytes) in the processes of
    :func:`start_device_processes`, split by size; add the children's counts to
    ``counts`` and their skipped inputs to ``report``."""
    from tqdm import tqdm

    groups = split_by_size(sizes, len(procs.jobs))
    used = [job.name for job, group in zip(procs.jobs, groups) if group]
    child_cfg = dataclasses.replace(cfg, devices="",
                                    num_workers=share_of_cpus(cfg.num_workers, len(used)))
    base = new_run_id()
    work = [([units[j] for j in group], child_cfg, str(out), chunk_tokens, trained, f"{base}_d{i}")
            if group else None for i, group in enumerate(groups)]
    bar = tqdm(total=len(units), unit="unit", disable=not progress, dynamic_ncols=True)
    t0, chunks = time.perf_counter(), 0

    def on_progress(_, units_done: int, chunks_done: int) -> None:
        nonlocal chunks
        chunks += chunks_done
        bar.update(units_done)
        rate = chunks / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(devices=len(used), chunks_s=f"{rate:,.0f}", refresh=False)

    try:
        results = [r for r in procs.run(_encode_part, work, on_progress=on_progress) if r is not None]
    finally:
        bar.close()
    for r in results:
        for key, value in r["counts"].items():
            counts[key] += value
        report.entries.extend(r["skipped"])
    return MultiDeviceStats(used, [r["stats"] for r in results], [r["timing"] for r in results])


def _load_encoder(device: str, dtype: str, model: str | None, cuda_graphs: bool, threads: int,
                  started_at: float, start_method: str):
    """The child's start-up: imports and the encoder on its device, timed. Returns the
    child's state and, for the parent, the encoder's description."""
    t_begin = time.time()
    import torch

    from ..stages.encoder import TextEncoder

    if device == "cpu":
        torch.set_num_threads(threads)
    t_import = time.time()
    encoder = TextEncoder.load(model, device=device, dtype=dtype, cuda_graphs=cuda_graphs)
    t_ready = time.time()
    timing = {"start_method": start_method, "process_start_s": t_begin - started_at,
              "imports_s": t_import - t_begin, "model_load_s": t_ready - t_import, "ready_at": t_ready}
    return (encoder, timing), encoder.info()


def _train_part(prepared, out: str, manifest, units: list[Unit], cfg: IndexConfig, chunk_tokens: int,
                report_progress) -> str | None:
    from ..index.store import IndexStore
    from ..jobs.build_index import _train_if_needed

    encoder, _ = prepared
    with IndexStore(out) as store:
        return _train_if_needed(store, manifest, encoder, units, cfg, chunk_tokens)


def _encode_part(prepared, units: list[Unit], cfg: IndexConfig, out: str, chunk_tokens: int,
                 trained: str | None, run_id: str, report_progress) -> dict:
    """The child: the single-device encode step on this process's share of the units."""
    from ..index.store import IndexStore
    from ..jobs.build_index import _encode_all

    encoder, timing = prepared
    t_model = time.time()
    # How long the loaded encoder waited for the parent's plan (start-up hidden by it).
    timing["waited_for_work_s"] = t_model - timing.pop("ready_at")
    report = SkipReport()
    counts = {"chunks": 0, "docs": 0, "units_done": 0}
    progress = BatchedProgress(report_progress)
    store = IndexStore(out)  # its rows go through MetadataWriter's own connection (busy timeout)
    try:
        main_loop: dict = {}
        stats = _encode_all(units, encoder, store, report, cfg, Path(out), str(encoder.device), chunk_tokens,
                            trained, counts, False, run_id=run_id, on_item=progress.add, timing=main_loop)
    finally:
        store.close()
    progress.flush()
    timing.update(encode_s=time.time() - t_model, engine_wall_s=stats.wall_seconds, **main_loop)
    return {"counts": counts, "stats": stats, "skipped": report.entries,
            "timing": {k: round(v, 3) if isinstance(v, float) else v for k, v in timing.items()}}
