"""Which index format a folder holds, and the refusal of the ones this version does not read.

Format 1 kept every chunk's metadata in one ``metadata.sqlite`` and its vectors under
``segments/``; format 2 keeps both in ``shards/`` (:mod:`embedingest.index.shards`).
The manifest names the format; a folder with ``metadata.sqlite`` is format 1 whatever
its manifest says, so an old index is never read as a new one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..errors import ConfigError
from ..sources.files import open_regular
from ..terminal import shell_quote

MANIFEST_NAME = "manifest.json"
V1_METADATA = "metadata.sqlite"
V1_SEGMENTS = "segments"
# The files format 1 kept in segments/: a shard's vectors and its ids.
V1_SEGMENT_FILE = re.compile(r"seg-[A-Za-z0-9_]+-w[0-9]+-[0-9]+\.(?:faiss|ids\.npy)")
CURRENT = 2
# What an index of the current format keeps beside its manifest (store.py, shards.py).
UNITS_NAME = "units.sqlite"
SHARDS_DIR = "shards"
# An index's manifest read to tell it from a dataset's (holds_index) is at most this long:
# its shard list is some 60 bytes a shard, so a quarter of a million shards.
MANIFEST_PEEK_BYTES = 16 << 20


def _holds_v1_segments(folder: Path) -> bool:
    """Whether ``folder`` (``segments/``) holds a format-1 shard: a folder of the user's
    that happens to have the name is no index."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    try:
        with os.scandir(folder) as entries:
            return any(V1_SEGMENT_FILE.fullmatch(e.name) for e in entries)
    except OSError:
        return False


def _holds_index_files(folder: Path) -> bool:
    """Whether ``folder`` holds what an index keeps beside its manifest: ``units.sqlite``
    or a shard's commit record (a folder with only a manifest, or a ``shards/`` of the
    user's, is another program's)."""
    if (folder / UNITS_NAME).is_file():
        return True
    try:
        with os.scandir(folder / SHARDS_DIR) as entries:
            return any(e.name.startswith("shard-") and e.name.endswith(".commit.json") for e in entries)
    except OSError:
        return False


def _refuse_foreign(folder: Path, what: str) -> None:
    """ConfigError when ``folder``'s manifest, which ``what`` says is not an index's, has
    no index files beside it: the folder is another program's, and ``--overwrite`` would
    delete its manifest. With them, it is a damaged index: the caller goes on."""
    if not _holds_index_files(folder):
        raise ConfigError(f"{str(folder / MANIFEST_NAME)!r} {what}, and the folder holds no {UNITS_NAME} "
                          f"or {SHARDS_DIR}/: it is not an embedingest index but another program's "
                          "file; give the index a folder of its own (build-index --out), or move that "
                          "file away")


def _foreign_problem(data) -> str | None:
    """What makes the JSON ``data`` of a manifest.json no index's manifest, or None: an
    index's describes its model and width."""
    if not isinstance(data, dict):
        return "is not a JSON object"
    if not {"model", "dim"} <= data.keys():
        return "has no 'model' and 'dim'"
    if not isinstance(data["model"], dict):
        return "has a 'model' that is no model's description"
    return None


