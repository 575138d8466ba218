"""One large PDF's text read whole by one process against read in parts, a page range
each, by several (what build-index's tokenizer workers do with a PDF of more than
``file_parts.PDF_PART_BYTES``), alternated, as JSON lines.

    python benchmarks/pdf_parts.py [--pages 600] [--lines 40] [--workers 2] [--repeat 3]

The PDF is made with pypdf (the tests' maker: pages of Helvetica text lines).
"""
import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _records(path: str, part=None) -> int:
    from embedingest.sources.text import iter_records

    return sum(len(text) for _, text in iter_records(path, on_skip=lambda where, reason: None, part=part))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from pdf_fixtures import make_pdf

    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=600)
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    words = "the river rose above the old stone bridge and the town watched it fall again".split()
    pages = ["\n".join(" ".join(words[(p + i + k) % len(words)] for k in range(12)) for i in range(args.lines))
             for p in range(args.pages)]
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.workers) as pool:
        path = os.path.join(tmp, "book.pdf")
        Path(path).write_bytes(make_pdf(pages))
        size = os.path.getsize(path)
        list(pool.map(_records, [path] * args.workers))  # the workers started and pypdf imported
        for rep in range(args.repeat):
            t0 = time.perf_counter()
            whole = pool.submit(_records, path).result()
            t1 = time.perf_counter()
            parts = sum(pool.map(_records, [path] * args.workers,
                                 [(p, args.workers, size) for p in range(args.workers)]))
            t2 = time.perf_counter()
            assert parts == whole, (parts, whole)
            print(json.dumps({"rep": rep, "pages": args.pages, "pdf_bytes": size, "characters": whole,
                              "workers": args.workers, "cpus": os.cpu_count(), "whole_s": round(t1 - t0, 3),
                              "parts_s": round(t2 - t1, 3), "speedup": round((t1 - t0) / (t2 - t1), 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
