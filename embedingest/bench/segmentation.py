"""The seed article's workload, every loop side by side in one process and one run.

DeepLabV3-ResNet50 with random weights, batches of 64 random 3x512x512 images from a
DataLoader with pinned memory and a host-to-device prefetch stream (as the article),
21-class logits out (1.41 GB a batch in fp32). Rows: the model's forward alone (the
bound, per precision), the five seed loops, and embedingest's engine in each precision
and egress mode with two consumers' sinks: one that hands the bytes to /dev/null
without copying (the GPU is then the bound) and the article's ``tobytes()`` (the
consumers are then the bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from ..engine import EgressEngine, EngineStats
from .seed_loops import SeedLoop
from .sinks import SINKS


@dataclass
class SegBenchConfig:
    batch_size: int = 64  # images a step
    image_size: int = 512  # square input side
    num_classes: int = 21
    loader_workers: int = 8  # DataLoader processes making the random images
    consumers: int = 8  # consumer processes (seed loops and engine alike)
    slots: int = 12  # engine host slots
    warmup: int = 5  # steps before the clock starts
    steps: int = 30  # timed steps for fast loops
    slow_steps: int = 6  # timed steps for the two slowest seed loops


class FakeImages(Dataset):
    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(3, self.size, self.size)


class Prefetcher:
    """Host-to-device copies of the next batch on a side stream (the article's part one)."""

    def __init__(self, loader: DataLoader, device: torch.device, dtype, channels_last: bool):
        self.it = iter(loader)
        self.stream = torch.cuda.Stream(device)
        self.device, self.dtype, self.cl = device, dtype, channels_last
        self.next = None
        self._load()

    def _load(self) -> None:
        try:
            cpu = next(self.it)
        except StopIteration:
            self.next = None
            return
        with torch.cuda.stream(self.stream):
            x = cpu.to(self.device, non_blocking=True).to(self.dtype)
            if self.cl:
                x = x.contiguous(memory_format=torch.channels_last)
        self.next = x

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self.next is None:
            raise StopIteration
        torch.cuda.current_stream().wait_stream(self.stream)
        x = self.next
        x.record_stream(torch.cuda.current_stream())
        self._load()
        return x


def build_model(cfg: SegBenchConfig, dtype, channels_last: bool) -> torch.nn.Module:
    from torchvision.models.segmentation import deeplabv3_resnet50

    torch.manual_seed(0)
    model = deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=cfg.num_classes,
                               aux_loss=False).cuda().eval().to(dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def _loader(cfg: SegBenchConfig, steps: int) -> DataLoader:
    return DataLoader(FakeImages(steps * cfg.batch_size, cfg.image_size), batch_size=cfg.batch_size,
                      num_workers=cfg.loader_workers, pin_memory=True, persistent_workers=False,
                      prefetch_factor=4)


def timed(run_step: Callable[[int], None], sync: Callable[[], None], warmup: int, steps: int) -> float:
    """Steps per second over ``steps`` steps after ``warmup``, with drains at both ends."""
    for i in range(warmup):
        run_step(i)
    sync()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        run_step(i)
    sync()
    return steps / (time.perf_counter() - t0)


def forward_only(cfg: SegBenchConfig, precision: str) -> dict:
    dtype, cl = _precision(precision)
    model = build_model(cfg, dtype, cl)
    x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, device="cuda").to(dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        rate = timed(lambda i: model(x)["out"], torch.cuda.synchronize, cfg.warmup, cfg.steps)
    return {"name": f"forward only, {precision}", "precision": precision, "kind": "bound",
            "steps_per_s": rate}


def seed_loop(cfg: SegBenchConfig, level: int) -> dict:
    names = {1: "seed 1: sync .cpu()", 2: "seed 2: + consumer processes",
             3: "seed 3: + shared buffer pool", 4: "seed 4: + 'pinned', non_blocking, event thread",
             5: "seed 5: + egress stream (seed final)"}
    model = build_model(cfg, torch.float32, False)
    steps = cfg.slow_steps if level <= 2 else cfg.steps
    warmup = min(cfg.warmup, 3) if level <= 2 else cfg.warmup
    shape = (cfg.batch_size, cfg.num_classes, cfg.image_size, cfg.image_size)
    loop = SeedLoop(level, shape, cfg.consumers)
    data = Prefetcher(_loader(cfg, warmup + steps), torch.device("cuda"), torch.float32, False)
    try:
        with torch.inference_mode():
            rate = timed(lambda i: loop.step(i, model(next(data))["out"]), loop.sync, warmup, steps)
    finally:
        loop.close()
    return {"name": names[level], "precision": "fp32", "kind": "seed", "steps_per_s": rate,
            "pinned": loop.pinned if level >= 3 else None}


def engine_run(cfg: SegBenchConfig, precision: str, egress: str, sink: str) -> dict:
    """embedingest's engine behind the raw model (as the seed loops): ``egress`` is
    "logits" (the full tensor) or "mask" (GPU argmax)."""
    dtype, cl = _precision(precision)
    model = build_model(cfg, dtype, cl)
    data = Prefetcher(_loader(cfg, cfg.warmup + cfg.steps), torch.device("cuda"), dtype, cl)
    row = _through_engine(cfg, lambda: model(next(data))["out"], egress, SINKS[sink], _batch_ids)
    row.update(name=f"embedingest engine, {precision}, {egress}, sink={sink}", precision=precision)
    return row


def segment_stage_run(cfg: SegBenchConfig, precision: str, egress: str, sink: str) -> dict:
    """The ``segment`` job's own path: its Segmenter (uint8 in, normalised and cast on the
    GPU, channels-last), its host-to-device prefetch, the engine, and either a /dev/null
    sink (the seed's bound) or the job's MaskSink writing PNG masks (``sink="png"``)."""
    import tempfile

    from ..sinks.masks import MaskSinkFactory
    from ..stages.prefetch import prefetch

    segmenter = _segmenter(cfg, precision)
    loader = DataLoader(FakePictures((cfg.warmup + cfg.steps) * cfg.batch_size, cfg.image_size),
                        batch_size=cfg.batch_size, num_workers=cfg.loader_workers, pin_memory=True,
                        prefetch_factor=4)
    out = tempfile.mkdtemp(prefix="embedingest-bench-masks-")
    factory = MaskSinkFactory(out) if sink == "png" else SINKS[sink]
    stream = prefetch(loader, lambda b: b.to("cuda", non_blocking=True), torch.device("cuda"))

    def forward():
        logits = segmenter.logits(next(stream)[1])
        return segmenter.masks(logits) if egress == "mask" else logits

    ids = _image_ids(cfg) if sink == "png" else _batch_ids
    row = _through_engine(cfg, forward, egress, factory, ids)
    row.update(name=f"segment stage, {precision}, {egress}, sink={sink}", precision=f"stage-{precision}")
    return row


def _batch_ids(i: int):
    return i


def _image_ids(cfg: SegBenchConfig):
    from ..sources.image_decode import ImageMeta

    s = cfg.image_size
    return lambda i: tuple(ImageMeta(f"{i:05d}/{j:03d}.png", "", s, s, s, s) for j in range(cfg.batch_size))


def _through_engine(cfg: SegBenchConfig, forward: Callable[[], torch.Tensor], egress: str,
                    factory, batch_id: Callable[[int], object]) -> dict:
    """Time ``forward`` + ``submit`` per step; the engine's records give the rest."""
    with EgressEngine(factory, num_consumers=cfg.consumers, num_slots=cfg.slots,
                      device="cuda") as engine:

        def step(i: int) -> None:
            engine.mark_compute_start()
            engine.submit(batch_id(i), {egress: forward()})

        def sync() -> None:
            torch.cuda.synchronize()
            engine.flush()

        marks = {}
        with torch.inference_mode():
            rate = timed(step, lambda: (sync(), marks.setdefault("t0", time.perf_counter())),
                         cfg.warmup, cfg.steps)
        t1 = time.perf_counter()
    st = engine.stats
    nvml_idle = engine.gpu_idle_fraction(marks["t0"], t1)
    steady = EngineStats.from_records(
        [r for r in st.records if r.seq >= cfg.warmup], device=st.device,
        wall=cfg.steps / rate, pinned=st.pinned, num_slots=st.num_slots,
        num_consumers=st.num_consumers, slot_bytes=st.slot_bytes)
    busy = sum(steady.sink_seconds.values()) / (cfg.consumers * steady.wall_seconds)
    return {"kind": "engine", "steps_per_s": rate, "pinned": st.pinned,
            "copy_gbps": steady.copy_gbps,
            "gpu_idle": nvml_idle if nvml_idle is not None else steady.compute_gap_fraction,
            "compute_gap": steady.compute_gap_fraction, "consumer_busy": busy,
            "producer_blocked_s": steady.producer_blocked_seconds,
            "batch_mb": steady.bytes / max(steady.batches, 1) / 1e6,
            "records": st.records[-20:], "spans": st.spans}


class FakePictures(Dataset):
    """Random uint8 pictures, as the segment job's decoders hand them over (H, W, 3)."""

    def __init__(self, n: int, size: int):
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, 256, (self.size, self.size, 3), dtype=torch.uint8)


