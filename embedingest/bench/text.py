"""Text side by side: sentence-transformers ``encode()`` + ``faiss.add`` against
``build-index`` end to end, with the encoder's forward alone on pre-tokenized,
length-sorted batches as the bound, on one corpus, model, batch size and device.

The corpus is made of real English sentences (docstrings of the Python standard library,
read with ``ast``) joined into paragraphs of about 50 tokens, written as JSON lines.
"""

from __future__ import annotations

import ast
import functools
import json
import random
import re
import shutil
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass
class TextBenchConfig:
    docs: int = 200_000  # paragraphs in the corpus
    batch_size: int = 256  # the same for every row
    device: str = "cuda"
    dtype: str = "fp16"  # precision of our encoder and of the sentence-transformers fp16 row
    model: str | None = None  # model folder; default the bundled all-MiniLM-L6-v2
    files: int = 64  # JSON-lines files the corpus is split into
    num_workers: int = -1  # build-index tokenizer workers (-1: from the CPU count)
    num_consumers: int = 2
    seed: int = 0
    st_fp32: bool = True  # also time sentence-transformers in fp32
    compare_eager: bool = True  # on CUDA, also time the forward and build-index without CUDA graphs
    trace: str | None = None  # Chrome trace of the build-index row (with CUDA graphs on a GPU)


@functools.lru_cache(maxsize=1)
def _sentences() -> tuple[str, ...]:
    """The stdlib's docstring sentences, sorted; read once per process (parsing every
    module takes seconds, and callers make several corpora)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node) or ""
                for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                    if 30 <= len(s) <= 300 and not s.startswith(">>>"):
                        out.append(s)
    return tuple(sorted(set(out)))


def make_paragraphs(n: int, seed: int = 0, words: int = 24) -> list[str]:
    """``n`` paragraphs of real sentences, about ``words`` words (~50 tokens) each."""
    rng = random.Random(seed)
    pool = _sentences()
    paras = []
    for i in range(n):
        parts, count = [], 0
        while count < words * rng.uniform(0.5, 1.5):
            s = pool[rng.randrange(len(pool))]
            parts.append(s)
            count += len(s.split())
        paras.append(f"[{i}] " + " ".join(parts))
    return paras


def write_corpus(paragraphs: list[str], folder: Path, files: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    per = max(1, -(-len(paragraphs) // files))
    # only the files that get paragraphs: fewer paragraphs than files would leave empty
    # files, which build-index skips and reports ("empty") and the build row exits 3
    for f in range(-(-len(paragraphs) // per)):
        with open(folder / f"part-{f:04d}.jsonl", "w", encoding="utf-8") as fh:
            for i in range(f * per, min(len(paragraphs), (f + 1) * per)):
                fh.write(json.dumps({"id": i, "text": paragraphs[i]}) + "\n")
    return folder


def read_corpus(folder: Path) -> list[str]:
    texts = []
    for path in sorted(folder.glob("*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            texts.extend(json.loads(line)["text"] for line in fh)
    return texts


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_forward(enc, batches: list, device: str) -> float:
    """Seconds of ``enc.forward`` over ``batches`` (on the device already), each batch run
    once before the clock, so kernels are chosen and CUDA graphs captured untimed."""
    with torch.inference_mode():
        for ids, mask in batches:
            enc.forward(ids, mask)
        sync(device)
        t0 = time.perf_counter()
        for ids, mask in batches:
            enc.forward(ids, mask)
        sync(device)
    return time.perf_counter() - t0


def st_encode_add(cfg: TextBenchConfig, corpus: Path, model_dir: str, dtype: str) -> dict:
    """The usual loop: read texts, ``SentenceTransformer.encode``, ``IndexFlatIP.add``."""
    import faiss
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device=cfg.device)
    if dtype == "fp16":
        model.half()
    model.encode(["warm up"] * cfg.batch_size, batch_size=cfg.batch_size)
    sync(cfg.device)
    t0 = time.perf_counter()
    texts = read_corpus(corpus)
    emb = model.encode(texts, batch_size=cfg.batch_size, normalize_embeddings=True,
                       convert_to_numpy=True)
    index = faiss.IndexFlatIP(emb.shape[1])
    index.add(np.ascontiguousarray(emb, dtype=np.float32))
    dt = time.perf_counter() - t0
    del model
    return {"name": f"sentence-transformers encode() + faiss.add, {dtype}", "kind": "reference",
            "precision": dtype, "docs_per_s": len(texts) / dt, "seconds": dt, "vectors": index.ntotal}


def pretokenize(cfg: TextBenchConfig, texts: list[str], model_dir: str | None) -> list:
    """The corpus as length-sorted batches on the device, for the forward-alone rows."""
    from ..config import IndexConfig
    from ..stages.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    max_length = IndexConfig().chunking()[0]  # build-index's chunk size
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    batches = []
    for i in range(0, len(order), cfg.batch_size):
        tok = tokenizer([texts[j] for j in order[i:i + cfg.batch_size]], padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt",
                        pad_to_multiple_of=16 if cfg.device.startswith("cuda") else None)
        batches.append((tok["input_ids"].to(cfg.device), tok["attention_mask"].to(cfg.device)))
    return batches


def forward_only(cfg: TextBenchConfig, texts: list[str], batches: list, model_dir: str | None,
                 cuda_graphs: bool = True) -> dict:
    """The GPU bound: our encoder's forward on ``batches`` (:func:`pretokenize`)."""
    from ..stages.encoder import TextEncoder

    enc = TextEncoder.load(model_dir, device=cfg.device, dtype=cfg.dtype, cuda_graphs=cuda_graphs)
    how = "CUDA graphs" if enc.uses_cuda_graphs else "eager"
    dt = timed_forward(enc, batches, cfg.device)
    tokens = sum(int(m.sum()) for _, m in batches)
    return {"name": f"encoder forward alone (pre-tokenized), {cfg.dtype}, {how}",
            "kind": "bound" if cuda_graphs else "bound-eager",
            "precision": cfg.dtype, "docs_per_s": len(texts) / dt, "seconds": dt,
            "mean_tokens": tokens / len(texts)}


