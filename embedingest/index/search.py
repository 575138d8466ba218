"""Query an index folder: every segment is searched and the per-segment top-k are merged,
so the result equals one search over all vectors (exactly so for Flat segments).

Segments are memory-mapped where faiss can (flat codes, IVF lists), so opening a large
index costs little memory and starts fast; the page cache holds what queries touch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from ..errors import ConfigError
from .store import IndexStore, Manifest, read_index_file

_MMAP_FLAGS = (
    faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY,  # flat codes, HNSW
    faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY,  # IVF inverted lists
)


@dataclass(frozen=True)
class Hit:
    """One result; rank 1 is the best. ``record_id``, ``char_start`` and ``char_end`` are None
    where the source has none."""

    rank: int
    score: float
    id: int
    source: str | None
    record_id: str | None
    chunk_no: int | None
    char_start: int | None
    char_end: int | None
    text: str | None


def read_segment(path: Path) -> faiss.Index:
    """Read a segment memory-mapped where faiss supports it for its kind, else into memory;
    a damaged file is a ConfigError naming it."""
    for flags in _MMAP_FLAGS:
        try:
            return faiss.read_index(str(path), flags)
        except RuntimeError:
            continue
    return read_index_file(path)


class Index:
    """A searchable index folder; see :func:`open_index`."""

    def __init__(self, store: IndexStore, manifest: Manifest, segments: list[faiss.Index],
                 encoder=None, device: str = "cpu"):
        self.store = store
        self.manifest = manifest
        self.segments = segments
        self.device = device
        self._encoder = encoder

    def __enter__(self) -> Index:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.ntotal

    @property
    def ntotal(self) -> int:
        return sum(s.ntotal for s in self.segments)

    def close(self) -> None:
        self.segments = []
        self.store.close()

    @property
    def encoder(self):
        """The query encoder: the one given, else the manifest's model, loaded on first use.

        fp16 becomes fp32 on the CPU (the encoder refuses fp16 there); a model folder that
        is not on this machine is replaced by the bundled model when the manifest names it.
        """
        if self._encoder is None:
            from ..stages.encoder import BUNDLED_NAME, TextEncoder
            model = self.manifest.model
            path, name = model.get("path"), model.get("name")
            if not path or not Path(path).is_dir():
                if name != BUNDLED_NAME:
                    raise ConfigError(f"the model of {str(self.store.folder)!r} ({name!r}) is not on "
                                      f"this machine (path {path!r}): pass encoder= or query vectors")
                path = None
            dtype = self.manifest.dtype
            if dtype == "fp16" and str(self.device).startswith("cpu"):
                dtype = "fp32"
            encoder = TextEncoder.load(path, self.device, dtype)
            if encoder.info().get("name") != name or encoder.dim != self.manifest.dim:
                raise ConfigError(f"model at {path!r} is {encoder.info().get('name')!r} (dim "
                                  f"{encoder.dim}), but the index was built with {name!r} (dim "
                                  f"{self.manifest.dim}): rebuild with --overwrite or pass encoder=")
            self._encoder = encoder
        return self._encoder

    def search(self, queries: str | list[str], k: int = 10) -> list[list[Hit]]:
        """Top ``k`` chunks for each query text, best first."""
        if isinstance(queries, str):
            queries = [queries]
        if not queries:
            return []
        blank = [i for i, q in enumerate(queries) if not isinstance(q, str) or not q.strip()]
        if blank:
            raise ConfigError(f"query {blank[0]} ({queries[blank[0]]!r}) is empty or not text; "
                              "give each query some words")
        return self.search_vectors(self.encoder.encode(list(queries)), k)

    def search_vectors(self, vectors: np.ndarray, k: int = 10) -> list[list[Hit]]:
        """Top ``k`` chunks for each query vector (used as given: normalise them for "ip")."""
        scores, ids = self.search_raw(vectors, k)
        found = np.unique(ids[ids >= 0]).tolist()
        rows = self.store.chunks(found)
        missing = [i for i in found if i not in rows]
        if missing:
            raise ConfigError(
                f"{len(missing)} of the vectors found have no metadata row in "
                f"{str(self.store.metadata_path)!r} (e.g. id {missing[0]}): the last build of this "
                "index was stopped before it finished (or one is running now); run the same "
                "build-index command again to finish it, then search")
        out = []
        for row_scores, row_ids in zip(scores, ids):
            hits = []
            for rank, (score, vid) in enumerate(zip(row_scores.tolist(), row_ids.tolist()), 1):
                if vid < 0:
                    break
                c = rows.get(vid)
                hits.append(Hit(rank, score, vid, *(
                    (c.source, c.record_id, c.chunk_no, c.char_start, c.char_end, c.text)
                    if c else (None,) * 6)))
            out.append(hits)
        return out

    def search_raw(self, vectors: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each [nq, k], best first; id -1 pads rows when fewer than k exist."""
        q = np.ascontiguousarray(vectors, dtype=np.float32)
        if q.ndim == 1:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self.manifest.dim:
            raise ConfigError(f"query vectors of shape {np.shape(vectors)}, expected "
                              f"(n, {self.manifest.dim}) for the index at {str(self.store.folder)!r}")
        if k <= 0:
            raise ConfigError(f"k must be positive, got {k}")
        k = min(k, self.ntotal)
        if k == 0:
            return np.empty((len(q), 0), np.float32), np.empty((len(q), 0), np.int64)
        heap = faiss.ResultHeap(len(q), k, keep_max=self.manifest.metric == "ip")
        for seg in self.segments:
            if seg.ntotal:
                heap.add_result(*seg.search(q, min(k, seg.ntotal)))
        heap.finalize()
        return heap.D, heap.I


