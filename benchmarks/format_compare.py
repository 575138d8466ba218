"""build-index on the paragraph corpus with two versions of the package side by side in one
run: for the index format change, where each writer owns its shard's rows (format 2)
against the main process's one SQLite writer (format 1).

    git archive OLD_COMMIT embedingest | tar -x -C /tmp/old
    python benchmarks/format_compare.py --old /tmp/old --new . --docs 300000 --json out.json

Each build is a fresh ``python -m embedingest build-index CORPUS --json`` with the given
tree first on PYTHONPATH, into its own empty folder, the two trees alternating
``--repeats`` times after an untimed warm-up of each. It prints, per build: docs/s of
the command and of the engine span, and the main process's time per batch
(``timing.forward_submit_s`` over the batches: the work the process that drives the
GPU does per batch), with the summaries in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedingest.bench.text import make_paragraphs, write_corpus  # noqa: E402


def build(tree: Path, corpus: Path, out: Path, dtype: str, batch_size: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "embedingest", "build-index", str(corpus),
                           "--out", str(out), "--dtype", dtype, "--batch-size", str(batch_size),
                           "--json"], env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"build-index with {tree} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    s = json.loads(proc.stdout)
    eng = s.get("engine") or {}
    timing = s.get("timing") or {}
    batches = eng.get("batches") or s.get("batches") or 0
    return {"tree": str(tree), "command_s": wall, "docs": s["docs"],
            "docs_per_s_command": s["docs"] / wall,
            "docs_per_s_steady": s["docs"] / eng["wall_seconds"] if eng.get("wall_seconds") else None,
            "batches": batches, "forward_submit_s": timing.get("forward_submit_s"),
            "main_ms_per_batch": (1e3 * timing["forward_submit_s"] / batches
                                  if batches and timing.get("forward_submit_s") is not None else None),
            "gpu_idle": eng.get("gpu_idle_fraction"), "summary": s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="a folder holding the old embedingest package")
    ap.add_argument("--new", type=Path, default=REPO)
    ap.add_argument("--docs", type=int, default=300_000)
    ap.add_argument("--files", type=int, default=128)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(make_paragraphs(args.docs), Path(tmp) / "corpus", args.files)
        trees = {"old": args.old.resolve(), "new": args.new.resolve()}
        for name, tree in trees.items():  # warm-up: page cache, compiled bytecode
            build(tree, corpus, Path(tmp) / f"warm-{name}", args.dtype, args.batch_size)
        for r in range(args.repeats):
            for name, tree in trees.items():
                row = build(tree, corpus, Path(tmp) / f"{name}-{r}", args.dtype, args.batch_size)
                row["name"] = name
                rows.append(row)
                print(f"{name} #{r}: {row['docs_per_s_command']:,.0f} docs/s command, "
                      f"{row['docs_per_s_steady'] or 0:,.0f} steady, main process "
                      f"{row['main_ms_per_batch'] or 0:.2f} ms/batch over {row['batches']} batches, "
                      f"GPU idle {row['gpu_idle']}", flush=True)
    med = {n: {k: statistics.median(r[k] for r in rows if r["name"] == n and r[k] is not None)
               for k in ("docs_per_s_command", "docs_per_s_steady", "main_ms_per_batch")}
           for n in ("old", "new")}
    for k in ("docs_per_s_command", "docs_per_s_steady", "main_ms_per_batch"):
        print(f"{k}: old {med['old'][k]:,.2f}, new {med['new'][k]:,.2f}, new/old {med['new'][k] / med['old'][k]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": {"host": platform.node(), "python": platform.python_version(),
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
            "command": " ".join(sys.argv), "medians": med, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
