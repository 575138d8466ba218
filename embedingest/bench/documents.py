"""Long documents side by side: ``embedingest build-index`` as a user runs it (a fresh
command, timed from its start), the encoder's forward alone on the same chunks (the
bound), and sentence-transformers ``encode()`` on the same chunks' texts.

The documents are what the machine holds that nobody on the project wrote
(:mod:`~embedingest.bench.documents_corpus`), one ``.txt`` file each, from a few KB to MB;
``copies`` writes each several times under other names (a machine with few documents
still gives the corpus size asked for), ``join_mb`` joins them into large files, and
``jsonl`` (``parquet``) writes them as the records of JSON lines (Parquet) files instead
(one file, or files of about ``join_mb``), as corpora exported from a database or a crawl
come. The
command's processes are sampled for their summed proportional set size (PSS), so runs of
two corpus sizes show whether memory grows with the corpus.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .documents_corpus import build_corpus


@dataclass
class DocumentsBenchConfig:
    mb: float = 80  # megabytes of documents
    copies: int = 1  # each document written this many times
    join_mb: float = 0  # join documents into files of about this many MB (0: one file each)
    jsonl: bool = False  # documents as records of JSON lines files (join_mb MB each; 0: one file)
    parquet: bool = False  # the same as Parquet files (pyarrow's default row groups)
    device: str = "cuda"
    dtype: str = "fp16"
    model: str | None = None
    batch_size: int = 1024  # of the forward-alone row (build-index picks its own)
    st_sample: int = 20_000  # chunks for the sentence-transformers row (0: none)
    folder: str | None = None  # keep the documents here
    extra: list[str] = field(default_factory=list)  # more build-index rows: their options, a string each
    build_options: list[str] = field(default_factory=list)  # options of every build-index row
    trace: str | None = None  # a Chrome trace of the first build-index row, written here


def write_documents(folder: Path, mb: float, copies: int = 1, join_mb: float = 0,
                    jsonl: bool = False, parquet: bool = False) -> dict:
    """The documents under ``folder`` (500 a subfolder, or records of JSON lines files);
    their count and sizes."""
    docs = build_corpus(int(mb * 1e6 / copies)) * copies
    if jsonl or parquet:
        return _write_records(folder, docs, join_mb, ".parquet" if parquet else ".jsonl")
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


def _write_records(folder: Path, docs: list[str], file_mb: float, suffix: str) -> dict:
    """``docs`` as ``{"id", "text"}`` records of ``docs-NNN.jsonl`` (or ``.parquet``)
    files of about ``file_mb`` MB each (0: one file)."""
    folder.mkdir(parents=True, exist_ok=True)
    files: list[list[tuple[str, str]]] = [[]]
    size = 0
    for i, text in enumerate(docs):
        if file_mb and size >= file_mb * 1e6:
            files.append([])
            size = 0
        files[-1].append((f"doc{i:06d}", text))
        size += len(text)
    for n, records in enumerate(files):
        path = folder / f"docs-{n:03d}{suffix}"
        if suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"id": [r[0] for r in records], "text": [r[1] for r in records]}), path)
        else:
            with open(path, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps({"id": rid, "text": text}) + "\n" for rid, text in records)
    n_files = len(files)
    sizes = sorted(len(t.encode("utf-8", "surrogatepass")) for t in docs)
    return {"documents": len(docs), "copies": 1, "files": n_files, "bytes": sum(sizes),
            "median_bytes": sizes[len(sizes) // 2], "max_bytes": sizes[-1]}


def document_texts(folder: Path) -> list[str]:
    """The documents :func:`write_documents` wrote under ``folder``, in order."""
    texts = []
    for path in sorted(folder.rglob("*")):
        if path.suffix == ".txt":
            texts.append(path.read_text(encoding="utf-8", errors="surrogatepass"))
        elif path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as fh:
                texts += [json.loads(line)["text"] for line in fh]
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            texts += pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return texts


def _pss(pid: int) -> int:
    """Bytes of one process's PSS (Linux /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("Pss:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _tree_pss(root: int) -> int:
    """Bytes of PSS summed over ``root`` and its descendants (Linux /proc; 0 elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        total += _pss(pid)
    return total


def build_index_command(folder: Path, out: Path, cfg: DocumentsBenchConfig, extra: list[str] = (),
                        trace: str | None = None) -> dict:
    """``python -m embedingest build-index FOLDER --json`` in a fresh process: its wall time
    from the start, its own summary, and the peak PSS of its processes (sampled); with
    ``trace``, its Chrome trace is written there."""
    cmd = [sys.executable, "-m", "embedingest", "build-index", str(folder), "--out", str(out),
           "--json", "--dtype", cfg.dtype, "--device", cfg.device, *cfg.build_options, *extra]
    if trace:
        cmd += ["--trace", str(Path(trace).resolve())]
    if cfg.model:
        cmd += ["--model", cfg.model]
    peak, done = [0], threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def sample():
        while not done.wait(0.25):
            peak[0] = max(peak[0], _tree_pss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"build-index failed ({proc.returncode}):\n{stderr[-4000:]}")
    summary = json.loads(stdout)
    chunks = summary.get("vectors_total") or 0
    engine = summary.get("engine") or {}
    wall = engine.get("wall_seconds") or 0
    return {"name": " ".join(["embedingest build-index", *extra]), "kind": "engine",
            "command": " ".join(cmd[1:]), "seconds": seconds, "chunks": chunks,
            "chunks_per_s": chunks / seconds, "steady_chunks_per_s": chunks / wall if wall else None,
            "startup": startup(seconds, summary, t0), "peak_pss_mb": peak[0] / 2**20, "summary": summary}


def startup(wall: float, summary: dict, t0: float | None = None) -> dict:
    """Where a cold command's start went: before ``build_index`` was called (interpreter,
    imports, CLI), the phases up to the encode step, the engine's start and the wait for
    the first batch; their sum is the time from the command's start to the first batch.

    ``t0``: the ``time.perf_counter()`` the command was started at. The summary's
    ``started`` is the call's on the same clock (CLOCK_MONOTONIC, one for the host's
    processes), so ``before_call_s`` is exactly the time before the call, and the exit
    after it (``after_return_s``) is not counted; without them it is ``wall`` less the
    call's seconds, the exit included."""
    phases, timing = summary["phases"], summary.get("timing") or {}
    exact = t0 is not None and summary.get("started") is not None
    before = summary["started"] - t0 if exact else wall - summary["seconds"]
    out = {"before_call_s": before,
           **{k: phases[k] for k in phases if k not in ("encode_s", "finish_s")},
           "engine_start_s": timing.get("start_s", 0.0), "first_batch_s": timing.get("first_batch_s", 0.0)}
    out["to_first_batch_s"] = sum(out.values())
    out["first_forward_s"] = timing.get("first_forward_s", 0.0)
    out["after_return_s"] = wall - before - summary["seconds"] if exact else None
    return {k: (round(v, 3) if v is not None else None) for k, v in out.items()}