def _ids_match(index: faiss.Index, seg) -> bool:
    """The first and last ids of a segment equal its sidecar's: a file cut short inside
    its last page still loads memory-mapped (the rest of the page reads as zeros), with
    its last ids wrong."""
    id_map = getattr(index, "id_map", None)
    if id_map is None or index.ntotal == 0:
        return True
    ids = np.load(seg.ids_path, mmap_mode="r")
    return id_map.at(0) == ids[0] and id_map.at(index.ntotal - 1) == ids[-1]


def open_index(path: str | os.PathLike, device: str = "cpu", *, encoder=None,
               params: str | None = None) -> Index:
    """Open the index folder ``path`` for search.

    ``device`` is where the query encoder runs (faiss search itself runs on the CPU).
    ``encoder``: any object with ``encode(list[str]) -> np.ndarray``, instead of loading
    the manifest's model. ``params``: faiss search parameters for every segment, e.g.
    ``"nprobe=16"`` (IVF) or ``"efSearch=128"`` (HNSW).
    """
    store = IndexStore(path, read_only=True)
    manifest = store.read_manifest()
    listed = store.segments()
    if any(seg.count for seg in listed) or os.path.lexists(store.metadata_path):
        store.connect().close()  # a missing or damaged database fails here, not after a query
    segments = []
    for seg in listed:
        index = read_segment(seg.path)
        if index.ntotal != seg.count or index.d != manifest.dim or not _ids_match(index, seg):
            raise ConfigError(
                f"segment {str(seg.path)!r} holds {index.ntotal} vectors of dim {index.d}, but its "
                f"sidecar lists {seg.count} (or other ids) and the manifest says dim {manifest.dim}: "
                "the file is damaged; delete that segment's .faiss and .ids.npy files and run build-index "
                "again to redo the units it held")
        if params:
            try:
                faiss.ParameterSpace().set_index_parameters(index, params)
            except RuntimeError as exc:
                raise ConfigError(f"search parameters {params!r} do not apply to {seg.name} "
                                  f"(factory {manifest.factory!r}): {str(exc).splitlines()[0]}") from exc
        segments.append(index)
    return Index(store, manifest, segments, encoder=encoder, device=device)
