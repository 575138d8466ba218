"""build_index_ray honours the model's prompts as build_index does."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from model_fixtures import copy_model
from test_build_index_devices import vectors_by_id

from embedingest import build_index

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*"), pytest.mark.slow]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECORDS = [{"id": f"r{i}", "text": f"Record {i} tells of rivers, bread and whales, part {i}."}
           for i in range(6)]
SETTINGS = {"num_consumers": 1, "batch_size": 4, "search_k": 4}


def test_ray_build_uses_the_document_prompt_and_records_both(tmp_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'embedingest[ray]')")
    from embedingest import build_index_ray

    model = copy_model(tmp_path / "e5-like", prompts={"query": "query: ", "passage": "passage: "})
    one, two = tmp_path / "one", tmp_path / "two"
    build_index(RECORDS, out=str(one), model=str(model), num_workers=0, **SETTINGS)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)  # its own instance (test_build_index_ray.py says why)
    try:
        build_index_ray(ray.data.from_items(RECORDS), two, model=str(model), concurrency=1, **SETTINGS)
    finally:
        ray.shutdown()
    m1, m2 = (json.loads((f / "manifest.json").read_text()) for f in (one, two))
    assert m1["prompts"] == m2["prompts"] == {"document": "passage: ", "query": "query: "}
    assert m2["search"] == {"k": 4}
    va, vb = vectors_by_id(one), vectors_by_id(two)
    assert sorted(va) == sorted(vb) and max(float(np.abs(va[i] - vb[i]).max()) for i in va) <= 1e-5
