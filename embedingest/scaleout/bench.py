"""Benchmark: build-index with ``--devices all`` against one GPU, on the same corpus.

The corpus is the text benchmark's (:mod:`embedingest.bench.text`: real English
sentences in paragraphs of about 50 tokens, as JSON lines), so the one-GPU row is
comparable with that benchmark's build-index row. Each row is the ``build-index``
command run as a user runs it, in a fresh process from an empty index: ``docs_per_s``
divides by the command's wall time (interpreter start and imports included);
``call_docs_per_s`` by the ``build_index()`` call's own; ``steady_docs_per_s`` by the
engine's wall time (the slowest device's, for several), which leaves start-up out.

    python -m embedingest.scaleout.bench --docs 500000 --json scaleout.json
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


@dataclass
class DevicesBenchConfig:
    docs: int = 500_000  # paragraphs in the corpus
    devices: str = "all"  # the --devices of the scaled-out row
    single: str = "cuda:0"  # the --device of the one-GPU row
    batch_size: int = 1024  # build-index's default on a GPU
    dtype: str = "fp16"
    model: str | None = None  # model folder; default the bundled all-MiniLM-L6-v2
    files: int = 128  # JSON-lines files: the units split between devices
    num_workers: int = -1  # tokenizer workers per device process (-1: shared out)
    num_consumers: int = 2  # per device process
    seed: int = 0


def run(cfg: DevicesBenchConfig, log=print) -> dict:
    """Time both builds; return ``{"config", "machine", "rows", "speedup", ...}``."""
    from ..bench.report import machine_info
    from ..bench.text import make_paragraphs, write_corpus

    work = Path(tempfile.mkdtemp(prefix="embedingest-scaleout-bench-"))
    try:
        corpus = write_corpus(make_paragraphs(cfg.docs, cfg.seed), work / "corpus", cfg.files)
        rows = []
        for n, (name, where) in enumerate(((f"1 GPU ({cfg.single})", ["--device", cfg.single]),
                                           (f"--devices {cfg.devices}", ["--devices", cfg.devices]))):
            # Each row builds a new folder: overwriting the other row's index would charge
            # this one for deleting gigabytes.
            out = work / f"index{n}"
            cmd = [sys.executable, "-m", "embedingest", "build-index", str(corpus), "--out",
                   str(out), "--json", "--dtype", cfg.dtype,
                   "--batch-size", str(cfg.batch_size), "--num-workers", str(cfg.num_workers),
                   "--num-consumers", str(cfg.num_consumers), *where,
                   *(["--model", cfg.model] if cfg.model else [])]
            t0 = time.perf_counter()
            done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            wall = time.perf_counter() - t0
            if done.returncode not in (0, 3):  # 3: finished, some inputs skipped
                raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}")
            s = json.loads(done.stdout[done.stdout.index("{"):])
            rows.append(_row(name, s, wall))
            shutil.rmtree(out)  # not timed
            log(f"  {name}: {rows[-1]['docs_per_s']:,.0f} docs/s end to end, "
                f"{rows[-1]['steady_docs_per_s']:,.0f} steady, {wall:.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if rows[0]["vectors"] != rows[1]["vectors"]:
        raise RuntimeError(f"the two builds hold {rows[0]['vectors']} and {rows[1]['vectors']} "
                           "vectors; they must be equal")
    one, many = rows
    return {"config": dataclasses.asdict(cfg), "machine": machine_info(), "rows": rows,
            "speedup": round(many["docs_per_s"] / one["docs_per_s"], 3),
            "call_speedup": round(many["call_docs_per_s"] / one["call_docs_per_s"], 3),
            "steady_speedup": round(many["steady_docs_per_s"] / one["steady_docs_per_s"], 3)}


def _row(name: str, s: dict, wall: float) -> dict:
    engine = s["engine"] or {}
    parts = engine.get("per_device", [engine])
    return {"name": name, "device": s["device"], "docs": s["docs"], "chunks": s["chunks"],
            "vectors": s["vectors_total"], "command_seconds": round(wall, 3),
            "docs_per_s": s["docs"] / wall, "seconds": s["seconds"], "call_docs_per_s": s["docs_per_s"],
            "steady_docs_per_s": s["docs"] / engine["wall_seconds"] if engine else 0.0,
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
                     | {r["name"]: round(r["docs_per_s"]) for r in result["rows"]}))


if __name__ == "__main__":
    main()
