"""Hugging Face model ids, found in the local Hugging Face cache; nothing is downloaded.

The cache is huggingface_hub's own (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
``~/.cache/huggingface/hub``), looked up with its own ``snapshot_download(...,
local_files_only=True)``: the snapshot that ``refs/main`` (or the given revision) names,
exactly the folder ``SentenceTransformer(id)`` would load offline.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError


def is_hub_id(value: str) -> bool:
    """Whether ``value`` is spelled like a Hugging Face repo id ("org/name" or "name")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if value.count("/") > 1 or value.startswith((".", "~")):
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def cache_folder() -> Path:
    """The Hugging Face hub cache this process reads (read at call time)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def find_in_cache(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of model ``repo_id``; ConfigError naming the cache when
    it holds none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError) as exc:
        raise ConfigError(
            f"model {repo_id!r} is not a folder here and not in the Hugging Face cache at "
            f"{str(cache_folder())!r} (embedingest never downloads models): fetch it once with "
            f"`hf download {repo_id}` (or point HF_HOME / HF_HUB_CACHE at the cache that holds "
            f"it), or pass a local model folder") from exc
