"""The presets in configs/ against the config dataclasses they fill."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from embedingest.config import IndexConfig, SegmentConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize(("cls", "name"), [(IndexConfig, "build-index.toml"), (SegmentConfig, "segment.toml")])
def test_a_defaults_preset_is_the_dataclass_s_defaults_and_spells_out_every_field(cls, name):
    """Each says it holds the defaults spelled out: it loads to exactly them, and every field
    is there, set or (where the default is "the model's", "the index's") commented out."""
    text = (CONFIGS / name).read_text()
    assert load_config(cls, CONFIGS / name) == cls()
    missing = [f.name for f in dataclasses.fields(cls) if not re.search(rf"^(# )?{f.name} = ", text, re.M)]
    assert not missing, f"{name} leaves out {missing}"


def test_every_preset_loads_and_validates():
    for path in sorted(CONFIGS.glob("*.toml")):
        cls = SegmentConfig if path.name.startswith("segment") else IndexConfig
        load_config(cls, path).validate()
    large = load_config(IndexConfig, CONFIGS / "build-index-gpu-large.toml")
    assert (large.index, large.device, large.dtype, large.batch_size) == ("IVF4096,PQ64", "cuda", "fp16", 1024)
