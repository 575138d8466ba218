"""FAISS shard sink: the embeddings a consumer process receives become immutable index
shards on disk.

It runs inside the engine's consumer processes, so it imports numpy and faiss only (never
torch). Every ``commit_every`` vectors the in-memory index is committed as a shard: the
ids sidecar is written first, then the ``.faiss`` file, each through a temporary file,
checked to be whole, fsynced and ``os.replace``d (``embedingest.outfiles``). A shard
exists iff its ``.faiss`` file exists, so a crash leaves whole shards plus garbage
(temporary files, an orphan sidecar) that :meth:`IndexStore.clean_garbage` removes; the
vectors added since the last commit are lost and the resume step redoes their units.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from ..errors import ConfigError
from ..index.lock import hold_writer_lock
from ..outfiles import atomic_file, ensure_folder, new_run_id, write_faiss_index

SHARDS_DIR = "segments"
TRAINED_NAME = "trained.faiss"
SHARD_SUFFIX = ".faiss"
IDS_SUFFIX = ".ids.npy"
METRICS = {"ip": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2}
_RUN_ID = re.compile(r"[A-Za-z0-9_]+")
SHARD_NAME = re.compile(r"seg-[A-Za-z0-9_]+-w[0-9]+-[0-9]+" + re.escape(SHARD_SUFFIX))


def metric_code(metric: str) -> int:
    """The faiss metric constant of ``"ip"`` or ``"l2"``."""
    try:
        return METRICS[metric]
    except KeyError:
        raise ConfigError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}") from None


def shard_name(run_id: str, worker: int, part: int) -> str:
    """The part is zero-padded so a listing sorts in commit order."""
    return f"seg-{run_id}-w{worker}-{part:05d}{SHARD_SUFFIX}"


def sidecar_path(shard: Path) -> Path:
    """``seg-...faiss`` -> ``seg-...ids.npy``: the int64 ids of the shard, in index order."""
    return shard.with_name(shard.name[: -len(SHARD_SUFFIX)] + IDS_SUFFIX)


def write_shard(path: Path, index: faiss.Index, ids: np.ndarray) -> None:
    """Commit one shard: the ids sidecar, then the ``.faiss`` file that makes it exist;
    each checked to be whole before it is renamed into place."""
    if index.ntotal != len(ids):
        raise ValueError(f"shard {path.name}: index holds {index.ntotal} vectors, ids {len(ids)}")
    with atomic_file(sidecar_path(path), sync_dir=True) as fh:
        np.save(fh, np.ascontiguousarray(ids, dtype=np.int64))
    write_faiss_index(index, path)


def faiss_message(exc: RuntimeError) -> str:
    """What a faiss error says failed, without the C++ function and source line it names."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^Error in .*? at \S+:\d+: (Error: )?", "", lines[0])


def parse_factory(dim: int, factory: str, metric: str) -> faiss.Index:
    """``faiss.index_factory(dim, factory, metric)``, a ConfigError naming the string when
    faiss cannot make it. A build calls it before it writes anything, so a bad
    ``--index`` never gets into a manifest."""
    try:
        return faiss.index_factory(dim, factory, metric_code(metric))
    except RuntimeError as exc:
        raise ConfigError(f"faiss cannot build index factory {factory!r} for dim {dim}: "
                          f"{faiss_message(exc)}; see faiss's index_factory strings (e.g. Flat, IVF1024,Flat, "
                          "HNSW32)") from exc


def empty_index(dim: int, factory: str, metric: str, trained: faiss.Index | None = None) -> faiss.Index:
    """An empty, trained index of the shard kind (without the id map): a clone of
    ``trained`` when given, else ``faiss.index_factory(dim, factory, metric)``."""
    if trained is not None:
        return faiss.clone_index(trained)
    index = parse_factory(dim, factory, metric)
    if not index.is_trained:
        raise ConfigError(f"index factory {factory!r} needs training: train it on a sample "
                          "with IndexStore.train_index and pass the trained index path")
    return index


def as_float32(emb: np.ndarray) -> np.ndarray:
    """float32, float16, or bfloat16 bits (uint16, as the engine delivers bf16) -> float32."""
    if emb.dtype == np.uint16:
        return (emb.astype(np.uint32) << 16).view(np.float32)
    if emb.dtype in (np.float32, np.float16):
        return np.ascontiguousarray(emb, dtype=np.float32)
    raise ConfigError(f"embeddings of dtype {emb.dtype} cannot be indexed; "
                      "send float32, float16 or bfloat16")


