"""Recall@10 of an IVF index against exact (Flat) search at the nprobe values given: what
faiss's own default (1) and build-index's default for a new IVF index (16) find, on the
search-defaults tests' corpus (240 short notes), as JSON lines.

    python benchmarks/ivf_default_recall.py [--lists 32] [--nprobe 1 16]
"""
import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

TOPICS = ["rivers", "bread", "volcanoes", "networks", "whales", "chess", "orbits", "glaciers"]
RECORDS = [(f"r{i}", f"Note {i} on {TOPICS[i % 8]} and {TOPICS[(i * 3) % 8]}, item {i * 7919 % 1000}.")
           for i in range(240)]


def main() -> None:
    from embedingest import build_index, open_index

    ap = argparse.ArgumentParser()
    ap.add_argument("--lists", type=int, default=32)
    ap.add_argument("--nprobe", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    fast = dict(num_workers=0, num_consumers=2, batch_size=64, train_size=len(RECORDS), device="cpu")
    queries = [f"{t} and {u}" for t in TOPICS for u in TOPICS[:4]]
    with tempfile.TemporaryDirectory() as tmp:
        build_index(RECORDS, out=str(Path(tmp) / "flat"), **fast)
        build_index(RECORDS, out=str(Path(tmp) / "ivf"), index=f"IVF{args.lists},Flat", **fast)
        with open_index(Path(tmp) / "flat") as flat:
            exact = [{h.id for h in hits} for hits in flat.search(queries, 10)]
        for nprobe in args.nprobe:
            with open_index(Path(tmp) / "ivf", params=f"nprobe={nprobe}") as ivf:
                found = [{h.id for h in hits} for hits in ivf.search(queries, 10)]
            recall = float(np.mean([len(f & e) / 10 for f, e in zip(found, exact)]))
            print(json.dumps({"lists": args.lists, "nprobe": nprobe, "queries": len(queries),
                              "vectors": len(RECORDS), "recall_at_10": round(recall, 3)}))


if __name__ == "__main__":
    main()
