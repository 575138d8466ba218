"""The shard writer as the egress engine's sink: rows travel as the batch id, each
consumer commits its own shards."""

import numpy as np
import torch
from shard_fixtures import DIM, batches, meta_of, unit_vectors

from embedingest import EgressEngine
from embedingest.index.lookup import ShardRows
from embedingest.index.shards import finished_units, incomplete_units, list_shards
from embedingest.sinks.shard_writer import ShardWriterFactory


def test_consumers_commit_every_row_and_vector_sent_through_the_engine(tmp_path):
    plan = batches(range(9), 13, batch=16)
    ids = np.array([r["id"] for part, _ in plan for r in part], dtype=np.int64)
    emb = unit_vectors(len(ids), seed=2)
    spec = ShardWriterFactory(str(tmp_path), DIM, commit_every=40, save_embeddings=True, run_id="e")
    start = 0
    with EgressEngine(spec, num_consumers=2, num_slots=3, device="cpu",
                      slot_spec={"emb": ((16, DIM), "float32"), "ids": ((16,), "int64")}) as engine:
        for b, (part, done) in enumerate(plan):
            n = len(part)
            engine.submit(meta_of(b, part, done), {"emb": torch.from_numpy(emb[start:start + n]),
                                                   "ids": ids[start:start + n]})
            start += n
    written = [w for result in engine.closed_results for w in result]
    assert sum(w["count"] for w in written) == len(ids) and {w["name"][:9] for w in written} == {"shard-e-w"}
    shards = list_shards(tmp_path / "shards")
    assert incomplete_units(shards) == set() and finished_units(shards) == {u: 13 for u in range(9)}
    rows = ShardRows(shards)
    got = rows.table(ids)
    assert got == {r["id"]: r for part, _ in plan for r in part}
    for shard in shards:
        stored = np.load(shard.path("emb"))
        assert np.array_equal(stored, emb[np.searchsorted(ids, rows.shard_ids(rows.shards.index(shard)))]
                              .astype(np.float16))