@dataclass
class FaissShardSinkFactory:
    """Picklable recipe for the per-consumer sinks of one run (see the engine contract)."""

    folder: str
    dim: int
    factory: str = "Flat"
    metric: str = "ip"
    run_id: str = field(default_factory=new_run_id)
    commit_every: int = 200_000
    trained: str | None = None

    def __post_init__(self):
        self.folder = os.fspath(self.folder)
        if self.trained is not None:
            self.trained = os.fspath(self.trained)
        if not _RUN_ID.fullmatch(self.run_id):
            raise ConfigError(f"run id {self.run_id!r} may hold only letters, digits and '_'")
        if self.dim <= 0:
            raise ConfigError(f"dim must be positive, got {self.dim}")
        if self.commit_every <= 0:
            raise ConfigError(f"commit_every must be positive, got {self.commit_every}")
        if self.trained is None:
            empty_index(self.dim, self.factory, self.metric)  # fail here, not in a consumer
        else:
            metric_code(self.metric)
            if not Path(self.trained).is_file():
                raise ConfigError(f"trained index {self.trained!r} does not exist; "
                                  "train one with IndexStore.train_index")

    def __call__(self, worker: int) -> FaissShardSink:
        return FaissShardSink(self, worker)


class FaissShardSink:
    """Adds ``arrays["emb"]`` under ``arrays["ids"]`` and commits a shard every
    ``commit_every`` vectors (shards hold exactly that many, the last one fewer)."""

    def __init__(self, spec: FaissShardSinkFactory, worker: int):
        self.spec = spec
        self.worker = worker
        self.folder = Path(spec.folder) / SHARDS_DIR
        ensure_folder(Path(spec.folder), self.folder)
        # Held until the last commit (close) or this process's death: a new build of the
        # folder waits for it (index/lock.py).
        self._writer_lock: int | None = hold_writer_lock(spec.folder)
        used = sorted(self.folder.glob(f"seg-{spec.run_id}-w{worker}-*{SHARD_SUFFIX}"))
        if used:
            raise ConfigError(f"shard {used[0].name} already exists: run id {spec.run_id!r} "
                              "was used before; start each run with a new run id")
        self._trained = faiss.read_index(spec.trained) if spec.trained else None
        if self._trained is not None and self._trained.d != spec.dim:
            raise ConfigError(f"trained index {spec.trained!r} has dim {self._trained.d}, not {spec.dim}")
        self._index: faiss.IndexIDMap | None = None
        self._ids: list[np.ndarray] = []
        self._pending = 0
        self._part = 0
        self.written: list[dict] = []

    def __call__(self, batch_id, arrays: dict) -> None:
        emb, ids = arrays["emb"], arrays["ids"]
        if emb.ndim != 2 or emb.shape[1] != self.spec.dim:
            raise ConfigError(f"batch {batch_id!r}: embeddings of shape {emb.shape}, "
                              f"expected (n, {self.spec.dim})")
        if ids.shape != (emb.shape[0],):
            raise ConfigError(f"batch {batch_id!r}: ids of shape {ids.shape} for "
                              f"{emb.shape[0]} embeddings")
        start, n = 0, emb.shape[0]
        while start < n:
            stop = min(n, start + self.spec.commit_every - self._pending)
            self._add(emb[start:stop], ids[start:stop])
            start = stop
            if self._pending >= self.spec.commit_every:
                self.commit()

    def _add(self, emb: np.ndarray, ids: np.ndarray) -> None:
        if self._index is None:
            spec = self.spec
            self._index = faiss.IndexIDMap(empty_index(spec.dim, spec.factory, spec.metric, self._trained))
        kept = np.array(ids, dtype=np.int64)  # a copy: the shared-memory slot is reused
        self._index.add_with_ids(as_float32(emb), kept)
        self._ids.append(kept)
        self._pending += len(kept)

    def commit(self) -> None:
        """Write the vectors added since the last commit as a new shard (none if empty)."""
        if not self._pending:
            return
        name = shard_name(self.spec.run_id, self.worker, self._part)
        write_shard(self.folder / name, self._index, np.concatenate(self._ids))
        self.written.append({"name": name, "count": self._pending})
        self._index, self._ids, self._pending = None, [], 0
        self._part += 1

    def close(self) -> list[dict]:
        """Commit what is left; return every shard this sink wrote as {name, count}."""
        try:
            self.commit()
        finally:
            if self._writer_lock is not None:
                os.close(self._writer_lock)  # the last commit is on disk: a new build may start
                self._writer_lock = None
        return list(self.written)