def _segmenter(cfg: SegBenchConfig, precision: str):
    from ..stages.segmentation import Segmenter, load_segmentation_model

    torch.manual_seed(0)
    loaded = load_segmentation_model("deeplabv3_resnet50", None, cfg.num_classes, random_weights=True)
    return Segmenter(loaded, "cuda", precision)


def stage_forward_only(cfg: SegBenchConfig, precision: str) -> dict:
    """The bound of the segment stage: its preprocess + forward on a fixed uint8 batch."""
    segmenter = _segmenter(cfg, precision)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.image_size, cfg.image_size, 3), dtype=torch.uint8,
                      device="cuda")
    rate = timed(lambda i: segmenter.logits(x), torch.cuda.synchronize, cfg.warmup, cfg.steps)
    return {"name": f"segment stage forward only, {precision}", "precision": f"stage-{precision}",
            "kind": "bound", "steps_per_s": rate}


def _precision(p: str):
    if p == "fp32":
        return torch.float32, False
    if p == "bf16":
        return torch.bfloat16, True
    if p == "fp16":
        return torch.float16, True
    raise ValueError(f"precision {p!r}: use fp32, bf16 or fp16")


def bound_of(row: dict, ratio: float | None) -> str:
    """Say what limits a run, from the engine's own measurements."""
    if row.get("kind") == "bound":
        return "gpu compute"
    busy = row.get("consumer_busy")
    if ratio is not None and ratio >= 0.9:
        return "gpu compute"
    if busy is not None and busy > 0.6:
        return f"consumers / host CPU ({busy:.0%} busy)"
    if row.get("kind") == "seed":
        return "copy/host (see article)"
    return "host / input"


