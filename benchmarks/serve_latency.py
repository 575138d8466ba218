"""Latency of `embedingest serve`: p50/p99 over HTTP of QUERIES questions, one at a time.

    python benchmarks/serve_latency.py [--chunks 100000] [--queries 200] [--index DIR]
                                       [--factory Flat] [--params nprobe=32] [--threads 1]
                                       [--json OUT.json]

Without --index it makes an index of CHUNKS chunks in a temporary folder, the way
build-index lays one out (format 2: a shard of the faiss FACTORY per 50,000 vectors
written by the build's own shard writer, trained first when the factory needs it; chunk
rows with their text in each shard's Parquet file, 100 source files), with the bundled model in its manifest
and PARAMS as its stored search parameters. The chunk texts are the text benchmark's synthetic
paragraphs; the vectors are random unit vectors (embedding 100,000 chunks takes this
CPU a quarter of an hour, and the cost of a Flat search does not depend on the values).
The queries are encoded by the real model in the server.

It starts `embedingest serve` on a free loopback port, waits for it, sends 10 warm-up
queries and then the timed ones over one keep-alive connection, and prints the client's
round-trip and the server's own time per query (``took_ms``: query encoding, faiss
search, metadata rows). Afterwards it times, in this process, the two parts alone
(encoding the queries, the faiss search of their vectors) for the same queries.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from embedingest.bench.text import make_paragraphs  # noqa: E402
from embedingest.index.search import open_index  # noqa: E402
from embedingest.index.shard_store import ShardStore  # noqa: E402
from embedingest.index.shards import BatchMeta, encode_chunks  # noqa: E402
from embedingest.index.store import Manifest, vector_ids  # noqa: E402
from embedingest.sinks.shard_writer import ShardWriterFactory  # noqa: E402
from embedingest.stages.encoder import TextEncoder  # noqa: E402

FILES = 100


def make_index(folder: Path, chunks: int, factory: str = "Flat", params: str | None = None,
               seed: int = 0) -> Path:
    """An index of ``chunks`` chunks as build-index writes one (format 2: shards of FAISS
    ids, Parquet rows and commit records, written by one shard writer, 50,000 chunks a
    shard), with random unit vectors: a search's cost does not depend on the values."""
    encoder = TextEncoder.load(None, device="cpu")
    store = ShardStore(folder)
    store.create_or_open(Manifest(model=encoder.info(), dim=encoder.dim, factory=factory,
                                  search={"params": params} if params else {}))
    per_file = -(-chunks // FILES)
    texts = make_paragraphs(chunks, seed)
    nos = store.upsert_units({"key": f"part-{f:03d}.jsonl", "size": 0, "mtime_ns": 0, "sha256": str(f)}
                             for f in range(FILES) if f * per_file < chunks)
    rng = np.random.default_rng(seed)

    def unit_vectors(n: int) -> np.ndarray:
        emb = rng.standard_normal((n, encoder.dim)).astype(np.float32)
        return emb / np.linalg.norm(emb, axis=1, keepdims=True)

    trained = store.train_index(factory, encoder.dim, "ip", unit_vectors(min(chunks, 50_000)))
    sink = ShardWriterFactory(str(folder), encoder.dim, factory=factory, metric="ip",
                              commit_every=50_000, trained=trained)(0)
    for f, (key, no) in enumerate(sorted(nos.items())):
        lo, hi = f * per_file, min((f + 1) * per_file, chunks)
        ids = vector_ids(no, np.arange(hi - lo))
        rows = encode_chunks(ids.tolist(), [key] * (hi - lo), [f"r{i}" for i in range(lo, hi)],
                             list(range(hi - lo)), [0] * (hi - lo), [len(texts[i]) for i in range(lo, hi)],
                             texts[lo:hi])
        sink(BatchMeta(f, rows, ((no, hi - lo),)), {"emb": unit_vectors(hi - lo), "ids": ids})
    sink.close()
    store.update_shards()
    store.close()
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(index: Path, port: int, threads: int) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "embedingest", "serve", str(index), "--port", str(port),
                             "--threads", str(threads)],
                            env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/info")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("serve did not answer within 300 s")


def percentiles(values: list[float]) -> dict:
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "max": float(a.max())}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--index", type=Path, help="an existing index folder instead of a synthetic one")
    ap.add_argument("--factory", default="Flat", help="faiss index_factory of the synthetic index")
    ap.add_argument("--params", default=None, help="its stored search parameters, e.g. nprobe=32")
    ap.add_argument("--threads", type=int, default=1, help="serve --threads (torch threads), 0: all")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="embedingest-serve-bench-"))
    t0 = time.perf_counter()
    index = args.index or make_index(work / "index", args.chunks, args.factory, args.params)
    print(f"index {index}: made in {time.perf_counter() - t0:.1f} s", flush=True)
    queries = make_paragraphs(args.queries + 10, seed=1, words=8)
    warmup, timed = queries[:10], queries[10:]
    port = free_port()
    load_before = os.getloadavg()
    proc = start_server(index, port, args.threads)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        round_trip, server_ms = [], []
        for i, q in enumerate(warmup + timed):
            t = time.perf_counter()
            conn.request("GET", "/search?" + urllib.parse.urlencode({"q": q, "k": 10}))
            response = conn.getresponse()
            data = json.loads(response.read())
            elapsed = (time.perf_counter() - t) * 1e3
            if response.status != 200 or len(data["hits"]) != 10:
                raise SystemExit(f"query {q!r}: {response.status} {data}")
            if i >= len(warmup):
                round_trip.append(elapsed)
                server_ms.append(data["took_ms"])
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    load_after = os.getloadavg()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with open_index(index) as opened:
        ntotal, factory, params = opened.ntotal, opened.manifest.factory, opened.params
        encoder = opened.encoder
        encode_ms, faiss_ms, vectors = [], [], []
        for q in warmup + timed:
            t = time.perf_counter()
            vectors.append(encoder.encode([q]))
            encode_ms.append((time.perf_counter() - t) * 1e3)
        for v in vectors:
            t = time.perf_counter()
            opened.search_raw(v, 10)
            faiss_ms.append((time.perf_counter() - t) * 1e3)
    result = {
        "machine": machine(), "load_average_before": load_before, "load_average_after": load_after,
        "command": "python benchmarks/serve_latency.py " + " ".join(sys.argv[1:]),
        "index": {"chunks": ntotal, "synthetic": args.index is None, "factory": factory, "params": params},
        "queries": len(timed), "k": 10,
        "round_trip_ms": percentiles(round_trip), "server_took_ms": percentiles(server_ms),
        "encode_alone_ms": percentiles(encode_ms[10:]), "faiss_alone_ms": percentiles(faiss_ms[10:]),
    }
    print(json.dumps(result, indent=2))
    print(f"round trip over HTTP: p50 {result['round_trip_ms']['p50']:.1f} ms, "
          f"p99 {result['round_trip_ms']['p99']:.1f} ms ({len(timed)} queries, {ntotal:,} chunks, "
          f"{factory} {params or ''}); "
          f"median of the server's own time {statistics.median(server_ms):.1f} ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