def chunk_windows(folder: Path, tokenizer, chunk_tokens: int, overlap: int) -> tuple[list, list]:
    """Every document cut into windows of ``chunk_tokens`` (special tokens included) by the
    model's own tokenizer, and each window's text; one tokenization per distinct text."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    inner, step = chunk_tokens - 2, chunk_tokens - 2 - overlap
    windows, texts, seen = [], [], {}
    for text in document_texts(folder):
        if text not in seen:
            tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets, mine = tokens["input_ids"], tokens["offset_mapping"], []
            for start in range(0, max(1, len(ids) - overlap), step):
                part = offsets[start:start + inner]
                mine.append(([cls, *ids[start:start + inner], sep],
                             text[part[0][0]:part[-1][1]] if part else ""))
            seen[text] = mine
        windows += [w for w, _ in seen[text]]
        texts += [t for _, t in seen[text]]
    return windows, texts


def sorted_batches(windows: list, batch_size: int) -> list:
    """The forward alone's batches (token ids and masks on the CPU): every window
    length-sorted at once, each batch's width padded to a multiple of 16."""
    import torch

    ordered = sorted(windows, key=len)
    batches = []
    for i in range(0, len(ordered), batch_size):
        part = ordered[i:i + batch_size]
        width = -(-len(part[-1]) // 16) * 16
        ids = torch.zeros((len(part), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, w in enumerate(part):
            ids[row, :len(w)] = torch.tensor(w)
            mask[row, :len(w)] = 1
        batches.append((ids, mask))
    return batches


def floor_command(batches: list, cfg: DocumentsBenchConfig, dtype: str, tmp: Path) -> dict:
    """The least any command can take on these chunks (:mod:`.floor`): a fresh process that
    imports torch, loads the encoder and runs the forward over ``batches`` (the forward
    alone's), written to a file before its start; timed from its start to its end."""
    from .floor import save_batches

    path = tmp / "floor-batches.npz"
    save_batches(path, batches)
    cmd = [sys.executable, "-m", "embedingest.bench.floor", str(path), "--device", cfg.device, "--dtype", dtype]
    if cfg.model:
        cmd += ["--model", cfg.model]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the floor's process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    chunks = int(proc.stdout.split()[-1])
    return {"name": "floor: fresh process, import torch, weights, forward (pre-tokenized)", "kind": "floor",
            "command": " ".join(cmd[1:]), "seconds": seconds, "chunks": chunks, "chunks_per_s": chunks / seconds}


def forward_alone(batches: list, cfg: DocumentsBenchConfig, dtype: str) -> dict:
    """The bound: the encoder on ``batches`` (:func:`sorted_batches`), on the device before
    the clock, each batch shape run once first."""
    from ..stages.encoder import TextEncoder
    from .text import timed_forward

    enc = TextEncoder.load(cfg.model, device=cfg.device, dtype=dtype)
    chunks = sum(len(ids) for ids, _ in batches)
    seconds = timed_forward(enc, [(ids.to(cfg.device), mask.to(cfg.device)) for ids, mask in batches], cfg.device)
    return {"name": f"encoder forward alone (pre-tokenized), {dtype}", "kind": "bound",
            "chunks": chunks, "seconds": seconds, "chunks_per_s": chunks / seconds, "dim": enc.dim}


def st_encode(texts: list[str], cfg: DocumentsBenchConfig, dtype: str, chunk_tokens: int) -> dict:
    """sentence-transformers ``encode()`` (batch 256, the job's dtype) on a random sample of
    the same chunks' texts, as its users run it."""
    import torch
    from sentence_transformers import SentenceTransformer

    from ..stages.model_folder import resolve_model
    from .text import sync

    sample = random.Random(0).sample(texts, min(cfg.st_sample, len(texts)))
    model = SentenceTransformer(str(resolve_model(cfg.model)[0]), device=cfg.device)
    model.max_seq_length = chunk_tokens
    if dtype != "fp32":
        model = model.to(torch.float16 if dtype == "fp16" else torch.bfloat16)
    model.encode(sample[:512], batch_size=256)
    sync(cfg.device)
    t0 = time.perf_counter()
    model.encode(sample, batch_size=256)
    sync(cfg.device)
    seconds = time.perf_counter() - t0
    return {"name": f"sentence-transformers encode(), {dtype}", "kind": "reference",
            "chunks": len(sample), "seconds": seconds, "chunks_per_s": len(sample) / seconds}


def run_documents(cfg: DocumentsBenchConfig, log=print) -> tuple[dict, list[dict]]:
    """The corpus's description and the rows, each with its ratio to the forward alone
    (``vs_bound``) and to sentence-transformers (``vs_st``)."""
    from ..config import IndexConfig
    from ..stages.encoder import ModelFacts

    with tempfile.TemporaryDirectory(prefix="embedingest-docs-") as tmp:
        folder = Path(cfg.folder or Path(tmp) / "docs")
        made = write_documents(folder, cfg.mb, cfg.copies, cfg.join_mb, cfg.jsonl, cfg.parquet)
        log(f"{made['documents']} documents, {made['bytes'] / 1e6:.1f} MB (median "
            f"{made['median_bytes'] / 1e3:.0f} KB, largest {made['max_bytes'] / 1e6:.1f} MB)")
        if made["bytes"] < 0.9 * cfg.mb * 1e6:
            log(f"  fewer than the {cfg.mb:g} MB asked for: this machine holds about "
                f"{made['bytes'] / cfg.copies / 1e6:.1f} MB of distinct documents; raise --copies "
                f"to about {cfg.mb * 1e6 * cfg.copies / made['bytes']:.0f} for that size")
        warm = Path(tmp) / "warm-up"  # no row pays for a cold page cache or first compile
        warm.mkdir()
        for i, text in enumerate(document_texts(folder)[:20]):
            (warm / f"doc{i:02d}.txt").write_text(text, encoding="utf-8", errors="surrogatepass")
        build_index_command(warm, Path(tmp) / "warm-index", cfg)
        rows = [build_index_command(folder, Path(tmp) / "index", cfg, trace=cfg.trace)]
        for n, extra in enumerate(cfg.extra):
            rows.append(build_index_command(folder, Path(tmp) / f"index-{n}", cfg, extra.split()))
        for row in rows:
            log(f"  {row['name']}: {row['chunks']:,} chunks in {row['seconds']:.1f} s; start-up "
                f"{json.dumps(row['startup'])}; peak PSS {row['peak_pss_mb']:,.0f} MB")
        dtype = rows[0]["summary"]["dtype"]
        icfg = IndexConfig()
        facts = ModelFacts.read(cfg.model)  # the tokenizer and limits, not the weights
        chunk_tokens, overlap = icfg.chunking()
        windows, texts = chunk_windows(folder, facts.tokenizer, min(chunk_tokens, facts.max_seq_length), overlap)
        batches = sorted_batches(windows, cfg.batch_size)  # the floor's and the forward alone's
        rows.append(floor_command(batches, cfg, dtype, Path(tmp)))
    rows.append(forward_alone(batches, cfg, dtype))
    for row in rows[:-2]:  # the vectors' own bytes, which an index's memory must hold
        row["vectors_mb"] = row["chunks"] * rows[-1]["dim"] * 4 / 2**20
    if cfg.st_sample:
        rows.append(st_encode(texts, cfg, dtype, chunk_tokens))
    bound = next(r["chunks_per_s"] for r in rows if r["kind"] == "bound")
    st = next((r["chunks_per_s"] for r in rows if r["kind"] == "reference"), None)
    for r in rows:
        r["rate"] = r["chunks_per_s"]
        r["vs_bound"] = r["chunks_per_s"] / bound
        r["vs_st"] = r["chunks_per_s"] / st if st else None
        if r.get("steady_chunks_per_s"):
            r["steady_vs_bound"] = r["steady_chunks_per_s"] / bound
    return made, rows
