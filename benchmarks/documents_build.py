"""build-index on real documents, as a new user runs it, against the encoder's forward
alone on the same kind of chunks, side by side in one run.

Documents: what the machine holds that nobody on the project wrote (manual pages, the
docs of installed packages, the Python standard library's sources: see
``tokenizer_corpus.py``), written as one ``.txt`` file each, from a few KB to MB.

Rows:

* ``build-index``: ``python -m embedingest build-index FOLDER --json`` in a fresh process
  (interpreter, imports, model load, everything), its wall time and its own summary;
* ``forward alone``: the encoder on the documents cut into windows of the job's chunk size
  by the model's own tokenizer (pre-tokenized, length-sorted, on the device before the
  clock, each batch shape run once first), chunks per second.

    python benchmarks/documents_build.py --mb 80 --dtype fp16 --also=--no-fast-tokenizer --json out.json

``--st-sample N`` adds sentence-transformers ``encode()`` on N of the same chunks' texts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenizer_corpus import build_corpus  # noqa: E402


def write_documents(folder: Path, mb: float, copies: int = 1, join_mb: float = 0) -> dict:
    """The documents, each ``copies`` times under other names (a machine with few
    documents of its own still gives a corpus of the size asked for); with ``join_mb``,
    joined (a blank line between) into files of about that many MB, as large exports or
    books are (above 4 MB, build-index reads them a block at a time)."""
    docs = build_corpus(int(mb * 1e6 / copies)) * copies
    if join_mb:
        joined, part, size = [], [], 0
        for text in docs:
            part.append(text)
            size += len(text)
            if size >= join_mb * 1e6:
                joined.append("\n\n".join(part))
                part, size = [], 0
        docs = joined + (["\n\n".join(part)] if part else [])
    folder.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(docs):
        (folder / f"{i // 500:03d}").mkdir(exist_ok=True)
        (folder / f"{i // 500:03d}" / f"doc{i:06d}.txt").write_text(text, encoding="utf-8",
                                                                    errors="surrogatepass")
    sizes = sorted(len(t.encode("utf-8", "surrogatepass")) for t in docs)
    return {"documents": len(docs), "copies": copies, "bytes": sum(sizes),
            "median_bytes": sizes[len(sizes) // 2], "max_bytes": sizes[-1]}


def build_index_cold(folder: Path, out: Path, args, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, "-m", "embedingest", "build-index", str(folder), "--out", str(out),
           "--json", "--dtype", args.dtype, "--device", args.device, *extra]
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"build-index failed ({done.returncode}):\n{done.stderr[-4000:]}")
    summary = json.loads(done.stdout)
    return {"command": " ".join(cmd[1:]), "seconds": seconds, "summary": summary,
            "startup": startup(seconds, summary)}


def startup(wall: float, summary: dict) -> dict:
    """Where a cold command's start went, from its wall time and its own summary:
    before ``build_index`` was called (interpreter, imports, CLI), the phases up to the
    encode step, the encode step's start (consumers), and the wait for the first batch:
    their sum is the time from the command's start to the first batch on the device."""
    phases, timing = summary["phases"], summary.get("timing") or {}
    before = wall - summary["seconds"]
    out = {"before_call_s": before, **{k: phases[k] for k in phases if k not in ("encode_s", "finish_s")},
           "engine_start_s": timing.get("start_s", 0.0), "first_batch_s": timing.get("first_batch_s", 0.0)}
    out["to_first_batch_s"] = sum(out.values())
    out["first_forward_s"] = timing.get("first_forward_s", 0.0)
    return {k: round(v, 3) for k, v in out.items()}


def describe_row(name: str, row: dict) -> None:
    s, st = row["summary"], row["startup"]
    engine = s.get("engine") or {}
    wall = engine.get("wall_seconds") or 0
    row["steady_chunks_per_s"] = s["chunks"] / wall if wall else None
    print(f"{name}: {row['chunks']} chunks in {row['seconds']:.1f} s: {row['chunks_per_s']:.0f} chunks/s; "
          f"engine span {wall:.2f} s: {row['steady_chunks_per_s'] or 0:.0f} chunks/s, GPU idle "
          f"{engine.get('gpu_idle_fraction')}, producer blocked {engine.get('producer_blocked_seconds')} s\n"
          f"  start-up {json.dumps(st)}\n  phases {json.dumps(s['phases'])}\n"
          f"  timing {json.dumps(s.get('timing'))}", flush=True)


