"""The tokenizer of a model folder, exactly as the encoder tokenizes: the one loader,
used by :class:`~embedingest.stages.encoder.TextEncoder` and by the DataLoader workers
that chunk and tokenize for it.

Lower-casing follows sentence-transformers: ``do_lower_case`` in the folder's
``sentence_bert_config.json`` makes the tokenizer lower-case its input (its own
normaliser may do so as well, as BERT-uncased's does); without that file nothing is
added to what the tokenizer does.

A BERT WordPiece folder whose tokenizer.json is exactly what transformers builds from its
tokenizer_config.json is opened with ``tokenizers`` alone (:mod:`.light_tokenizer`):
importing transformers costs seconds that the first batch would wait for. Every other
folder goes through ``AutoTokenizer``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .light_tokenizer import LightTokenizer
from .model_folder import read_layout, resolve_model


def load_tokenizer(model: str | Path | None = None) -> Any:
    """The fast (Rust) tokenizer of a model folder, a Hugging Face id in the local cache
    or the bundled model (None), as :class:`TextEncoder` uses it; never downloads.

    Fast, because chunks need its character offsets. A module-level function, so
    DataLoader workers can be handed it by name and load their own copy.
    """
    model_dir, _ = resolve_model(model)
    if (model_dir / "modules.json").is_file():
        layout = read_layout(model_dir)
        path, lowercase = layout.transformer_dir, layout.do_lower_case
    else:  # a plain Hugging Face folder: the tokenizer as it is
        path, lowercase = model_dir, False
    tokenizer = open_tokenizer(path, lowercase)
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"the tokenizer in {str(path)!r} is not a fast tokenizer, so it "
                          f"has no character offsets; add a tokenizer.json to the folder")
    return tokenizer


def open_tokenizer(path: Path, lowercase: bool) -> Any:
    """The tokenizer in ``path`` (local files only), with a pad token, lower-casing its
    input when ``lowercase``."""
    tokenizer = LightTokenizer.open(path)
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"cannot load a tokenizer from {str(path)!r}: {exc}; pass a folder "
                              "that holds tokenizer.json") from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"the tokenizer in {path} has neither a pad nor an eos token "
                              f"to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    if lowercase:
        _lowercase_inputs(tokenizer, path)
    return tokenizer


def _lowercase_inputs(tokenizer: Any, path: Path) -> None:
    """Honour do_lower_case in the tokenizer itself, so whoever tokenizes with it gets it too."""
    from tokenizers import normalizers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"{path}/sentence_bert_config.json sets do_lower_case, which needs a fast "
                          f"(tokenizers) tokenizer; the folder has a {type(tokenizer).__name__}")
    current = backend.normalizer
    backend.normalizer = (normalizers.Sequence([normalizers.Lowercase(), current])
                          if current is not None else normalizers.Lowercase())
