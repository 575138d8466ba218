"""Chunk metadata into sqlite from a thread, beside a busy Python thread: rows bound one
by one (``executemany``) against one JSON statement per batch (``json_each``).

    python benchmarks/metadata_gil.py [ROWS]

The busy thread stands for build-index's main loop. ``executemany`` takes the GIL for
every row, so beside it the writer crawls; the JSON statement runs without the GIL.
Prints rows/s for each way alone and beside the busy thread.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from embedingest.index.store import IndexStore

TEXT = "the quick brown fox jumps over the lazy dog " * 6


def batches(rows: int, per_batch: int = 1000) -> list[list[tuple]]:
    out = []
    for b in range(0, rows, per_batch):
        unit = b // per_batch
        out.append([(unit << 32 | c, unit, f"r{c}", c, 0, len(TEXT), TEXT) for c in range(per_batch)])
    return out


def rate(way: str, data: list[list[tuple]], busy: bool) -> float:
    store = IndexStore(Path(tempfile.mkdtemp()))
    payloads = [json.dumps(b) for b in data] if way == "json_each" else data
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(stop.is_set, True)])
    if busy:
        spinner.start()
    try:
        t = time.perf_counter()
        for p in payloads:
            if way == "json_each":
                store.insert_chunk_json([p])
            else:
                with store.db as db:
                    db.executemany("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?, ?, ?, ?)", p)
        return sum(map(len, data)) / (time.perf_counter() - t)
    finally:
        stop.set()
        if busy:
            spinner.join()


def main(rows: int) -> None:
    data = batches(rows)
    for way in ("executemany", "json_each"):
        alone, beside = rate(way, data, False), rate(way, data, True)
        print(f"{way}: {alone:,.0f} rows/s alone, {beside:,.0f} beside a busy thread", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000)
