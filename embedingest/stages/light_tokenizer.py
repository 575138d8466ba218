"""A BERT WordPiece tokenizer from ``tokenizers`` alone, as transformers would give it.

transformers' ``BertTokenizer`` (fast) is the Rust tokenizer of tokenizer.json, or one
built from tokenizer_config.json's options (lower-casing, accents, Chinese characters, the
special tokens): a WordPiece with BERT's normalizer and pre-tokenizer and ``[CLS] $A
[SEP]`` around a text. :meth:`LightTokenizer.open` takes a folder only where its
tokenizer.json is exactly that tokenizer, so both give the same ids, and offers what the
pipeline uses of a transformers tokenizer: ``backend_tokenizer``, the special tokens,
``model_max_length`` and a call that truncates and pads as transformers does (through the
Rust tokenizer's own truncation and padding, as transformers itself does). Any other
folder returns None and is left to transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

BERT_CLASSES = {"BertTokenizer", "BertTokenizerFast"}
# transformers' default when tokenizer_config.json states no model_max_length
NO_LIMIT = int(1e30)
_SPECIAL = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_SPECIAL_DEFAULTS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                     "cls_token": "[CLS]", "mask_token": "[MASK]"}


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _bert_spec(spec: dict, config: dict, special: dict[str, str]) -> bool:
    """Whether tokenizer.json ``spec`` is the tokenizer transformers builds from ``config``."""
    norm, model, post = spec.get("normalizer") or {}, spec.get("model") or {}, spec.get("post_processor") or {}
    if norm != {"type": "BertNormalizer", "clean_text": True,
                "handle_chinese_chars": config.get("tokenize_chinese_chars", True),
                "strip_accents": config.get("strip_accents"),
                "lowercase": config.get("do_lower_case", True)}:
        return False
    if (spec.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer":
        return False
    if (model.get("type") != "WordPiece" or model.get("unk_token") != special["unk_token"]
            or model.get("continuing_subword_prefix", "##") != "##"
            or model.get("max_input_chars_per_word", 100) != 100):
        return False
    vocab = model.get("vocab") or {}
    cls, sep = special["cls_token"], special["sep_token"]
    if cls not in vocab or sep not in vocab:
        return False
    single = [{"SpecialToken": {"id": cls, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
              {"SpecialToken": {"id": sep, "type_id": 0}}]
    if post.get("type") != "TemplateProcessing" or post.get("single") != single:
        return False
    ids = {k: v.get("ids") for k, v in (post.get("special_tokens") or {}).items()}
    if ids != {cls: [vocab[cls]], sep: [vocab[sep]]}:
        return False
    added = {t.get("content"): t for t in spec.get("added_tokens") or []}
    if any(t not in added or not added[t].get("special") for t in special.values()):
        return False
    declared = config.get("added_tokens_decoder") or {}
    return all(isinstance(t, dict) and t.get("content") in added for t in declared.values())


class LightTokenizer:
    """The subset of a transformers fast tokenizer the pipeline uses, over ``tokenizers``."""

    is_fast = True

    def __init__(self, backend, special: dict[str, str], model_max_length: int):
        self.backend_tokenizer = backend
        self.model_max_length = model_max_length
        for name, token in special.items():
            setattr(self, name, token)
        self.eos_token = None
        self._configured: dict[tuple, Any] = {}

    @classmethod
    def open(cls, path: Path) -> LightTokenizer | None:
        """The tokenizer of folder ``path``, or None when it is not a BERT WordPiece whose
        tokenizer.json transformers would take as it is."""
        path = Path(path)
        config = _read(path / "tokenizer_config.json")
        if config.get("tokenizer_class") not in BERT_CLASSES or not (path / "tokenizer.json").is_file():
            return None
        special_map = _read(path / "special_tokens_map.json")
        special = {}
        for name in _SPECIAL:
            token = _token(config.get(name, special_map.get(name, _SPECIAL_DEFAULTS[name])))
            if token is None:
                return None
            special[name] = token
        try:
            text = (path / "tokenizer.json").read_text(encoding="utf-8")
            spec = json.loads(text)
        except (OSError, ValueError):
            return None
        if not isinstance(spec, dict) or not _bert_spec(spec, config, special):
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(text)
        backend.no_truncation()
        backend.no_padding()
        limit = config.get("model_max_length", NO_LIMIT)
        return cls(backend, special, int(limit) if isinstance(limit, (int, float)) else NO_LIMIT)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    pad_token_id = property(lambda self: self._id(self.pad_token))
    unk_token_id = property(lambda self: self._id(self.unk_token))
    cls_token_id = property(lambda self: self._id(self.cls_token))
    sep_token_id = property(lambda self: self._id(self.sep_token))
    mask_token_id = property(lambda self: self._id(self.mask_token))
    eos_token_id = property(lambda self: self._id(self.eos_token))

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, padding: bool = False,
                 truncation: bool = False, max_length: int | None = None,
                 pad_to_multiple_of: int | None = None, return_tensors: str | None = None,
                 return_offsets_mapping: bool = False) -> dict:
        """``input_ids`` and ``attention_mask`` (and ``offset_mapping``) as transformers' fast
        tokenizer gives them for a text or a batch (truncation to ``max_length`` or
        ``model_max_length``, padding to the longest text, right side;
        ``return_tensors="pt"`` for torch tensors)."""
        limit = max_length or self.model_max_length
        if truncation and padding and pad_to_multiple_of and limit % pad_to_multiple_of:
            raise ValueError(f"truncation length ({limit}) is not a multiple of pad_to_multiple_of "
                             f"({pad_to_multiple_of}), as transformers also refuses")
        single = isinstance(text, str)
        tok = self._with(limit if truncation else None,
                         pad_to_multiple_of if padding else 0)
        encs = tok.encode_batch([text] if single else list(text), add_special_tokens=add_special_tokens)
        out = {"input_ids": [e.ids for e in encs], "attention_mask": [e.attention_mask for e in encs]}
        if return_offsets_mapping:
            out["offset_mapping"] = [list(e.offsets) for e in encs]
        if return_tensors == "pt":
            import torch

            return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}
        if return_tensors is not None:
            raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' or None")
        return {k: v[0] for k, v in out.items()} if single else out

    def _with(self, truncate_to: int | None, pad_multiple: int | None):
        """A copy of the backend set to truncate and pad so (0: no padding), made once per
        setting: a call never changes the backend, which the chunkers copy as it is."""
        key = (truncate_to, pad_multiple, self.pad_token)
        tok = self._configured.get(key)
        if tok is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_str(self.backend_tokenizer.to_str())
            if truncate_to is not None:
                tok.enable_truncation(truncate_to)
            if pad_multiple != 0:
                tok.enable_padding(pad_id=self.pad_token_id, pad_token=self.pad_token,
                                   pad_to_multiple_of=pad_multiple)
            self._configured[key] = tok
        return tok
