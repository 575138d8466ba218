"""The paragraph benchmark's forward-alone and build-index rows only (``bench text``'s own
row functions, no sentence-transformers row, no loader-alone row), build-index run several
times, optionally with other consumer counts and a Chrome trace each: for looking at one
part of build-index (its tail, its start) in one device call.

    python benchmarks/paragraph_build_rows.py out.json [--consumers 2 4 2 4] [--trace-dir DIR]

Prints one line per build-index run: docs/s end to end and steady, the share of the
forward alone, its phases, its loop timing and each consumer's close time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path


def main() -> None:
    import torch

    from embedingest.bench.text import (TextBenchConfig, build_index_run, forward_only, make_paragraphs,
                                        pretokenize, write_corpus)
    from embedingest.stages.encoder import TextEncoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file for the rows")
    ap.add_argument("--docs", type=int, default=300_000)
    ap.add_argument("--consumers", type=int, nargs="+", default=[2, 2], help="one build-index run each")
    ap.add_argument("--trace-dir", help="write each run's Chrome trace here")
    args = ap.parse_args()
    cfg = TextBenchConfig(docs=args.docs, device="cuda", dtype="fp16", batch_size=1024)
    model_dir = str(TextEncoder.load(cfg.model, device="cpu").model_dir)
    work = Path(tempfile.mkdtemp(prefix="embedingest-paragraph-rows-"))
    try:
        texts = make_paragraphs(cfg.docs, cfg.seed)
        corpus = write_corpus(texts, work / "corpus", cfg.files)
        bound = forward_only(cfg, texts, pretokenize(cfg, texts, model_dir), cfg.model)
        print(bound["name"], round(bound["docs_per_s"]), flush=True)
        rows = [bound]
        for i, consumers in enumerate(args.consumers):
            trace = f"{args.trace_dir}/paragraphs-c{consumers}-{i}.trace.json" if args.trace_dir else None
            run = dataclasses.replace(cfg, num_consumers=consumers, trace=trace)
            row = build_index_run(run, corpus, cfg.model, work / f"index{i}")
            s = row["summary"]
            torch.cuda.empty_cache()
            print(consumers, round(row["docs_per_s"]), round(row["steady_docs_per_s"]),
                  round(row["docs_per_s"] / bound["docs_per_s"], 3), s["phases"], s["timing"],
                  s["engine"]["close_seconds"], flush=True)
            rows.append(row)
        Path(args.out).write_text(json.dumps({"config": dataclasses.asdict(cfg), "rows": rows}, default=str))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
