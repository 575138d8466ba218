"""Where build-index's encode step loses to the forward alone on long documents: the
encoder's forward over build-index's own batches (the loader's, in the order its
workers give them) against the forward alone's (every chunk length-sorted at once),
both on the device before the clock.

Rows, one process, the same chunks:
- ``sorted, warm``: the bench's forward alone (each shape run once before the clock);
- ``job's batches, warm``: build-index's batches, each shape run once before the clock:
  what their shapes cost (padding, short batches);
- ``job's batches, cold``: a fresh encoder, no run before the clock: what a run's first
  meeting with each shape adds (CUDA graph captures, kernel loads);
- the same two without CUDA graphs.

    python benchmarks/job_batches_forward.py --mb 100 --copies 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from embedingest.bench.documents import chunk_windows, sorted_batches, write_documents
from embedingest.config import IndexConfig
from embedingest.jobs.build_index.encode import loader_workers, make_loader
from embedingest.sources.text_dataset import Unit
from embedingest.stages.encoder import ModelFacts, TextEncoder


def job_batches(folder: Path, facts: ModelFacts, cfg: IndexConfig, chunk_tokens: int) -> list:
    """build-index's batches of ``folder``'s documents, as its loader gives them."""
    paths = sorted(folder.rglob("*.txt"))
    units = [Unit(i, str(p.relative_to(folder)), path=str(p)) for i, p in enumerate(paths)]
    workers = loader_workers(cfg, units)
    out = []
    for item in make_loader(units, facts, cfg, workers, chunk_tokens, pin=False):
        if len(item["ids"]):
            out.append((item["input_ids"].clone(), item["attention_mask"].clone()))
    return out


def shapes(batches: list) -> dict:
    real = sum(int(m.sum()) for _, m in batches)
    padded = sum(m.numel() for _, m in batches)
    return {"batches": len(batches), "chunks": sum(len(i) for i, _ in batches),
            "distinct_shapes": len(Counter(tuple(i.shape) for i, _ in batches)),
            "full_batches": sum(len(i) == max(len(j) for j, _ in batches) for i, _ in batches),
            "real_tokens": real, "padded_tokens": padded, "padding_share": 1 - real / padded,
            "shapes": Counter(f"{i.shape[0]}x{i.shape[1]}" for i, _ in batches).most_common(12)}


def timed(enc: TextEncoder, batches: list, warm: bool) -> float:
    with torch.inference_mode():
        if warm:
            for ids, mask in batches:
                enc.forward(ids, mask)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for ids, mask in batches:
            enc.forward(ids, mask)
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cfg = IndexConfig().for_device(True)  # build-index's settings on a GPU
    with tempfile.TemporaryDirectory(prefix="embedingest-jobbatches-") as tmp:
        folder = Path(tmp) / "docs"
        made = write_documents(folder, args.mb, args.copies)
        facts = ModelFacts.read(None, device="cuda", dtype=args.dtype)
        chunk_tokens, overlap = cfg.chunking()
        chunk_tokens = min(chunk_tokens, facts.max_seq_length)
        job = job_batches(folder, facts, cfg, chunk_tokens)
        windows, _ = chunk_windows(folder, facts.tokenizer, chunk_tokens, overlap)
    ordered = sorted_batches(windows, cfg.batch_size)
    result = {"documents": made, "job": shapes(job), "sorted": shapes(ordered), "rows": {}}
    print(json.dumps({k: result[k] for k in ("job", "sorted")}, indent=1))
    job = [(i.cuda(), m.cuda()) for i, m in job]
    ordered = [(i.cuda(), m.cuda()) for i, m in ordered]
    chunks = result["sorted"]["chunks"]
    for name, graphs, batches, warm in [
            ("sorted, warm", True, ordered, True), ("job's batches, cold", True, job, False),
            ("job's batches, warm", True, job, True), ("sorted, warm, again", True, ordered, True),
            ("sorted, eager, warm", False, ordered, True), ("job's batches, eager, cold", False, job, False),
            ("job's batches, eager, warm", False, job, True)]:
        enc = TextEncoder.load(None, device="cuda", dtype=args.dtype, cuda_graphs=graphs)
        seconds = timed(enc, batches, warm)
        result["rows"][name] = {"seconds": seconds, "chunks_per_s": chunks / seconds}
        print(f"{name}: {seconds:.3f} s, {chunks / seconds:,.0f} chunks/s", flush=True)
        enc.release()
        del enc
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
