"""Where the paragraphs build's plan and close go: the build twice in one process with its
plan's steps timed (and the forks counted), after a 150,000-vector shard's faiss file written
alone, its parts timed.

    python benchmarks/para_parts_probe.py OUT_FOLDER 300000 cuda
"""
import hashlib, json, os, sys, time
from pathlib import Path

T = []
def wrap(mod, name, label=None):
    f = getattr(mod, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T.append((label or name, t, time.perf_counter()))
    setattr(mod, name, w)

forks = []
def before():
    forks.append([time.perf_counter(), None])
def after():
    forks[-1][1] = time.perf_counter()

if __name__ == "__main__":
    import numpy as np
    import faiss
    out = Path(sys.argv[1]); n_docs = int(sys.argv[2])
    from embedingest.bench.text import make_paragraphs, write_corpus
    corpus = Path("/tmp/para"); 
    if not corpus.exists():
        write_corpus(make_paragraphs(n_docs), corpus, 64)
    # the faiss close alone
    from embedingest.sinks.shard_writer import write_faiss_hashed
    n, d = n_docs // 2, 384
    x = np.random.rand(n, d).astype("float32")
    idx = faiss.IndexIDMap(faiss.IndexFlatIP(d)); idx.add_with_ids(x, np.arange(n, dtype=np.int64))
    rows = []
    for _ in range(3):
        t = time.perf_counter(); write_faiss_hashed(idx, Path("/tmp/f.faiss")); t1 = time.perf_counter()
        b = faiss.serialize_index(idx); t2 = time.perf_counter()
        hashlib.sha256(b).hexdigest(); t3 = time.perf_counter()
        with open("/tmp/g", "wb") as fh:
            fh.write(b); t4 = time.perf_counter(); fh.flush(); os.fsync(fh.fileno())
        t5 = time.perf_counter()
        rows.append(dict(write_faiss_hashed=t1-t, serialize=t2-t1, sha=t3-t2, write=t4-t3, fsync=t5-t4))
    print("faiss close", json.dumps(rows))
    import embedingest.jobs.build_index as bi
    from embedingest.jobs.build_index import encode as enc
    from embedingest.engine import egress
    from embedingest.index.shard_store import ShardStore
    for name in ("file_candidates", "plan_units", "apply_plan", "_open_index", "_loaded"):
        wrap(bi, name)
    wrap(ShardStore, "clean_garbage")
    wrap(enc, "start_batches", "loader start")
    wrap(enc, "shard_engine")
    wrap(egress.EgressEngine, "start", "engine start")
    wrap(egress.EgressEngine, "__exit__", "engine exit")
    wrap(enc.OneDevice, "describe")
    os.register_at_fork(before=before, after_in_parent=after)
    from embedingest.jobs.build_index import build_index
    for rep in range(2):
        T.clear(); forks.clear()
        t0 = time.perf_counter()
        s = build_index(corpus, out=str(out), device=sys.argv[3], dtype=("fp16" if sys.argv[3] == "cuda" else "fp32"), batch_size=1024, overwrite=True)
        print(f"run {rep}: seconds {s['seconds']} docs/s {s['docs_per_s']} phases {s['phases']} timing {s['timing']}")
        print("  close_seconds", s["engine"]["close_seconds"], "sink", s["engine"]["sink_seconds"], "wall", s["engine"]["wall_seconds"])
        for label, a, b in T:
            print(f"  {label:18s} {a - t0:7.3f} -> {b - t0:7.3f}  {b - a:6.3f}")
        print(f"  forks {len(forks)}: total {sum(b - a for a, b in forks):.3f} s, max {max((b - a for a, b in forks), default=0):.4f}")