def run_all(cfg: SegBenchConfig, select: set[str] | None = None, log=print) -> list[dict]:
    """Run every row (or those whose group is in ``select``) and add ratios."""
    plan: list[tuple[str, Callable[[], dict]]] = [
        ("bound", lambda: forward_only(cfg, "fp32")),
        ("bound", lambda: forward_only(cfg, "bf16")),
        *[("seed", (lambda lv=lv: seed_loop(cfg, lv))) for lv in (1, 2, 3, 4, 5)],
        ("engine", lambda: engine_run(cfg, "fp32", "logits", "devnull")),
        ("engine", lambda: engine_run(cfg, "fp32", "logits", "tobytes")),
        ("engine", lambda: engine_run(cfg, "bf16", "logits", "devnull")),
        ("bound", lambda: stage_forward_only(cfg, "fp32")),
        ("bound", lambda: stage_forward_only(cfg, "bf16")),
        ("segment", lambda: segment_stage_run(cfg, "fp32", "logits", "devnull")),
        ("segment", lambda: segment_stage_run(cfg, "bf16", "logits", "devnull")),
        ("segment", lambda: segment_stage_run(cfg, "bf16", "mask", "devnull")),
        ("segment", lambda: segment_stage_run(cfg, "bf16", "mask", "png")),
    ]
    rows = []
    for group, fn in plan:
        if select and group not in select:
            continue
        row = fn()
        log(f"  {row['name']}: {row['steps_per_s']:.2f} steps/s")
        rows.append(row)
        torch.cuda.empty_cache()
    bounds = {r["precision"]: r["steps_per_s"] for r in rows if r["kind"] == "bound"}
    seed_final = next((r["steps_per_s"] for r in rows if r["name"].startswith("seed 5")), None)
    for r in rows:
        b = bounds.get(r["precision"])
        r["vs_bound"] = r["steps_per_s"] / b if b else None
        r["vs_seed_final"] = r["steps_per_s"] / seed_final if seed_final else None
        r["bound"] = bound_of(r, r["vs_bound"])
        r["rate"] = r["steps_per_s"]
    return rows
