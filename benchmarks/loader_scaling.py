"""How build-index's reading, chunking and tokenizing scales with DataLoader workers.

    python benchmarks/loader_scaling.py DOCS WORKERS   # e.g. 60000 1,4,8,14

Writes a corpus of DOCS paragraphs (the text benchmark's), then runs build-index's own
DataLoader over it once per worker count, doing nothing with the batches; prints docs/s
over the whole pass, the rate after the first batch, and the first batch's latency.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile
import time

from embedingest.bench.text import make_paragraphs, write_corpus
from embedingest.config import IndexConfig
from embedingest.jobs.build_index.encode import make_loader
from embedingest.sources.text_dataset import Unit
from embedingest.stages.encoder import TextEncoder


def main(docs: int, worker_counts: list[int]) -> None:
    work = pathlib.Path(tempfile.mkdtemp())
    corpus = write_corpus(make_paragraphs(docs), work / "corpus", 64)
    encoder = TextEncoder.load(None, device="cpu")
    units = [Unit(i, p.name, path=str(p)) for i, p in enumerate(sorted(corpus.glob("*.jsonl")))]
    for workers in worker_counts:
        t0 = time.perf_counter()
        done, first_docs, t_first = 0, 0, None
        for item in make_loader(units, encoder, IndexConfig(batch_size=1024), workers, 256, pin=False):
            done += item["chunks"].n_docs
            if t_first is None:
                t_first, first_docs = time.perf_counter(), done
        t_end = time.perf_counter()
        print(f"workers={workers}: {done / (t_end - t0):,.0f} docs/s, "
              f"steady {(done - first_docs) / (t_end - t_first):,.0f}, first {t_first - t0:.2f}s",
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")])
