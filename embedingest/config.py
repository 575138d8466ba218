"""Settings as dataclasses, presets as TOML.

Every job takes one dataclass; every CLI option maps one-to-one onto a field of it
(``--num-consumers`` is ``num_consumers``), and ``--config preset.toml`` fills the same
fields from a file, with options given on the command line winning.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")


@dataclass
class EngineConfig:
    """How outputs leave the GPU and reach the sinks."""

    # Consumer processes that run the sink; each builds its own sink (one FAISS shard each).
    num_consumers: int = 4
    # Host buffer slots in the pinned pool; 0 means twice the consumers. Memory used is
    # slots x the size of one batch's outputs, whatever the speed of the consumers.
    num_slots: int = 0
    # Seconds a consumer gets to finish and close its sink when the run is stopped early.
    shutdown_timeout: float = 5.0
    # Register the host pool with CUDA (page-locked); turn off only to measure the difference.
    pin_memory: bool = True

    def slots(self) -> int:
        return self.num_slots or max(2, 2 * self.num_consumers)


@dataclass
class IndexConfig:
    """Settings of ``build-index``; each field is the CLI option of the same name."""

    # Output folder; default indexes/<corpus folder or file name>.
    out: str | None = None
    # Local sentence-transformers / Hugging Face model folder, or a Hugging Face id
    # ("org/name") found in the local Hugging Face cache (never downloaded); default the
    # bundled all-MiniLM-L6-v2.
    model: str | None = None
    # faiss index_factory string; "Flat" is exact search. IVF/PQ/HNSW are trained on a sample.
    index: str = "Flat"
    # Similarity: "ip" (inner product = cosine on the normalised vectors) or "l2".
    metric: str = "ip"
    # "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # Several devices, one process each: "all" (every GPU), "0,1" (GPU numbers), "cuda:0,cuda:1",
    # or "cpu,cpu" (CPU processes, for testing); "" is the one --device.
    devices: str = ""
    # Encoder precision: "auto" (fp16 on CUDA, fp32 on CPU), "fp32", "fp16" or "bf16".
    dtype: str = "auto"
    # Chunks per encoder batch (the slot size of the egress engine); 0 picks 1024 on a GPU
    # (fewer, larger batches: less per-batch work for the main process) and 256 on the CPU.
    batch_size: int = 0
    # On a GPU, replay the encoder from CUDA graphs (one per batch shape): the GPU no
    # longer waits for Python to launch each kernel. Off: plain eager forward.
    cuda_graphs: bool = True
    # Tokens per chunk, special tokens included (capped at the model's max length).
    chunk_tokens: int = 256
    # Tokens shared by consecutive chunks of one text.
    overlap: int = 32
    # Field holding the text in .jsonl/.json/.csv/.parquet records.
    text_field: str = "text"
    # Field holding the record id (optional; line or row numbers otherwise).
    id_field: str = "id"
    # Tokenizer worker processes; -1 picks from the CPU count.
    num_workers: int = -1
    # Consumer processes, each writing its own FAISS shard.
    num_consumers: int = 2
    # Host buffer slots of the egress engine; 0 = twice the consumers.
    num_slots: int = 0
    # Chunks sorted together by length (in batches) so batches pad little.
    sort_window: int = 16
    # Vectors per committed segment file (smaller: less redone after a crash).
    commit_every: int = 200_000
    # Vectors sampled to train IVF/PQ/HNSW factories.
    train_size: int = 50_000
    # Delete whatever index is in the output folder first.
    overwrite: bool = False
    # Text put before each chunk for the encoder (default: the model folder's document
    # prompt, from config_sentence_transformers.json); "" for none. Stored spans stay the source's.
    doc_prompt: str | None = None
    # Text put before each query (default: the model folder's query prompt); kept in the
    # manifest, so search, serve and open_index apply it.
    query_prompt: str | None = None
    # faiss search parameters kept with the index, used by search, serve and open_index
    # unless they give their own, e.g. "nprobe=16" (IVF) or "efSearch=128" (HNSW).
    search_params: str | None = None
    # Results per query kept with the index, used when a search gives no k.
    search_k: int | None = None

    def for_device(self, cuda: bool) -> IndexConfig:
        """This config with ``batch_size`` 0 (auto) made concrete for the device kind."""
        if self.batch_size:
            return self
        return dataclasses.replace(self, batch_size=1024 if cuda else 256)

    def validate(self) -> None:
        if self.batch_size < 0:
            raise ConfigError(f"batch-size={self.batch_size}: must be at least 1, or 0 (auto)")
        for name in ("chunk_tokens", "num_consumers", "sort_window", "commit_every",
                     "train_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')}={getattr(self, name)}: must be at least 1")
        if self.overlap < 0 or self.overlap >= self.chunk_tokens:
            raise ConfigError(f"overlap={self.overlap}: must be >= 0 and smaller than "
                              f"chunk-tokens ({self.chunk_tokens})")
        if self.metric not in ("ip", "l2"):
            raise ConfigError(f"metric={self.metric!r}: use 'ip' or 'l2'")
        if self.search_k is not None and self.search_k < 1:
            raise ConfigError(f"search-k={self.search_k}: must be at least 1")



def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Build ``cls`` from an optional TOML preset, then ``overrides`` (None values are ignored).

    Unknown keys are an error naming the key and the fields that exist, so a typo in a
    preset never passes silently.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                values.update(tomllib.load(fh))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config preset {str(path)!r}: {exc}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}; "
            f"known settings are: {', '.join(sorted(names))}")
    return cls(**values)
