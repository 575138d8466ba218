"""Opening an index of format 2 and fetching the rows of a top-10, on the CPU.

    python benchmarks/index_lookup.py [--chunks 1000000] [--dim 64] [--text-chars 1000]
                                      [--writers 2] [--commit-every 200000] [--dir DIR]

Builds a synthetic index the way build-index's consumers do (batches of 256 rows, dealt
round robin to ``--writers`` shard writers, a shard committed every ``--commit-every``
rows; ids ``unit_no << 32 | chunk_no`` for units of 20 chunks; texts of random words),
then times, each in a fresh process so nothing is cached in Python:

* open: ``open_index`` (the manifest, every shard's commit record and vectors file,
  the ids sorted once, the Parquet footers), imports excluded;
* fetch: ``Index.chunks`` (every column) of 10 ids drawn at random from the index, the
  ids of one top-10 result, for ``--queries`` results; then of the top-10s of a few real
  searches, with the FAISS search itself (Flat) for comparison.

Prints one JSON object: wall times, and the CPU time of the process during a fetch (what
a fetch costs when the cores are not shared; the load average says how busy they were). The
page cache is warm (the files were just written): a first query on a cold disk also
pays its reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

UNIT_CHUNKS = 20
BATCH = 256


def build(folder: Path, chunks: int, dim: int, text_chars: int, writers: int, commit_every: int) -> None:
    from embedingest.index.shards import BatchMeta, encode_chunks
    from embedingest.sinks.shard_writer import ShardWriterFactory

    rng = np.random.default_rng(0)
    words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 10)))
                      for _ in range(5000)])
    n_words = max(1, text_chars // 6)
    from embedingest.index.store import IndexStore, Manifest

    folder.mkdir(parents=True, exist_ok=True)
    IndexStore(folder).write_manifest(Manifest(model={"name": "synthetic"}, dim=dim, format=2))
    factory = ShardWriterFactory(str(folder), dim, "Flat", commit_every=commit_every)
    sinks = [factory(w) for w in range(writers)]
    ids_all = np.arange(chunks, dtype=np.int64)
    ids_all = (ids_all // UNIT_CHUNKS) << 32 | (ids_all % UNIT_CHUNKS)
    for b, start in enumerate(range(0, chunks, BATCH)):
        ids = ids_all[start:start + BATCH]
        n = len(ids)
        picks = words[rng.integers(0, len(words), (n, n_words))]
        texts = [" ".join(row) for row in picks]
        units = (ids >> 32).tolist()
        chunk_nos = (ids & 0xFFFFFFFF).tolist()
        meta = BatchMeta(b, encode_chunks(ids.tolist(), [f"docs/file{u}.txt" for u in units], [None] * n,
                                          chunk_nos, [c * 900 for c in chunk_nos],
                                          [c * 900 + len(t) for c, t in zip(chunk_nos, texts)], texts),
                         tuple((u, UNIT_CHUNKS) for u, c in zip(units, chunk_nos) if c == UNIT_CHUNKS - 1))
        emb = rng.standard_normal((n, dim), dtype=np.float32)
        sinks[b % writers](meta, {"emb": emb, "ids": ids})
    for sink in sinks:
        sink.close()


def measure(folder: Path, queries: int, dim: int) -> dict:
    """Run in a fresh process: open_index, then fetch the rows of ``queries`` top-10s."""
    import faiss  # noqa: F401  (imports are not part of opening)

    from embedingest.index.search import open_index

    t0 = time.perf_counter()
    index = open_index(folder)
    open_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    all_ids = index.rows._sorted
    fetch, cpu = [], []
    for _ in range(queries):
        ids = all_ids[rng.integers(0, len(all_ids), 10)]
        t, c = time.perf_counter(), time.process_time()
        got = index.chunks(ids)
        fetch.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        assert len(got) == len(set(ids.tolist()))
    search, real = [], []
    for _ in range(5):
        q = rng.standard_normal((1, dim), dtype=np.float32)
        t = time.perf_counter()
        _, ids = index.search_raw(q, 10)
        search.append(time.perf_counter() - t)
        t = time.perf_counter()
        index.chunks(ids[0])
        real.append(time.perf_counter() - t)
    ms = np.array(fetch) * 1000
    cpu_ms = np.array(cpu) * 1000
    return {"chunks": index.ntotal, "shards": len(index.shards), "open_index_s": round(open_s, 3),
            "fetch_top10_ms": {"first": round(float(ms[0]), 2), "median": round(float(np.median(ms)), 2),
                               "p95": round(float(np.percentile(ms, 95)), 2),
                               "max": round(float(ms.max()), 2)},
            "fetch_top10_cpu_ms": {"median": round(float(np.median(cpu_ms)), 2),
                                   "p95": round(float(np.percentile(cpu_ms, 95)), 2)},
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "fetch_top10_of_searches_ms_median": round(float(np.median(real)) * 1000, 2),
            "faiss_search_flat_ms_median": round(float(np.median(search)) * 1000, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--text-chars", type=int, default=1000)
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--commit-every", type=int, default=200_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--dir", type=Path, help="Build here (kept); default a temporary folder.")
    ap.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure_only:
        print(json.dumps(measure(args.dir, args.queries, args.dim)))
        return
    folder = args.dir or Path(tempfile.mkdtemp(prefix="index-lookup-"))
    t = time.perf_counter()
    if not (folder / "shards").is_dir():
        build(folder, args.chunks, args.dim, args.text_chars, args.writers, args.commit_every)
    build_s = time.perf_counter() - t
    out = subprocess.run([sys.executable, __file__, "--measure-only", "--dir", str(folder),
                          "--queries", str(args.queries), "--dim", str(args.dim)],
                         check=True, capture_output=True, text=True, env=os.environ)
    result = json.loads(out.stdout)
    size = sum(p.stat().st_size for p in (folder / "shards").iterdir())
    result |= {"build_s": round(build_s, 1), "folder_bytes": size, "dim": args.dim,
               "text_chars": args.text_chars, "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
