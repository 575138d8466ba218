"""Benchmark: a job with ``--devices all`` against one GPU, on the same inputs.

``--job build-index`` (default) writes the text benchmark's corpus
(:mod:`embedingest.bench.text`: real English sentences in paragraphs of about 50 tokens,
as JSON lines), so the one-GPU row is comparable with that benchmark's build-index row.
``--job segment`` writes photo-sized JPEGs (smooth colour fields with noise, which
compress and decode like photographs) and random DeepLabV3 weights to a file, loaded
through ``--weights`` as a user's would be.

Each row is the command run as a user runs it, in a fresh process, into its own empty
folder: ``rate`` divides the inputs by the command's wall time (interpreter start and
imports included); ``call_rate`` by the job's own ``seconds``; ``steady_rate`` by the
engine's wall time (the slowest device's, for several), which leaves start-up out.

    python -m embedingest.bench.scaleout --docs 500000 --json scaleout.json
    python -m embedingest.bench.scaleout --job segment --images 8192 --json seg.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..exit_codes import EXIT_OK, EXIT_SKIPPED


@dataclass
class DevicesBenchConfig:
    job: str = "build-index"  # build-index or segment
    docs: int = 500_000  # paragraphs in the corpus (build-index)
    images: int = 8192  # JPEGs (segment)
    image_size: int = 640  # their longer side, 4:3 (segment)
    devices: str = "all"  # the --devices of the scaled-out row
    single: str = "cuda:0"  # the --device of the one-GPU row
    batch_size: int = 0  # 0: the job's default (1024 paragraphs, 16 images on a GPU)
    dtype: str = "fp16"
    model: str | None = None  # build-index: model folder; default the bundled all-MiniLM-L6-v2
    arch: str = "deeplabv3_resnet50"  # segment: the architecture of the random weights
    files: int = 128  # build-index: JSON-lines files, the units split between devices
    num_workers: int = -1  # loader workers per device process (-1: shared out)
    num_consumers: int = 0  # per device process (0: the job's default, 2 for build-index, 4 for segment)
    seed: int = 0


def run(cfg: DevicesBenchConfig, log=print) -> dict:
    """Time both runs; return ``{"config", "machine", "rows", "speedup", ...}``."""
    from .report import machine_info

    if cfg.job not in ("build-index", "segment"):
        raise SystemExit(f"--job {cfg.job!r}: use build-index or segment")
    work = Path(tempfile.mkdtemp(prefix="embedingest-scaleout-bench-"))
    try:
        inputs, options = (_text_inputs if cfg.job == "build-index" else _image_inputs)(cfg, work)
        rows = []
        for n, (name, where) in enumerate(((f"1 GPU ({cfg.single})", ["--device", cfg.single]),
                                           (f"--devices {cfg.devices}", ["--devices", cfg.devices]))):
            # Each row writes a new folder: overwriting the other row's output would charge
            # this one for deleting gigabytes.
            out = work / f"out{n}"
            cmd = [sys.executable, "-m", "embedingest", cfg.job, str(inputs), "--out", str(out),
                   "--json", "--dtype", cfg.dtype, "--num-workers", str(cfg.num_workers),
                   *options, *where,
                   *(["--num-consumers", str(cfg.num_consumers)] if cfg.num_consumers else []),
                   *(["--batch-size", str(cfg.batch_size)] if cfg.batch_size else [])]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            wall = time.perf_counter() - t0
            if done.returncode not in (EXIT_OK, EXIT_SKIPPED):
                raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}")
            summary = json.loads(done.stdout[done.stdout.index("{"):])
            rows.append(_row(name, cfg.job, summary, wall))
            shutil.rmtree(out)  # not timed
            log(f"  {name}: {rows[-1]['rate']:,.1f}/s end to end, "
                f"{rows[-1]['steady_rate']:,.1f}/s steady, {wall:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if rows[0]["outputs"] != rows[1]["outputs"]:
        raise RuntimeError(f"the two runs wrote {rows[0]['outputs']} and {rows[1]['outputs']} "
                           "outputs; they must be equal")
    one, many = rows
    return {"config": dataclasses.asdict(cfg), "machine": machine_info(), "rows": rows,
            "speedup": round(many["rate"] / one["rate"], 3),
            "call_speedup": round(many["call_rate"] / one["call_rate"], 3),
            "steady_speedup": round(many["steady_rate"] / one["steady_rate"], 3)}


def _text_inputs(cfg: DevicesBenchConfig, work: Path) -> tuple[Path, list[str]]:
    from .text import make_paragraphs, write_corpus

    corpus = write_corpus(make_paragraphs(cfg.docs, cfg.seed), work / "corpus", cfg.files)
    return corpus, ["--model", cfg.model] if cfg.model else []


def _image_inputs(cfg: DevicesBenchConfig, work: Path) -> tuple[Path, list[str]]:
    import multiprocessing

    import torch
    from torchvision.models import segmentation

    folder = work / "images"
    folder.mkdir()
    jobs = [(str(folder / f"{i // 1000:03d}" / f"{i:06d}.jpg"), cfg.image_size, cfg.seed + i)
            for i in range(cfg.images)]
    with multiprocessing.get_context("spawn").Pool() as pool:
        pool.map(_write_photo, jobs, chunksize=64)
    torch.manual_seed(cfg.seed)
    model = getattr(segmentation, cfg.arch)(weights=None, weights_backbone=None, num_classes=21,
                                            aux_loss=False)
    weights = work / "weights.pt"
    torch.save(model.state_dict(), weights)
    return folder, ["--weights", str(weights), "--arch", cfg.arch]


def _write_photo(job: tuple[str, int, int]) -> None:
    """A 4:3 JPEG of smooth colour fields and mild noise: it compresses and decodes like
    a photograph (uniform noise would be several times larger and slower)."""
    import numpy as np
    from PIL import Image

    path, side, seed = job
    rng = np.random.default_rng(seed)
    h, w = side * 3 // 4, side
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    image = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), dtype=np.float32)
    image += rng.standard_normal(image.shape, dtype=np.float32) * 6
    image = np.clip(image, 0, 255, out=image).astype(np.uint8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path, quality=90)


def _row(name: str, job: str, s: dict, wall: float) -> dict:
    engine = s["engine"] or {}
    parts = engine.get("per_device", [engine])
    count = s["docs"] if job == "build-index" else s["written"]
    engine_wall = max((p["wall_seconds"] for p in parts if p), default=0.0)
    return {"name": name, "device": s["device"], "inputs": count,
            "outputs": s["vectors_total"] if job == "build-index" else s["written"],
            "command_seconds": round(wall, 3), "rate": count / wall, "seconds": s["seconds"],
            "call_rate": count / s["seconds"] if s["seconds"] else 0.0,
            "steady_rate": count / engine_wall if engine_wall else 0.0,
            "gpu_idle_fraction": [p.get("gpu_idle_fraction") for p in parts],
            "producer_blocked_seconds": [p.get("producer_blocked_seconds") for p in parts],
            "summary": s}


def main(argv: list[str] | None = None) -> None:
    defaults = DevicesBenchConfig()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(DevicesBenchConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), default=getattr(defaults, f.name),
                        type=int if f.type == "int" else str)
    ap.add_argument("--json", help="write the result here")
    args = vars(ap.parse_args(argv))
    out = args.pop("json")
    result = run(DevicesBenchConfig(**args))
    text = json.dumps(result, indent=2, default=str)
    if out:
        Path(out).write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("speedup", "call_speedup", "steady_speedup")}
                     | {r["name"]: round(r["rate"], 1) for r in result["rows"]}))


if __name__ == "__main__":
    main()
