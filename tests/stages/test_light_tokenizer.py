"""LightTokenizer against transformers' AutoTokenizer on the same folder: ids, padding,
truncation and special tokens over generated and hostile texts; and the folders it must
leave to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedingest.errors import ConfigError
from embedingest.stages.light_tokenizer import LightTokenizer
from embedingest.stages.tokenizer import load_tokenizer
from model_fixtures import BUNDLED

HOSTILE = [
    "", " ", "Hello, World! It's 3.14 o'clock; x[SEP]y [CLS] [cls] [MASK]s [PAD][UNK]",
    "ünïcödé Crème brûlée ΣΑΣ ß İstanbul ﬁne Å e\u0301 東京都 한국어 ภาษาไทย",
    "emoji \U0001F600 \U0001F44D\U0001F3FD \u2764\ufe0f", "ctl\x00a\x01b\x0bc\x7ff\x85g \u200b\ufeff\u00a0\u3000\u00ad",
    "a" * 99 + " " + "b" * 101 + " antidisestablishmentarianism", "word " * 700,
]


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoTokenizer

    light = LightTokenizer.open(BUNDLED)
    assert light is not None
    return light, AutoTokenizer.from_pretrained(BUNDLED, local_files_only=True)


def test_special_tokens_and_limits_are_transformers(pair):
    light, ref = pair
    for name in ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token", "pad_token_id",
                 "unk_token_id", "cls_token_id", "sep_token_id", "mask_token_id", "model_max_length"):
        assert getattr(light, name) == getattr(ref, name), name
    assert light.is_fast and light.eos_token is None and light.eos_token_id is None


def test_hostile_texts_give_transformers_ids(pair):
    light, ref = pair
    for special in (True, False):
        assert ([light(t, add_special_tokens=special)["input_ids"] for t in HOSTILE]
                == [ref(t, add_special_tokens=special)["input_ids"] for t in HOSTILE])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(min_size=0, max_size=300), min_size=1, max_size=6),
       max_length=st.sampled_from([8, 16, 256]), multiple=st.sampled_from([None, 8, 16]))
def test_batches_padded_and_truncated_as_transformers(pair, texts, max_length, multiple):
    light, ref = pair
    kwargs = dict(padding=True, truncation=True, max_length=max_length, pad_to_multiple_of=multiple,
                  return_tensors="pt")
    if multiple and max_length % multiple:
        with pytest.raises(ValueError):
            ref(texts, **kwargs)
        with pytest.raises(ValueError, match="not a multiple"):
            light(texts, **kwargs)
        return
    ours, theirs = light(texts, **kwargs), ref(texts, **kwargs)
    for key in ("input_ids", "attention_mask"):
        assert ours[key].dtype == torch.long and torch.equal(ours[key], theirs[key]), key


def test_a_call_leaves_the_backend_as_it_was(pair):
    """The chunkers copy ``backend_tokenizer`` as they find it: a padded, truncated call
    must not set padding or truncation on it."""
    light, _ = pair
    light(["a b c"] * 3, padding=True, truncation=True, max_length=2)
    assert light.backend_tokenizer.padding is None and light.backend_tokenizer.truncation is None


def test_the_pipeline_loads_it_for_the_bundled_model():
    assert isinstance(load_tokenizer(None), LightTokenizer)


def changed(tmp_path: Path, config: dict | None = None, spec=None) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(BUNDLED / name, folder / name)
    if config is not None:
        data = json.loads((folder / "tokenizer_config.json").read_text()) | config
        (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in data.items() if v != "DROP"}))
    if spec is not None:
        data = json.loads((folder / "tokenizer.json").read_text())
        spec(data)
        (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("config,spec", [
    ({"tokenizer_class": "RobertaTokenizer"}, None),
    ({"tokenizer_class": "DROP"}, None),
    ({"do_lower_case": False}, None),  # transformers rebuilds the normalizer: not this file's
    ({"strip_accents": True}, None),
    ({"tokenize_chinese_chars": False}, None),
    ({"cls_token": "[MASK]"}, None),
    (None, lambda d: d.update(pre_tokenizer={"type": "Whitespace"})),
    (None, lambda d: d["model"].update(max_input_chars_per_word=50)),
    (None, lambda d: d["post_processor"].update(single=[{"Sequence": {"id": "A", "type_id": 0}}])),
    (None, lambda d: d.update(added_tokens=[])),
    ({"added_tokens_decoder": {"30522": {"content": "<new>", "special": True}}}, None),
], ids=["class", "no-class", "lower", "accents", "chinese", "cls", "pre", "wordpiece", "post", "added",
        "declared"])
def test_other_folders_are_left_to_transformers(tmp_path, config, spec):
    folder = changed(tmp_path, config, spec)
    assert LightTokenizer.open(folder) is None
    try:
        loaded = load_tokenizer(folder)
    except ConfigError:  # transformers itself cannot make sense of some of these folders
        return
    assert not isinstance(loaded, LightTokenizer)


def test_a_folder_without_tokenizer_json_or_with_a_broken_one(tmp_path):
    folder = changed(tmp_path)
    (folder / "tokenizer.json").write_text("{broken")
    assert LightTokenizer.open(folder) is None
    (folder / "tokenizer.json").unlink()
    assert LightTokenizer.open(folder) is None


def test_no_model_max_length_is_transformers_no_limit(tmp_path, pair):
    from transformers import AutoTokenizer

    folder = changed(tmp_path, {"model_max_length": "DROP"})
    assert LightTokenizer.open(folder).model_max_length == AutoTokenizer.from_pretrained(folder).model_max_length
