"""build-index on several devices of one host: the encode step of
:func:`~embedingest.jobs.build_index.build_index`, one process per device (the generic
process handling is :mod:`embedingest.scaleout.procs`).

The children start first and load the encoder, each on its device; the parent holds no
model and never touches CUDA, so on a GPU host it can fork them (no interpreter start
and no torch import in each: seconds that one GPU does not pay either). It takes what the
manifest needs from the first child's encoder (:class:`EncoderOnDevices`), plans the run
(removals done, units to index marked pending), has the first child train the index if
its factory needs it, then gives each child a share of the units, balanced by bytes.
Each runs the single-device encode step unchanged: its own DataLoader, egress engine and
consumers, shards under its own run id.

Chunk rows go with their vectors: each child's consumers commit their own shards (rows,
vectors, embeddings), so no file is shared between the children and nothing per chunk
passes through the parent. Which units are done is what the committed shards say, so
resume is as fine-grained as on one device. The parent writes the one manifest
afterwards, from the committed shards.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from ...config import IndexConfig
from ...index.shard_store import ShardStore
from ...report import SkipReport
from ...scaleout.devices import child_env, share_of_cpus, split_by_size, usable_cpus
from ...scaleout.procs import BatchedProgress, DeviceJob, DeviceProcesses, start_method
from ...scaleout.stats import MultiDeviceStats
from ...outfiles import new_run_id
from ...sources.text_dataset import Unit
from .encode import encode_units, train_if_needed


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
        from ...stages.encoder import import_model_code

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

    from ...stages.encoder import TextEncoder

    if device == "cpu":
        torch.set_num_threads(threads)
    t_import = time.time()
    encoder = TextEncoder.load(model, device=device, dtype=dtype, cuda_graphs=cuda_graphs)
    t_ready = time.time()
    timing = {"start_method": start_method, "process_start_s": t_begin - started_at,
              "imports_s": t_import - t_begin, "load_model_s": t_ready - t_import, "ready_at": t_ready}
    return (encoder, timing), encoder.info()


def _train_part(prepared, out: str, manifest, units: list[Unit], cfg: IndexConfig, chunk_tokens: int,
                report_progress) -> str | None:
    encoder, _ = prepared
    with ShardStore(out) as store:
        return train_if_needed(store, manifest, encoder, units, cfg, chunk_tokens)


def _encode_part(prepared, units: list[Unit], cfg: IndexConfig, out: str, chunk_tokens: int,
                 trained: str | None, run_id: str, report_progress) -> dict:
    """The child: the single-device encode step on this process's share of the units."""
    encoder, timing = prepared
    t_model = time.time()
    # How long the loaded encoder waited for the parent's plan (start-up hidden by it).
    timing["waited_for_work_s"] = t_model - timing.pop("ready_at")
    report = SkipReport()
    counts = {"chunks": 0, "docs": 0, "units_done": 0}
    progress = BatchedProgress(report_progress)
    store = ShardStore(out)  # read only: the index generation its shards are written in
    try:
        loop_timing: dict = {}
        stats = encode_units(units, encoder, store, report, cfg, Path(out), str(encoder.device), chunk_tokens,
                            trained, counts, False, run_id=run_id, on_item=progress.add, timing=loop_timing)
    finally:
        store.close()
    progress.flush()
    timing.update(encode_s=time.time() - t_model, engine_wall_s=stats.wall_seconds, **loop_timing)
    return {"counts": counts, "stats": stats, "skipped": report.entries,
            "timing": {k: round(v, 3) if isinstance(v, float) else v for k, v in timing.items()}}


class SeveralDevices:
    """Where build-index runs on several devices of one host: one process per device,
    started at once (:func:`start_device_processes`), with the interface of
    :class:`~.encode.OneDevice`."""

    def __init__(self, devices: list[str], cfg: IndexConfig, dtype: str):
        self.devices = devices
        self.device = devices[0]  # the one whose timeline is drawn
        self.name = ",".join(devices)
        self.procs = start_device_processes(devices, cfg, dtype)

    def describe(self, cfg: IndexConfig) -> EncoderOnDevices:
        """The children's encoder, loaded while this process got here (all the plan needs)."""
        return encoder_on_devices(self.procs)

    def load_encoder(self, cfg: IndexConfig, facts: EncoderOnDevices | None = None) -> EncoderOnDevices:
        return facts if facts is not None else encoder_on_devices(self.procs)

    def start_batches(self, units: list[Unit], facts, cfg: IndexConfig, chunk_tokens: int,
                      store: ShardStore) -> bool:
        """Nothing starts early here: each child starts its own loader (False)."""
        return False

    def train(self, store: ShardStore, manifest, encoder, units: list[Unit], cfg: IndexConfig,
              chunk_tokens: int) -> str | None:
        return train_on_device(self.procs, store.folder, manifest, units, cfg, chunk_tokens)

    def encode(self, units: list[Unit], sizes: list[int], encoder, store: ShardStore,
               report: SkipReport, cfg: IndexConfig, chunk_tokens: int, trained: str | None,
               counts: dict, progress: bool, timing: dict) -> MultiDeviceStats:
        """``timing`` stays empty: each device's is in its part of the engine summary."""
        return encode_on_devices(self.procs, units, sizes, cfg, store.folder, chunk_tokens, trained,
                                 counts, report, progress)

    def engines(self, stats: MultiDeviceStats) -> list:
        """(device, engine stats) pairs, for the trace."""
        return list(zip(stats.devices, stats.per_device))

    def close(self) -> None:
        self.procs.close()