def forward_alone(folder: Path, args, dtype: str, chunk_tokens: int, overlap: int) -> dict:
    """``dtype``: the one build-index chose (its summary's), so both rows run the same."""
    import torch

    from embedingest.stages.encoder import TextEncoder

    enc = TextEncoder.load(args.model, device=args.device, dtype=dtype)
    tokenizer = enc.tokenizer
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    inner, step = chunk_tokens - 2, chunk_tokens - 2 - overlap
    windows, texts, seen = [], [], {}
    for path in sorted(folder.rglob("*.txt")):
        text = path.read_text(encoding="utf-8", errors="surrogatepass")
        if text not in seen:  # --copies: each copy's windows are the first's
            tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets, mine = tokens["input_ids"], tokens["offset_mapping"], []
            for start in range(0, max(1, len(ids) - overlap), step):
                part = offsets[start:start + inner]
                mine.append(([cls, *ids[start:start + inner], sep],
                             text[part[0][0]:part[-1][1]] if part else ""))
            seen[text] = mine
        windows += [w for w, _ in seen[text]]
        texts += [t for _, t in seen[text]]
    windows.sort(key=len)
    batches = []
    for i in range(0, len(windows), args.batch_size):
        part = windows[i:i + args.batch_size]
        width = -(-len(part[-1]) // 16) * 16
        ids = torch.zeros((len(part), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, w in enumerate(part):
            ids[row, :len(w)] = torch.tensor(w)
            mask[row, :len(w)] = 1
        batches.append((ids.to(args.device), mask.to(args.device)))

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    with torch.inference_mode():
        for ids, mask in batches:
            enc.forward(ids, mask)
        sync()
        t0 = time.perf_counter()
        for ids, mask in batches:
            enc.forward(ids, mask)
        sync()
    seconds = time.perf_counter() - t0
    out = {"chunks": len(windows), "seconds": seconds, "chunks_per_s": len(windows) / seconds,
           "tokens": sum(map(len, windows))}
    del batches, enc
    if args.st_sample:
        out["sentence_transformers"] = st_encode(texts, args, dtype, chunk_tokens)
    return out


def st_encode(texts: list[str], args, dtype: str, chunk_tokens: int) -> dict:
    """sentence-transformers ``encode()`` (batch 256, the job's dtype) on a random sample
    of the same chunks' texts, as a user of it would run them."""
    import random

    import torch
    from sentence_transformers import SentenceTransformer

    from embedingest.stages.model_folder import resolve_model

    sample = random.Random(0).sample(texts, min(args.st_sample, len(texts)))
    model = SentenceTransformer(str(resolve_model(args.model)[0]), device=args.device)
    model.max_seq_length = chunk_tokens
    if dtype != "fp32":
        model = model.to(torch.float16 if dtype == "fp16" else torch.bfloat16)
    model.encode(sample[:512], batch_size=256)
    t0 = time.perf_counter()
    model.encode(sample, batch_size=256)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"chunks": len(sample), "seconds": seconds, "chunks_per_s": len(sample) / seconds}


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
    parser.add_argument("--folder", help="keep the documents here")
    parser.add_argument("--also", action="append", default=[],
                        help="options of another build-index row over the same documents "
                             "(repeatable; one string, split on spaces)")
    parser.add_argument("--st-sample", type=int, default=0,
                        help="also time sentence-transformers encode() on this many of the chunks")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="embedingest-docs-") as tmp:
        folder = Path(args.folder or Path(tmp) / "docs")
        t0 = time.perf_counter()
        made = write_documents(folder, args.mb, args.copies, args.join_mb)
        print(f"{made['documents']} documents, {made['bytes'] / 1e6:.1f} MB "
              f"(median {made['median_bytes'] / 1e3:.0f} KB) in {time.perf_counter() - t0:.1f} s", flush=True)
        # one untimed run over a few documents first, so no row pays for a cold page cache
        warm = Path(tmp) / "warm-up"
        warm.mkdir()
        for path in sorted(folder.rglob("*.txt"))[:20]:
            (warm / path.name).write_bytes(path.read_bytes())
        build_index_cold(warm, Path(tmp) / "warm-index", args)
        job = build_index_cold(folder, Path(tmp) / "index", args)
        s = job["summary"]
        chunks = s.get("vectors_total") or s.get("vectors")
        job["chunks"] = chunks
        job["chunks_per_s"] = chunks / job["seconds"]
        describe_row("build-index", job)
        others = []
        for n, extra in enumerate(args.also):
            other = build_index_cold(folder, Path(tmp) / f"index-also-{n}", args, extra.split())
            o = other["summary"]
            other["chunks"] = o.get("vectors_total") or o.get("vectors")
            other["chunks_per_s"] = other["chunks"] / other["seconds"]
            describe_row(f"build-index {extra}", other)
            others.append(other)
        from embedingest.config import IndexConfig

        cfg = IndexConfig()
        alone = forward_alone(folder, args, s["dtype"], cfg.chunk_tokens, cfg.overlap)
        print(f"forward alone: {alone['chunks']} chunks in {alone['seconds']:.2f} s: "
              f"{alone['chunks_per_s']:.0f} chunks/s", flush=True)
        if "sentence_transformers" in alone:
            st = alone["sentence_transformers"]
            print(f"sentence-transformers encode(): {st['chunks']} chunks in {st['seconds']:.2f} s: "
                  f"{st['chunks_per_s']:.0f} chunks/s; build-index end to end / it "
                  f"{job['chunks_per_s'] / st['chunks_per_s']:.2f}x", flush=True)
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
              "cpus": os.cpu_count(), "args": vars(args), "documents": made, "build_index": job, "also": others,
              "forward_alone": alone, "job_vs_forward": job["chunks_per_s"] / alone["chunks_per_s"]}
    for name, row in [("build-index", job)] + [(f"build-index {e}", o) for e, o in zip(args.also, others)]:
        steady = row.get("steady_chunks_per_s") or 0
        print(f"{name} / forward alone: end to end {row['chunks_per_s'] / alone['chunks_per_s']:.2f}, "
              f"steady {steady / alone['chunks_per_s']:.2f}; to the first batch "
              f"{row['startup']['to_first_batch_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
