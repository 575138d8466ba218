"""Inputs in object storage: any fsspec URL (``s3://bucket/prefix``, ``gs://...``,
``hf://datasets/owner/name/...``, ``memory://...``) listed and opened for reading.

The rest of the package sees only what this module returns: ``(url, rel, size,
mtime_ns)`` for every object below a prefix, in the order :func:`~.files.walk_files`
gives a local folder (sorted names, a folder's objects before its subfolders, names
starting with '.' passed over), and a binary file object for one URL. So a corpus in a
bucket gets the same unit keys, hence the same vector ids, as the same files on disk.

Credentials and endpoints come only from the usual places of each library: for S3 the
``AWS_*`` environment variables (``AWS_ENDPOINT_URL_S3`` too) and ``~/.aws``; for GCS
``GOOGLE_APPLICATION_CREDENTIALS`` or gcloud's default login; for the Hugging Face hub
``HF_TOKEN`` or the saved login; and fsspec's own ``FSSPEC_<PROTOCOL>_<OPTION>``
variables and config files. Nothing secret passes through this package's options.

A filesystem object is never handed to another process: each process gets its own from
fsspec's per-process cache (forked DataLoader workers included).
"""

from __future__ import annotations

import datetime
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import ConfigError
from .names import has_extension

OnSkip = Callable[[str, str], None]

# "s3://...", "hf://...", and chained forms such as "simplecache::s3://..."; one letter
# before ":" is never a protocol (it would be a Windows drive).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+(://|::)")

# Where each store keeps what an object's time and version are (the first one present).
_TIME_KEYS = ("LastModified", "mtime", "updated", "last_modified", "created")
_VERSION_KEYS = ("ETag", "etag", "generation", "md5Hash", "blob_id", "VersionId")

_CREDENTIALS_HELP = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE with ~/.aws/"
          "credentials; AWS_ENDPOINT_URL_S3 for another S3-compatible server), or "
          "FSSPEC_S3_ANON=true for a public bucket",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or run "
          "gcloud auth application-default login",
    "hf": "set HF_TOKEN, or run hf auth login",
}


@dataclass(frozen=True)
class RemoteFile:
    """One object to read: its URL, its path below the listed prefix ('/'-separated; its
    name when the URL named one object), its size, and a stamp that changes when the
    object does (see :func:`stamp`; None when the store gives neither time nor version)."""

    url: str
    rel: str
    size: int
    mtime_ns: int | None


def is_remote(path) -> bool:
    """Whether ``path`` is a URL for fsspec rather than a local path; ``file://`` URLs
    are local (see :func:`local_path`)."""
    return isinstance(path, str) and bool(_URL.match(path)) and not path.startswith("file://")


def local_path(path):
    """``path`` with a ``file://`` prefix taken off (fsspec's reading of it: the path
    made absolute) and its percent escapes decoded (``Path.as_uri()`` writes a space as
    ``%20``); anything else unchanged. Local files are then read by the local code,
    with its safety checks (no link followed out of a folder, no pipe opened)."""
    if isinstance(path, str) and path.startswith("file://"):
        from urllib.parse import unquote

        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem._strip_protocol("file://" + unquote(path[len("file://"):], errors="surrogateescape"))
    return path


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].split("::")[-1].lower()


def _fs(url: str):
    """(filesystem, path) for ``url``; a URL fsspec cannot serve is a ConfigError."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise ConfigError(f"cannot read {url!r}: {exc} (for example pip install "
                          f"'embedingest[remote]' for s3://)") from exc
    except ValueError as exc:
        raise ConfigError(f"cannot read {url!r}: {exc}; give a local path or an fsspec URL "
                          f"such as s3://bucket/prefix") from exc


def url_fs(url: str):
    """(fsspec filesystem, root path without a trailing slash) of an output URL or prefix."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(url).rstrip("/"))
    return fs, root.rstrip("/")


def access_error(url: str, exc: BaseException) -> ConfigError:
    """The error for a URL that cannot be listed at all: which URL, what was wrong, what
    to do."""
    name = type(exc).__name__
    help_ = _CREDENTIALS_HELP.get(_protocol(url), "check the credentials that fsspec's "
                                                   "backend for this protocol reads")
    if isinstance(exc, FileNotFoundError):
        what = (f"no such bucket, object or prefix ({exc}); check the URL, and that the "
                f"credentials in use can see it")
    elif isinstance(exc, PermissionError):
        what = f"access denied ({exc}): {help_}"
    elif "Credential" in name or "Token" in name:
        what = f"no credentials found ({exc}): {help_}"
    elif "Endpoint" in name or "Connect" in name or isinstance(exc, (ConnectionError, TimeoutError)):
        what = (f"cannot reach the store ({exc}); check the network and the endpoint "
                f"(AWS_ENDPOINT_URL_S3 for an S3-compatible server)")
    else:
        what = f"{name}: {exc}"
    return ConfigError(f"cannot list {url!r}: {what}")


