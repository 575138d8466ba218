"""Prompts: the text a model wants before each query or document ("query: ", "passage: ").

Models such as e5, bge, gte or nomic are trained with them, declared in the folder's
``config_sentence_transformers.json`` (``prompts``, ``default_prompt_name``), and search
worse without them. sentence-transformers puts the prompt before the text and tokenizes
both; here queries are encoded the same way (``TextEncoder.encode(..., prompt=...)``),
and chunks, which are token windows cut before the encoder sees them, get the prompt's
tokens right after their leading special tokens (:class:`PromptedBatches`, in the
DataLoader workers). The chunk's character span and stored text stay those of the
source; the prompt's tokens count against the chunk's token budget.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from ..errors import ConfigError, SettingError

ST_CONFIG_FILE = "config_sentence_transformers.json"
DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")  # sentence-transformers' order


@dataclass(frozen=True)
class Prompts:
    """The prompts a model folder declares, and which one each role gets."""

    named: dict[str, str]
    default_name: str | None = None

    @classmethod
    def read(cls, model_dir: str | Path) -> Prompts:
        """From ``config_sentence_transformers.json`` (no file: no prompts)."""
        path = Path(model_dir) / ST_CONFIG_FILE
        try:
            config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from exc
        named = config.get("prompts") or {}
        default = config.get("default_prompt_name")
        if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
            raise ConfigError(f"{path}: 'prompts' must map prompt names to texts")
        if default is not None and default not in named:
            raise ConfigError(f"{path}: default_prompt_name {default!r} is not one of its prompts "
                              f"({', '.join(map(repr, named)) or 'none'})")
        return cls(dict(named), default)

    def for_role(self, role: str, override: str | None = None) -> str:
        """The prompt of ``role`` ("query" or "document"): ``override`` when given ("" for
        none), else the folder's prompt of that name ("document", "passage" or "corpus"
        for documents), else its default prompt, else ""."""
        if override is not None:
            return override
        names = ("query",) if role == "query" else DOCUMENT_PROMPT_NAMES
        for name in names:
            if name in self.named:
                return self.named[name]
        return self.named.get(self.default_name, "") if self.default_name else ""

    def resolve(self, document: str | None = None, query: str | None = None) -> dict[str, str]:
        """``{"document": ..., "query": ...}`` with the overrides given (what a manifest records)."""
        return {"document": self.for_role("document", document), "query": self.for_role("query", query)}


def _shown(prompt: str) -> str:
    """A prompt as a message names it: its first 60 characters."""
    return prompt if len(prompt) <= 60 else prompt[:60] + "..."


def refuse_filling_query_prompt(tokenizer, limit: int, prompt: str) -> None:
    """ConfigError for a query prompt that takes every one of the ``limit`` tokens the
    model reads: each query is cut off whole after it, so every query gets the prompt's
    vector and the same hits. build-index checks it before recording it, search before
    using it."""
    if not prompt:
        return
    used = len(tokenizer([prompt])["input_ids"][0])  # with the model's own tokens ([CLS], [SEP])
    if used >= limit:
        raise ConfigError(f"the query prompt {_shown(prompt)!r} is {used} tokens long (with the model's own), and the "
                          f"model reads {limit}: no word of a query would be read, and every query would get "
                          "the same hits; give a shorter prompt (--query-prompt, query_prompt=)")


@dataclass(frozen=True)
class ChunkPrompt:
    """How chunks carry a prompt: its token ids, inserted after ``after`` leading special
    tokens; the chunker then cuts windows of ``max_tokens`` (the budget less the prompt)."""

    ids: tuple[int, ...]
    after: int
    max_tokens: int


def refuse_unfit_chunks(tokenizer, tokens: int, overlap: int, prompt: str, limit: int) -> None:
    """ConfigError naming a change that works unless a chunk of ``tokens`` tokens holds the
    model's special tokens, the document ``prompt``'s, the ``overlap`` it shares with the
    one before and a token of new text. build-index checks it before it writes anything:
    the chunker refused it only in a loader worker, after the index folder was made and
    its manifest recorded the chunking. ``limit`` is what the model reads, so a larger
    chunk is advised only where one fits."""
    from .chunker import special_token_count

    special = special_token_count(tokenizer)
    used = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else 0
    least = special + used + overlap + 1
    if tokens >= least:
        return
    shared = f" and the {overlap} it shares with the one before (--overlap)" if overlap else ""
    if not used:
        fix = (f"give --chunk-tokens {least} or more" if least <= limit else
               f"give --overlap {tokens - special - 1} or less (the model reads at most {limit} tokens)")
        raise SettingError(f"--chunk-tokens {tokens} leaves no token of a chunk for text: each chunk holds "
                          f"the {special} special tokens the model adds{shared}; {fix}")
    room = limit - special - overlap - 1  # the longest prompt a chunk of the model's length holds
    if least <= limit:
        fix = f"raise --chunk-tokens to {least} or more, or shorten the prompt (--doc-prompt)"
    elif room >= 1:
        fix = (f"shorten the prompt (--doc-prompt) to at most {room} tokens{' or lower --overlap' if overlap else ''}: "
               f"the model reads at most {limit} tokens, so no --chunk-tokens makes room for it")
    else:
        fix = (f"lower --overlap and shorten the prompt (--doc-prompt): the model reads at most {limit} "
               "tokens, so no --chunk-tokens makes room for it")
    raise SettingError(f"the document prompt {_shown(prompt)!r} takes {used} of the {tokens} tokens of a chunk, "
                      f"leaving no token for new text (a chunk also holds the {special} special tokens the model "
                      f"adds{shared}); {fix}")


def chunk_prompt(tokenizer, prompt: str, chunk_tokens: int, overlap: int) -> ChunkPrompt:
    """The :class:`ChunkPrompt` of ``prompt`` for chunks of ``chunk_tokens`` tokens."""
    from .chunker import Chunker

    ids = tuple(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if prompt else ()
    if not ids:
        return ChunkPrompt((), 0, chunk_tokens)
    # The chunker itself needs room for its special tokens and the overlap.
    refuse_unfit_chunks(tokenizer, chunk_tokens, overlap, prompt, chunk_tokens)
    prefix = Chunker(tokenizer, chunk_tokens, 0).prefix
    return ChunkPrompt(ids, len(prefix), chunk_tokens - len(ids))


class PromptedBatches(IterableDataset):
    """The batches of ``batches`` (items as :class:`~embedingest.sources.text_dataset.
    TextChunkDataset` yields them) with the prompt's tokens in every row of
    ``input_ids``/``attention_mask``; runs where the dataset runs (the DataLoader
    workers). Rows are right-padded and all start with the same special tokens, so the
    prompt goes at the same column in each."""

    def __init__(self, batches: IterableDataset, prompt: ChunkPrompt):
        self.batches = batches
        self.prompt = prompt

    def __iter__(self) -> Iterator[dict]:
        ids = torch.tensor(self.prompt.ids, dtype=torch.long)
        at = self.prompt.after
        for item in self.batches:
            rows = item["input_ids"].shape[0]
            if rows:
                tokens, mask = item["input_ids"], item["attention_mask"]
                item["input_ids"] = torch.cat([tokens[:, :at], ids.expand(rows, -1).to(tokens.dtype),
                                               tokens[:, at:]], dim=1)
                item["attention_mask"] = torch.cat([mask[:, :at], torch.ones(rows, len(ids), dtype=mask.dtype),
                                                    mask[:, at:]], dim=1)
            yield item


def with_prompt(batches: IterableDataset, prompt: ChunkPrompt) -> IterableDataset:
    """``batches`` as they are without a prompt, else wrapped in :class:`PromptedBatches`."""
    return PromptedBatches(batches, prompt) if prompt.ids else batches