def holds_index(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` (one of a corpus, say) holds an embedingest index: its manifest
    is an index's (:func:`index_format`'s test), or index files are beside one that is not
    (a damaged index). A dataset's own ``manifest.json`` and ``shards/`` are no index. The
    manifest is read as a corpus file is: never through a link, never waiting on a pipe,
    at most :data:`MANIFEST_PEEK_BYTES` (a larger one is judged by the files beside it)."""
    folder = Path(folder)
    try:
        with open_regular(folder / MANIFEST_NAME, follow_links=False) as fh:
            raw = fh.read(MANIFEST_PEEK_BYTES + 1)
    except FileNotFoundError:
        return False
    except OSError:
        return _holds_index_files(folder)
    try:
        data = json.loads(raw.decode("utf-8")) if len(raw) <= MANIFEST_PEEK_BYTES else None
    except (ValueError, RecursionError):
        data = None
    return (data is not None and _foreign_problem(data) is None) or _holds_index_files(folder)


def index_format(folder: str | os.PathLike) -> int | None:
    """The format of the index at ``folder``: 1 or 2 (or what a newer manifest says);
    None when the folder holds no index. A manifest without a format field is format 1
    (the first releases wrote none)."""
    folder = Path(folder)
    if (folder / V1_METADATA).exists() or _holds_v1_segments(folder / V1_SEGMENTS):
        return 1
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # JSON nested past Python's stack: damaged too
        _refuse_foreign(folder, f"is not JSON ({exc})")
        raise ConfigError(f"cannot read {str(path)!r}: {exc}; rebuild the index with --overwrite") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc}; rebuild the index with --overwrite") from exc
    problem = _foreign_problem(data)
    if problem:
        _refuse_foreign(folder, problem)
    value = data.get("format", 1) if isinstance(data, dict) else None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path}: format is {value!r}, not an integer: the "
                          "manifest was changed or damaged; rebuild the index with --overwrite")
    if value < 1:  # else read as format 1, and refused as an index of metadata.sqlite it has not
        raise ConfigError(f"{path}: format is {value!r}, not an index format (1, {CURRENT}, ...): the manifest "
                          f"was changed or damaged; put back {CURRENT}, or rebuild the index with --overwrite")
    return value


def rebuild_command(folder: str | os.PathLike, manifest: dict | None = None,
                    save_embeddings: bool = False, options: Iterable[str] = ()) -> str:
    """The command that rebuilds the index at ``folder`` in the current format, from what
    its manifest says (corpus folder, model, factory, metric), with ``options`` (further
    build-index options, shell-quoted) before ``--overwrite``; each argument quoted so that
    pasted into a shell it names the same bytes (:func:`~embedingest.terminal.shell_quote`)."""
    def text(mapping, key) -> str | None:  # a damaged manifest's fields may be anything
        value = mapping.get(key) if isinstance(mapping, dict) else None
        return value if isinstance(value, str) and value else None

    manifest = manifest or {}
    model = manifest.get("model")
    corpus = text(manifest, "corpus_path")
    parts = ["embedingest", "build-index", shell_quote(corpus) if corpus else "CORPUS",
             "--out", shell_quote(str(folder))]
    name = _model_argument(text(model, "name"), text(model, "path"))
    if name:
        parts += ["--model", shell_quote(name)]
    if text(manifest, "factory"):
        parts += ["--index", shell_quote(manifest["factory"])]
    if text(manifest, "metric") and manifest["metric"] != "ip":
        parts += ["--metric", shell_quote(manifest["metric"])]
    parts += options
    if save_embeddings:
        parts.append("--save-embeddings")
    parts.append("--overwrite")
    return " ".join(parts)


def _model_argument(name: str | None, path: str | None) -> str | None:
    """What ``--model`` of a rebuild gives for the manifest's model ``name`` and ``path``:
    the path (where the model was loaded from), but the name where the name loads the same
    folder (the bundled model), or where the path is not a folder here and the name is a
    model id (as search loads it: the bundled model, a Hugging Face id in the local cache).
    The name of a local folder is only its folder's name (``--model mymodel`` run
    elsewhere: not a folder there), and a hub snapshot's path is the revision it was built
    with, so the path is given for those."""
    if not path:
        return name
    if not name:
        return path
    from ..stages.hub import is_hub_id  # function-local: the model code only for this message
    from ..stages.model_folder import BUNDLED_NAME, resolve_model

    if Path(path).is_dir():
        if name != BUNDLED_NAME:
            return path
        try:
            return name if resolve_model(name)[0] == Path(path).resolve() else path
        except ConfigError:
            return path
    if name == BUNDLED_NAME or (is_hub_id(name) and name != Path(path).name):
        return name
    return path


def _manifest_data(folder: Path) -> dict:
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def require_current(folder: str | os.PathLike) -> None:
    """ConfigError unless ``folder`` holds an index of the current format: a format-1
    index is refused with the exact command that rebuilds it (nothing is read from or
    written to it); a newer one asks for a newer embedingest. A folder with no index
    passes (the caller says what it needs)."""
    folder = Path(folder)
    found = index_format(folder)
    if found is None or found == CURRENT:
        return
    if found > CURRENT:
        raise ConfigError(f"the index at {str(folder)!r} has format {found}, newer than this "
                          f"embedingest reads (format {CURRENT}): upgrade embedingest")
    data = _manifest_data(folder)
    known = isinstance(data.get("corpus_path"), str) and data["corpus_path"]
    where = "" if known else (" (CORPUS: the folder or file it was built from; an index of records "
                              "is rebuilt by build_index(records, out=..., overwrite=True))")
    raise ConfigError(
        f"the index at {str(folder)!r} is in format {found} (chunk metadata in {V1_METADATA}), "
        f"which this embedingest no longer reads. Rebuild it in format {CURRENT} with:\n"
        f"  {rebuild_command(folder, data)}{where}")
