"""build-index on the documents corpus with and without CUDA graphs, interleaved, each a
fresh command timed from its start (the bench's own ``build_index_command``).

    python benchmarks/documents_graphs_eager.py --mb 100 --copies 4 --repeat 2
"""
import argparse
import json
import tempfile
from pathlib import Path

if __name__ == "__main__":
    from embedingest.bench.documents import DocumentsBenchConfig, build_index_command, write_documents

    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = DocumentsBenchConfig(mb=args.mb, copies=args.copies, device="cuda", dtype="fp16")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "docs"
        print(write_documents(folder, args.mb, args.copies), flush=True)
        for rep in range(args.repeat):
            for extra in ([], ["--no-cuda-graphs"]):
                r = build_index_command(folder, Path(tmp) / f"index{rep}{len(extra)}", cfg, extra)
                e = r["summary"]["engine"]
                row = {"extra": extra, "seconds": round(r["seconds"], 3), "chunks": r["chunks"],
                       "chunks_per_s": round(r["chunks_per_s"]), "steady_chunks_per_s": round(r["steady_chunks_per_s"]),
                       "engine_wall_s": round(e["wall_seconds"], 3), "gpu_idle": e.get("gpu_idle_fraction"),
                       "startup": r["startup"], "timing": r["summary"]["timing"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
