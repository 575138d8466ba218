"""Helpers of the build-index tests: short paragraphs on distinct topics (each one the
best match of itself), and what a built index holds, read back shard by shard."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np

from embedingest.index.shard_store import ShardStore

TOPICS = [
    "The quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "The French Revolution began in 1789 and reshaped politics across Europe for a century.",
    "A hash table maps keys to values using a hash function to compute an index into buckets.",
    "Mount Everest, at 8,849 metres, is the highest mountain above sea level on Earth.",
    "Bread rises because yeast ferments sugars and releases carbon dioxide into the dough.",
    "TCP provides reliable, ordered delivery of a stream of bytes between applications.",
    "Whales are marine mammals that breathe air through blowholes on top of their heads.",
    "The stock market fell sharply after the central bank unexpectedly raised interest rates.",
    "Shakespeare wrote Hamlet, a tragedy about a Danish prince seeking revenge for his father.",
    "Gradient descent updates parameters in the direction that most reduces the loss function.",
    "Volcanoes form where magma from the mantle reaches the surface through cracks in the crust.",
]


def vectors_by_id(out: Path) -> dict[int, np.ndarray]:
    """Every stored vector by id, in shard order, read from the committed shards' faiss
    files; an id stored twice fails."""
    found = {}
    with ShardStore(out) as store:
        for shard in store.shards():
            index = faiss.read_index(str(shard.path))
            for i, v in zip(faiss.vector_to_array(index.id_map).tolist(),
                            index.index.reconstruct_n(0, index.ntotal)):
                assert i not in found, f"id {i} stored twice"
                found[i] = v
    return found


def chunk_rows(out: Path, ids) -> dict:
    """(source, record_id, chunk_no, char_start, char_end, text) by id."""
    with ShardStore(out) as store:
        return {i: (c.source, c.record_id, c.chunk_no, c.char_start, c.char_end, c.text)
                for i, c in store.chunks(ids).items()}
