"""Removing vectors from a faiss index file's contents, codes untouched where possible.

Shared by both index formats: a removal rewrites a segment or shard without the vectors
of some units (a changed or deleted file, a half-done unit).
"""

from __future__ import annotations

import faiss
import numpy as np

from ..errors import ConfigError
from .faiss_factory import copy_index


def _array_ivf(inner: faiss.Index) -> faiss.IndexIVF | None:
    """The IVF of an IVF index (or of a transform over one) whose lists can be edited."""
    if isinstance(inner, faiss.IndexPreTransform):
        inner = faiss.downcast_index(inner.index)
    if isinstance(inner, faiss.IndexIVF) and isinstance(
            faiss.downcast_InvertedLists(inner.invlists), faiss.ArrayInvertedLists):
        return inner
    return None


def removes_in_place(index: faiss.IndexIDMap) -> bool:
    """Whether :func:`without` edits ``index`` itself, keeping codes exactly: flat codes
    (Flat, SQ, PQ) and IVF with array inverted lists."""
    inner = faiss.downcast_index(index.index)
    return isinstance(inner, faiss.IndexFlatCodes) or _array_ivf(inner) is not None


def without(index: faiss.IndexIDMap, keep: np.ndarray,
             template: faiss.Index | None) -> tuple[faiss.Index, np.ndarray]:
    """Keep the vectors of ``index`` at positions ``keep``; return (index, kept ids).

    ``IndexIDMap.remove_ids`` is wrong for IVF (it compacts the id map but not the labels
    in the inverted lists), so IVF lists are filtered and relabelled here, codes untouched.
    Other kinds (HNSW has no remove_ids) are rebuilt from reconstructed vectors into a
    clone of ``template``: exact for HNSW over flat storage, re-quantised for lossy codecs.
    """
    ids = faiss.vector_to_array(index.id_map)
    kept = ids[keep]
    inner = faiss.downcast_index(index.index)
    if isinstance(inner, faiss.IndexFlatCodes):
        index.remove_ids(faiss.IDSelectorBatch(ids[~keep]))
        return index, kept
    ivf = _array_ivf(inner)
    if ivf is not None:
        _filter_ivf_lists(ivf, keep)
        inner.ntotal = ivf.ntotal
        faiss.copy_array_to_vector(kept, index.id_map)
        index.ntotal = len(kept)
        return index, kept
    try:
        faiss.extract_index_ivf(inner).make_direct_map()
    except RuntimeError:
        pass
    try:
        vectors = inner.reconstruct_n(0, index.ntotal)[keep]
    except RuntimeError as exc:
        raise ConfigError(f"vectors of a {type(inner).__name__} index cannot be reconstructed, "
                          "so units cannot be removed from it: rebuild with --overwrite") from exc
    rebuilt = faiss.IndexIDMap(copy_index(template))
    rebuilt.add_with_ids(vectors, kept)
    return rebuilt, kept


def _filter_ivf_lists(ivf: faiss.IndexIVF, keep: np.ndarray) -> None:
    """Drop the entries whose label is not kept; renumber labels to the compacted order."""
    lists = faiss.downcast_InvertedLists(ivf.invlists)
    new_label = np.cumsum(keep, dtype=np.int64) - 1
    code_size = lists.code_size
    for no in range(lists.nlist):
        size = lists.list_size(no)
        if not size:
            continue
        labels = faiss.rev_swig_ptr(lists.get_ids(no), size).copy()
        codes = faiss.rev_swig_ptr(lists.get_codes(no), size * code_size).reshape(size, code_size)
        mask = keep[labels]
        new_labels = np.ascontiguousarray(new_label[labels[mask]])
        new_codes = np.ascontiguousarray(codes[mask])
        lists.resize(no, len(new_labels))
        if len(new_labels):
            lists.update_entries(no, 0, len(new_labels), faiss.swig_ptr(new_labels),
                                 faiss.swig_ptr(new_codes))
    ivf.ntotal = int(keep.sum())
