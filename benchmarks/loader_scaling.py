"""How build-index's reading, chunking and tokenizing scales with DataLoader workers.

    python benchmarks/loader_scaling.py DOCS WORKERS   # e.g. 60000 1,4,8,14

Writes a corpus of DOCS paragraphs (the text benchmark's), then runs build-index's own
DataLoader over it once per worker count, doing nothing with the batches; prints docs/s
over the whole pass, the rate after the first batch, and the first batch's latency.
"""
import sys, time, tempfile, pathlib, os, resource
from embedingest.bench.text import make_paragraphs, write_corpus
from embedingest.config import IndexConfig
from embedingest.jobs.build_index import _loader
from embedingest.sources.text_dataset import Unit
from embedingest.stages.encoder import TextEncoder

def main():
    work = pathlib.Path(tempfile.mkdtemp())
    corpus = write_corpus(make_paragraphs(int(sys.argv[1])), work / "c", 64)
    enc = TextEncoder.load(None, device="cpu")
    units = [Unit(i, p.name, path=str(p)) for i, p in enumerate(sorted(corpus.glob("*.jsonl")))]
    for w in [int(x) for x in sys.argv[2].split(",")]:
        cfg = IndexConfig(batch_size=1024)
        t0 = time.perf_counter(); c0 = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        docs = 0; tf = None
        for item in _loader(units, enc, cfg, w, 256, pin=False):
            docs += item["chunks"].n_docs
            if tf is None: tf = time.perf_counter(); d0 = docs
        dt = time.perf_counter() - t0
        print(f"workers={w}: {docs/dt:,.0f} docs/s, steady {(docs-d0)/(time.perf_counter()-tf):,.0f}, first {tf-t0:.2f}s", flush=True)

if __name__ == "__main__":
    main()