def loader_only(cfg: TextBenchConfig, corpus: Path, model_dir: str | None) -> dict:
    """The host bound: build-index's own reading, chunking and tokenizing (DataLoader
    workers, length-sorted batches) with nothing done to the batches."""
    from ..config import IndexConfig
    from ..jobs.build_index.encode import loader_workers, make_loader
    from ..sources.text_dataset import Unit
    from ..stages.encoder import TextEncoder

    enc = TextEncoder.load(model_dir, device="cpu")
    icfg = IndexConfig(batch_size=cfg.batch_size, num_workers=cfg.num_workers)
    units = [Unit(i, p.name, path=str(p)) for i, p in enumerate(sorted(corpus.glob("*.jsonl")))]
    workers = loader_workers(icfg, units)
    loader = make_loader(units, enc, icfg, workers, min(icfg.chunking()[0], enc.max_seq_length),
                     pin=cfg.device.startswith("cuda"))
    t0 = time.perf_counter()
    docs, first, t_first = 0, 0, None
    for item in loader:
        docs += item["chunks"].n_docs
        if t_first is None:
            t_first, first = time.perf_counter(), docs
    dt = time.perf_counter() - t0
    steady = (docs - first) / (time.perf_counter() - t_first) if t_first and docs > first else None
    return {"name": f"read + chunk + tokenize alone ({workers} DataLoader workers)", "kind": "loader",
            "precision": "-", "docs_per_s": docs / dt, "seconds": dt, "steady_docs_per_s": steady,
            "first_batch_s": t_first - t0 if t_first else None}


def build_index_run(cfg: TextBenchConfig, corpus: Path, model_dir: str | None, out: Path,
                    cuda_graphs: bool = True) -> dict:
    from ..jobs.build_index import build_index

    s = build_index(corpus, out=str(out), model=model_dir, device=cfg.device, dtype=cfg.dtype,
                    batch_size=cfg.batch_size, num_workers=cfg.num_workers,
                    num_consumers=cfg.num_consumers, cuda_graphs=cuda_graphs, overwrite=True,
                    trace=cfg.trace if cuda_graphs else None)
    eng = s["engine"] or {}
    steady = s["docs"] / eng["wall_seconds"] if eng.get("wall_seconds") else None
    name = f"embedingest build-index, {cfg.dtype}" + ("" if cuda_graphs else ", no CUDA graphs")
    return {"name": name, "kind": "engine" if cuda_graphs else "engine-eager", "precision": cfg.dtype,
            "docs_per_s": s["docs_per_s"], "seconds": s["seconds"], "vectors": s["vectors_total"],
            "steady_docs_per_s": steady, "pinned": eng.get("pinned"), "copy_gbps": eng.get("copy_gbps"),
            "gpu_idle": eng.get("gpu_idle_fraction"), "summary": s}


def run_all(cfg: TextBenchConfig, log=print) -> list[dict]:
    from ..stages.encoder import TextEncoder

    model_dir = str(TextEncoder.load(cfg.model, device="cpu").model_dir)
    work = Path(tempfile.mkdtemp(prefix="embedingest-textbench-"))
    try:
        texts = make_paragraphs(cfg.docs, cfg.seed)
        corpus = write_corpus(texts, work / "corpus", cfg.files)
        rows = []
        batches = pretokenize(cfg, texts, model_dir)
        plan = [lambda: forward_only(cfg, texts, batches, cfg.model),
                lambda: loader_only(cfg, corpus, cfg.model),
                lambda: build_index_run(cfg, corpus, cfg.model, work / "index")]
        if cfg.device.startswith("cuda") and cfg.compare_eager:
            plan[1:1] = [lambda: forward_only(cfg, texts, batches, cfg.model, cuda_graphs=False)]
            plan.append(lambda: build_index_run(cfg, corpus, cfg.model, work / "index",
                                                cuda_graphs=False))
        plan.append(lambda: st_encode_add(cfg, corpus, model_dir, cfg.dtype))
        if cfg.st_fp32 and cfg.dtype != "fp32":
            plan.append(lambda: st_encode_add(cfg, corpus, model_dir, "fp32"))
        for fn in plan:
            row = fn()
            extra = [f"{row['steady_docs_per_s']:,.0f} steady"] if row.get("steady_docs_per_s") else []
            if row.get("first_batch_s") is not None:
                extra.append(f"first batch after {row['first_batch_s']:.2f} s")
            if row.get("summary"):
                extra.append(f"timing {row['summary']['timing']}")
            log(f"  {row['name']}: {row['docs_per_s']:,.0f} docs/s" + (f" ({'; '.join(extra)})" if extra else ""))
            rows.append(row)
            if cfg.device.startswith("cuda"):
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bound = next(r["docs_per_s"] for r in rows if r["kind"] == "bound")
    st_same = next(r["docs_per_s"] for r in rows if r["kind"] == "reference" and r["precision"] == cfg.dtype)
    for r in rows:
        r["rate"] = r["docs_per_s"]
        r["vs_bound"] = r["docs_per_s"] / bound
        r["vs_st"] = r["docs_per_s"] / st_same
    return rows
