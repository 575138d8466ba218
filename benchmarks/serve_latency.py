"""Latency of `embedingest serve`: p50/p99 over HTTP of QUERIES questions, one at a time.

    python benchmarks/serve_latency.py [--chunks 100000] [--queries 200] [--index DIR]
                                       [--factory Flat] [--params nprobe=32] [--threads 1]
                                       [--query-runtime torch,onnx] [--json OUT.json]

Without --index it makes an index of CHUNKS chunks in a temporary folder, the way
build-index lays one out (format 2: a shard of the faiss FACTORY per 50,000 vectors
written by the build's own shard writer, trained first when the factory needs it; chunk
rows with their text in each shard's Parquet file, 100 source files), with the bundled model in its manifest
and PARAMS as its stored search parameters. The chunk texts are the text benchmark's synthetic
paragraphs; the vectors are random unit vectors (embedding 100,000 chunks takes this
CPU a quarter of an hour, and the cost of a Flat search does not depend on the values).
The queries are encoded by the real model in the server.

It starts one `embedingest serve` per query runtime (``--query-runtime``, several
comma-separated: they are compared in the same run) on free loopback ports, waits for
them, sends 10 warm-up queries and then the timed ones, each query to every server in
turn (the order alternating from one query to the next, so a busy moment of a shared
machine falls on all of them), one keep-alive connection each, and prints the client's
round-trip and the server's own time per query (``took_ms``: query encoding, faiss
search, metadata rows). Afterwards it times, in this process, the parts alone (encoding
the queries with each runtime, interleaved the same way; the faiss search of their
vectors) for the same queries, and how far each runtime's vectors are from the first's.
The exported ONNX graph is kept in a cache folder inside the temporary folder.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import signal
import socket
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


def start_server(index: Path, port: int, threads: int, runtime: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", "embedingest", "serve", str(index), "--port", str(port),
                             "--threads", str(threads), "--query-runtime", runtime, "--cache-dir", str(cache)],
                            env=env)


def wait_for(proc: subprocess.Popen, port: int) -> dict:
    """/info of the server once it answers."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/info")
            response = conn.getresponse()
            if response.status == 200:
                return json.loads(response.read())
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
    ap.add_argument("--query-runtime", default="torch,onnx",
                    help="serve --query-runtime of each server, comma-separated: compared side by side")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="embedingest-serve-bench-"))
    t0 = time.perf_counter()
    index = args.index or make_index(work / "index", args.chunks, args.factory, args.params)
    print(f"index {index}: made in {time.perf_counter() - t0:.1f} s", flush=True)
    queries = make_paragraphs(args.queries + 10, seed=1, words=8)
    warmup, timed = queries[:10], queries[10:]
    runtimes = args.query_runtime.split(",")
    cache = work / "cache"
    load_before = os.getloadavg()
    ports = [free_port() for _ in runtimes]
    procs = [start_server(index, port, args.threads, runtime, cache) for port, runtime in zip(ports, runtimes)]
    try:
        in_use = [wait_for(proc, port)["query_runtime"] for proc, port in zip(procs, ports)]
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for port in ports]
        round_trip = {r: [] for r in runtimes}
        server_ms = {r: [] for r in runtimes}
        for i, q in enumerate(warmup + timed):
            order = list(range(len(runtimes)))
            for j in order[::-1] if i % 2 else order:
                t = time.perf_counter()
                conns[j].request("GET", "/search?" + urllib.parse.urlencode({"q": q, "k": 10}))
                response = conns[j].getresponse()
                data = json.loads(response.read())
                elapsed = (time.perf_counter() - t) * 1e3
                if response.status != 200 or len(data["hits"]) != 10:
                    raise SystemExit(f"query {q!r} ({runtimes[j]}): {response.status} {data}")
                if i >= len(warmup):
                    round_trip[runtimes[j]].append(elapsed)
                    server_ms[runtimes[j]].append(data["took_ms"])
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            proc.wait(60)
    load_after = os.getloadavg()
    import torch

    from embedingest.stages.onnx_forward import load as load_onnx

    if args.threads:
        torch.set_num_threads(args.threads)

    with open_index(index) as opened:
        ntotal, factory, params = opened.ntotal, opened.manifest.factory, opened.params
        encoder = opened.encoder
        forwards = {r: None if r == "torch" else load_onnx(encoder, cache, torch.get_num_threads())
                    for r in runtimes}
        encode_ms = {r: [] for r in runtimes}
        vectors = {r: [] for r in runtimes}
        for i, q in enumerate(warmup + timed):
            order = list(range(len(runtimes)))
            for j in order[::-1] if i % 2 else order:
                encoder.use_runtime(forwards[runtimes[j]])
                t = time.perf_counter()
                vectors[runtimes[j]].append(encoder.encode([q]))
                encode_ms[runtimes[j]].append((time.perf_counter() - t) * 1e3)
        faiss_ms = []
        for v in vectors[runtimes[0]]:
            t = time.perf_counter()
            opened.search_raw(v, 10)
            faiss_ms.append((time.perf_counter() - t) * 1e3)
    first = np.concatenate(vectors[runtimes[0]])
    per_runtime = {}
    for runtime, used in zip(runtimes, in_use):
        other = np.concatenate(vectors[runtime])
        per_runtime[runtime] = {
            "in_use": used, "round_trip_ms": percentiles(round_trip[runtime]),
            "server_took_ms": percentiles(server_ms[runtime]), "encode_alone_ms": percentiles(encode_ms[runtime][10:]),
            f"max_abs_difference_to_{runtimes[0]}": float(np.abs(other - first).max()),
            f"min_cosine_to_{runtimes[0]}": float((other * first).sum(axis=1).min())}
    base = per_runtime[runtimes[0]]
    for runtime in runtimes[1:]:
        per_runtime[runtime][f"p50_ratio_{runtimes[0]}_to_this"] = {
            key: base[key]["p50"] / per_runtime[runtime][key]["p50"]
            for key in ("round_trip_ms", "server_took_ms", "encode_alone_ms")}
    result = {
        "machine": machine(), "load_average_before": load_before, "load_average_after": load_after,
        "command": "python benchmarks/serve_latency.py " + " ".join(sys.argv[1:]),
        "index": {"chunks": ntotal, "synthetic": args.index is None, "factory": factory, "params": params},
        "queries": len(timed), "k": 10, "threads": args.threads, "runtimes": per_runtime,
        "faiss_alone_ms": percentiles(faiss_ms[10:]),
    }
    print(json.dumps(result, indent=2))
    for runtime, r in per_runtime.items():
        print(f"{runtime} ({r['in_use']}): round trip over HTTP p50 {r['round_trip_ms']['p50']:.1f} ms, "
              f"p99 {r['round_trip_ms']['p99']:.1f} ms; server's own time p50 {r['server_took_ms']['p50']:.1f} ms; "
              f"encoding alone p50 {r['encode_alone_ms']['p50']:.1f} ms "
              f"({len(timed)} queries, {ntotal:,} chunks, {factory} {params or ''})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
