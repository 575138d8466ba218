"""IndexStore.wipe and the model identity of a manifest: cases that mutation testing found
untested (docs/TESTING.md)."""

from __future__ import annotations

import pytest

from embedingest.errors import ConfigError
from embedingest.index.store import METADATA_NAME, IndexStore, Manifest, model_identity


def test_model_identity_is_the_name_else_the_path():
    assert model_identity({"name": "m", "path": "/a"}) == "m"
    assert model_identity({"path": "/models/mine"}) == "/models/mine"
    assert model_identity({}) is None
    a = Manifest(model={"path": "/models/a"}, dim=4)
    assert a.compatible_with(Manifest(model={"path": "/models/a"}, dim=4))
    assert not a.compatible_with(Manifest(model={"path": "/models/b"}, dim=4))


def test_overwrite_of_a_folder_without_segments_and_with_sqlite_side_files(tmp_path):
    store = IndexStore(tmp_path)
    store.create_or_open(Manifest(model={"path": "/models/a"}, dim=4))
    store.close()
    (tmp_path / "segments").rmdir()  # nothing committed yet
    for suffix in ("-wal", "-shm"):  # what a killed sqlite writer leaves
        (tmp_path / (METADATA_NAME + suffix)).write_bytes(b"x")
    with pytest.raises(ConfigError, match="use --overwrite"):
        IndexStore(tmp_path).create_or_open(Manifest(model={"path": "/models/b"}, dim=4))
    IndexStore(tmp_path).wipe()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    store = IndexStore(tmp_path)
    m = store.create_or_open(Manifest(model={"path": "/models/b"}, dim=4), overwrite=True)
    store.close()
    assert m.model == {"path": "/models/b"}
