"""build-index on real documents against the encoder's forward alone (and
sentence-transformers) on the same chunks: the command that earlier rows of
docs/BENCHMARKS.md name, now a front for ``embedingest bench text --corpus documents``
(:mod:`embedingest.bench.documents`), with ``--also`` for more build-index rows.

    python benchmarks/documents_build.py --mb 80 --dtype fp16 --also=--no-fast-tokenizer --json out.json
    python benchmarks/documents_build.py --mb 100 --copies 4 --jsonl --also=--no-split-files  # one large file
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from embedingest.bench.documents import DocumentsBenchConfig, run_documents
from embedingest.bench.report import DOCUMENTS_COLUMNS, machine_info, table
from embedingest.stages.device import precision, resolve_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=80)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled one)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=1024, help="of the forward-alone row")
    parser.add_argument("--copies", type=int, default=1,
                        help="write each document this many times (for machines with few)")
    parser.add_argument("--join-mb", type=float, default=0,
                        help="join the documents into files of about this many MB (0: one file each)")
    parser.add_argument("--jsonl", action="store_true",
                        help="the documents as records of one JSON lines file (--join-mb: files of that size)")
    parser.add_argument("--parquet", action="store_true", help="the same as --jsonl, as Parquet")
    parser.add_argument("--folder", help="keep the documents here")
    parser.add_argument("--also", action="append", default=[],
                        help="options of another build-index row over the same documents "
                             "(repeatable; one string, split on spaces)")
    parser.add_argument("--st-sample", type=int, default=0,
                        help="also time sentence-transformers encode() on this many of the chunks")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    device = str(resolve_device(args.device))
    cfg = DocumentsBenchConfig(mb=args.mb, copies=args.copies, join_mb=args.join_mb, jsonl=args.jsonl, parquet=args.parquet,
                               device=device,
                               dtype=precision(args.dtype, device.startswith("cuda")), model=args.model,
                               batch_size=args.batch_size, st_sample=args.st_sample, folder=args.folder,
                               extra=args.also)
    info = machine_info()
    made, rows = run_documents(cfg)
    print(table(rows, "chunks/s", DOCUMENTS_COLUMNS))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "config": cfg.__dict__, "documents": made,
                                               "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
