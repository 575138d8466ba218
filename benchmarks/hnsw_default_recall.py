"""Recall@10 of an HNSW index against exact (Flat) search at the efSearch values given:
what faiss's own default (16) and build-index's default for a new HNSW index (64) find,
and each one's time per query, on notes made of random words (the bundled model's
vectors of them), as JSON lines.

    python benchmarks/hnsw_default_recall.py [--notes 20000] [--links 32] [--ef-search 16 64]
"""
import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ("river bread volcano network whale chess orbit glacier harbour violin desert lantern copper "
         "meadow engine poem tide falcon quartz orchard thunder ledger canyon pepper comet saddle "
         "mirror garden signal marble winter cotton rocket island forest candle bridge shadow ember "
         "compass ribbon anchor summit velvet prairie beacon pebble harvest spiral cathedral").split()


def notes(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` short notes of 6-14 random words each: many distinct, overlapping topics."""
    rng = random.Random(seed)
    return [(f"n{i}", " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + ".") for i in range(n)]


def main() -> None:
    from embedingest import build_index, open_index

    ap = argparse.ArgumentParser()
    ap.add_argument("--notes", type=int, default=20000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--links", type=int, default=32)
    ap.add_argument("--ef-search", type=int, nargs="+", default=[16, 64])
    args = ap.parse_args()
    records = notes(args.notes)
    queries = [text for _, text in notes(args.queries, seed=1)]
    fast = dict(num_workers=0, num_consumers=2, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        build_index(records, out=str(Path(tmp) / "flat"), **fast)
        build_index(records, out=str(Path(tmp) / "hnsw"), index=f"HNSW{args.links}", **fast)
        with open_index(Path(tmp) / "flat") as flat:
            vectors = flat.encoder.encode(queries)
            exact = [set(row) for row in flat.search_raw(vectors, 10)[1].tolist()]
        for ef in args.ef_search:
            with open_index(Path(tmp) / "hnsw", params=f"efSearch={ef}") as hnsw:
                t0 = time.perf_counter()
                found = [set(row) for row in hnsw.search_raw(vectors, 10)[1].tolist()]
                took = time.perf_counter() - t0
            recall = float(np.mean([len(f & e) / 10 for f, e in zip(found, exact)]))
            print(json.dumps({"factory": f"HNSW{args.links}", "ef_search": ef, "queries": len(queries),
                              "vectors": len(records), "recall_at_10": round(recall, 3),
                              "ms_per_query": round(1000 * took / len(queries), 3)}), flush=True)


if __name__ == "__main__":
    main()