def stamp(info: dict) -> int | None:
    """A number that changes when the object does, to compare with the last run's: its
    time in nanoseconds, whose sub-second part carries a digest of its version (ETag,
    generation) when the store gives one, since stores keep times to the second and an
    object rewritten within one second at one size would look unchanged."""
    when = next((info[k] for k in _TIME_KEYS if info.get(k) is not None), None)
    version = next((info[k] for k in _VERSION_KEYS if info.get(k) is not None), None)
    if when is None and version is None:
        return None
    if isinstance(when, datetime.datetime):
        seconds = int(when.timestamp())
    elif isinstance(when, str):
        try:
            seconds = int(datetime.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp())
        except ValueError:
            seconds = 0
    else:
        seconds = int(float(when or 0))
    extra = 0
    if version is not None:
        digest = hashlib.blake2b(str(version).encode("utf-8", "replace"), digest_size=8).digest()
        extra = int.from_bytes(digest, "big") % 1_000_000_000
    return seconds * 1_000_000_000 + extra


def same_store(a: str, b: str) -> bool:
    """Whether two URLs name objects of one store and bucket (one protocol, one host or
    bucket), so that the times the store gives their objects come from one clock."""
    pa, pb = (urlsplit(url.split("::")[-1]) for url in (a, b))
    return pa.scheme.lower() == pb.scheme.lower() and pa.netloc == pb.netloc


def check_remote(url: str) -> dict:
    """What the store says of ``url`` (fsspec's ``info``: its ``type``, ``size``, ...),
    read afresh; a URL that cannot be read at all is a :class:`ConfigError` naming it and
    what to do (see :func:`access_error`). Jobs call it before they write anything."""
    fs, root = _fs(url)
    root = root.rstrip("/")
    try:
        fs.invalidate_cache(root)
        return fs.info(root)
    except Exception as exc:  # whatever the backend raises: it says what was wrong
        raise access_error(url, exc) from exc


def input_name(url: str) -> str:
    """The last part of a URL's path (``s3://b/docs/`` -> ``docs``), to name outputs."""
    return url.rstrip("/").rsplit("/", 1)[-1].split("::")[-1]


def walk_remote(url: str, extensions: set[str] | frozenset[str] | None = None,
                on_skip: OnSkip = lambda path, reason: None,
                on_other: Callable[[str], None] | None = None) -> Iterator[RemoteFile]:
    """The objects below ``url`` whose names end in one of ``extensions`` (see
    :func:`~.names.has_extension`; all when None), or the one object ``url`` names
    (whatever its name); others go to ``on_other(url)``, hidden ones too (a name starting
    with ".", a folder not entered), as :func:`~.files.walk_paths` tells them.

    A URL that cannot be listed at all (no such bucket, no credentials, no network) is a
    :class:`ConfigError` saying what to do; a folder below it that cannot be listed goes
    to ``on_skip`` and the walk goes on. Listings are read afresh, not from fsspec's cache.
    """
    fs, root = _fs(url)
    root = root.rstrip("/")
    base_url = url.rstrip("/")
    info = check_remote(url)
    if info.get("type") != "directory":
        yield RemoteFile(url, root.rsplit("/", 1)[-1], int(info.get("size") or 0), stamp(info))
        return
    stack = [(root, "")]
    while stack:
        folder, rel_folder = stack.pop()
        try:
            entries = fs.ls(folder, detail=True)
        except Exception as exc:
            if folder == root:
                raise access_error(url, exc) from exc
            on_skip(_url_of(base_url, rel_folder), f"cannot list folder: {type(exc).__name__}: {exc}")
            continue
        files, subdirs = {}, {}
        for entry in entries:
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            if not name or entry["name"].rstrip("/") == folder:
                continue
            (subdirs if entry.get("type") == "directory" and not name.startswith(".") else files)[name] = entry
        for name in sorted(files):
            rel = f"{rel_folder}{name}"
            entry = files[name]
            if name.startswith("."):  # hidden, as on disk: told, a folder not entered
                if on_other is not None:
                    on_other(_url_of(base_url, rel))
            elif extensions is None or has_extension(name, set(extensions)):
                yield RemoteFile(_url_of(base_url, rel), rel, int(entry.get("size") or 0), stamp(entry))
            elif on_other is not None:
                on_other(_url_of(base_url, rel))
        for name in sorted(subdirs, reverse=True):
            stack.append((subdirs[name]["name"].rstrip("/"), f"{rel_folder}{name}/"))


def _url_of(base_url: str, rel: str) -> str:
    return f"{base_url}/{rel}" if rel else base_url


class RemoteError(OSError):
    """An object that could not be opened for a reason the client library raises as its
    own exception (no credentials, no connection): an ``OSError``, so a reader skips
    that object and reports it as it does an unreadable local file."""


def open_remote(url: str):
    """The object at ``url`` open for binary reading (``read``, ``seek``; ``size`` is
    its length). Every failure to open it is an ``OSError`` (``FileNotFoundError``,
    ``PermissionError``, :class:`RemoteError`, ...)."""
    fs, path = _fs(url)
    try:
        return fs.open(path, "rb")
    except OSError:
        raise
    except Exception as exc:
        raise RemoteError(f"{type(exc).__name__}: {exc}") from exc


def remote_size(fh) -> int:
    """The length of a file :func:`open_remote` opened."""
    return int(fh.size)
