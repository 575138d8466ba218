"""The two real indexes of :mod:`index_pair_fixtures`, copied for each test to change."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from index_pair_fixtures import build_two_indexes


@pytest.fixture(scope="session")
def two_indexes(tmp_path_factory) -> Path:
    return build_two_indexes(tmp_path_factory.mktemp("two_indexes"))


@pytest.fixture
def indexes(two_indexes, tmp_path) -> Path:
    """A copy of both indexes and their corpora for one test to change."""
    for entry in two_indexes.iterdir():
        shutil.copytree(entry, tmp_path / entry.name, symlinks=True)
    return tmp_path
