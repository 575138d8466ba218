"""faiss_edit: which kinds of index lose vectors in place, and the refusal of a kind whose
vectors cannot be taken back out (the removals themselves: test_shard_edit.py)."""

import faiss
import numpy as np
import pytest
from shard_fixtures import DIM, unit_vectors

from embedingest.errors import ConfigError
from embedingest.index.faiss_edit import removes_in_place, without


def id_map(factory, n=40):
    template = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
    template.train(unit_vectors(600, seed=3))
    index = faiss.IndexIDMap(faiss.clone_index(template))
    index.add_with_ids(unit_vectors(n, seed=4), np.arange(100, 100 + n, dtype=np.int64))
    return index, template


@pytest.mark.parametrize("factory, in_place", [
    ("Flat", True), ("SQ8", True), ("PQ4x4", True),  # flat codes
    ("IVF4,Flat", True), ("PCA8,IVF4,Flat", True),  # IVF with array lists, bare or under a transform
    ("HNSW8", False),  # no remove_ids
    ("IVF4,PQ8x4fs", False),  # IVF whose lists are blocks (fast scan)
])
def test_removes_in_place_for_flat_codes_and_ivf_with_array_lists_only(factory, in_place):
    """A removal from an in-place kind needs no template (shard_edit refuses the others
    without one), so an IVF index taken for another kind could not lose a unit."""
    index, _ = id_map(factory)
    assert removes_in_place(index) is in_place


def test_a_kind_whose_vectors_cannot_be_reconstructed_is_refused_with_the_rebuild_advice(monkeypatch):
    """Every kind faiss 1.15 builds from a factory reconstructs, so the failure is injected:
    the refusal names the kind and says what to do, in these words."""
    index, template = id_map("HNSW8")

    def fail(self, *args, **kwargs):
        raise RuntimeError("reconstruct not implemented for this type of index")
    monkeypatch.setattr(faiss.IndexHNSWFlat, "reconstruct_n", fail)
    with pytest.raises(ConfigError) as err:
        without(index, np.arange(40) % 2 == 0, template)
    assert str(err.value) == ("vectors of a IndexHNSWFlat index cannot be reconstructed, so units cannot "
                              "be removed from it: rebuild with --overwrite")
    assert isinstance(err.value.__cause__, RuntimeError)
