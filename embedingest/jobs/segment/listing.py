"""segment's listing: which images a run still has to do (resume), and the temporary
files a killed run left behind."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
from collections.abc import Iterable, Iterator
from pathlib import Path

from ...config import SegmentConfig
from ...outfiles import is_tmp_name, through_link, too_long
from ...index.lock import RUN_LOCK
from ...report import REPORT_NAME, SkipReport
from ...sinks.mask_stats import STATS_DIR, row_counts
from ...sinks.masks import LABELS_FILE, LOGITS_SUFFIX, MASK_SUFFIX, OVERLAY_SUFFIX
from ...sources.files import walk_files
from ...sources.names import has_extension, name_as_text
from ...sources.remote import is_remote, same_store, stamp, url_fs, walk_remote
from ...sources.image_decode import IMAGE_EXTENSIONS
from ...terminal import counted
from .overwrite_mark import OVERWRITING

log = logging.getLogger("embedingest")


def list_inputs(config: SegmentConfig, report: SkipReport) -> tuple[list[tuple[str, str]], int]:
    """The (rel_path, path) pairs still to do, and how many were already done.

    Whether an image is done comes from one listing of each output folder rather than a
    stat of each output: at ~100k images the per-image paths and stats took seconds of
    every run's start-up (and a scaled-out run's parent does this alone)."""
    out = Path(config.out)
    suffixes = ([MASK_SUFFIX] + [LOGITS_SUFFIX] * config.save_logits
                + [OVERLAY_SUFFIX] * config.overlay)
    present = _RemoteNames(config.out) if is_remote(config.out) else _FolderNames(str(out))
    with_row = ({source for source, n in row_counts(out).items() if n == 1}
                if config.stats and not config.overwrite else set())
    local = not is_remote(config.out)
    # a done image whose photograph changed since is redone, where both times come from
    # one clock: files on disk (their status-change time), or photographs and masks in one
    # bucket (the store's times of both objects); not across the two
    stamps = local and not is_remote(config.images)
    store_times = not local and is_remote(config.images) and same_store(config.images, config.out)
    todo, done, changed = [], 0, 0
    images = list(_images(config.images, report, out, config.follow_outside_links))
    folders = _output_folders(rel for rel, _, _ in images)
    input_below = None if is_remote(config.out) else input_under_out(config.images, out)
    for rel, full, stamped in images:
        reason = (name_taken(rel, folders) or output_in_input(rel, input_below, config.images) or
                  local and next(filter(None, (too_long(os.path.join(out, rel + s)) for s in suffixes)), None))
        if reason:  # its outputs could not be written: reported, the others go on
            report.add(full, reason, stage="write")
            continue
        folder, name = posixpath.split(rel)
        taken = [name + s for s in suffixes if present.is_folder(folder, name + s)]
        if taken:
            report.add(full, f"name taken: the output {posixpath.join(folder, taken[0])!r} is a folder; "
                             "move or rename it", stage="write")
            continue
        if (not config.overwrite and all(present.has(folder, name + s) for s in suffixes)
                and (not config.stats or name_as_text(rel) in with_row)):
            if (stamps and changed_since_mask(full, os.path.join(out, rel + MASK_SUFFIX))
                    or store_times and present.changed_since(folder, name + MASK_SUFFIX, stamped)):
                changed += 1
                todo.append((rel, full))
            else:
                done += 1
        else:
            todo.append((rel, full))
    if changed:
        log.info("%s changed since %s written: redone", counted(changed, "image"),
                 "its mask was" if changed == 1 else "their masks were")
    return todo, done


def changed_since_mask(image: str, mask: str) -> bool:
    """Whether the file at ``image`` changed after its ``mask`` was written. Its status-change
    time is compared, not its modification time: a photograph replaced or rewritten has a
    later one even where the copy kept an older modification time (``cp -p``, ``rsync -a``),
    which no tool can set back. A status change alone (``chmod``, a rename) redoes it once."""
    try:
        return os.stat(image).st_ctime_ns > os.stat(mask, follow_symlinks=False).st_mtime_ns
    except OSError:  # gone or unreadable: the run reports it where it reads it
        return False


# The job's own names at the top of the output folder: an input folder of one of these
# names would put masks where the job's own file goes (or, for stats, into the folder
# read as one table of rows).
RESERVED = {LABELS_FILE: "labels.json", REPORT_NAME: "skip report", STATS_DIR: "--stats table folder",
            RUN_LOCK: "run lock"}
ALL_SUFFIXES = (MASK_SUFFIX, LOGITS_SUFFIX, OVERLAY_SUFFIX)


def _output_folders(rels: Iterable[str]) -> dict[str, str]:
    """Every folder the outputs of ``rels`` go in (below the output folder), each with
    the first image whose outputs go there."""
    folders: dict[str, str] = {}
    for rel in rels:
        folder = posixpath.dirname(rel)
        while folder and folder not in folders:
            folders[folder] = rel
            folder = posixpath.dirname(folder)
    return folders


def name_taken(rel: str, folders: dict[str, str]) -> str | None:
    """Why the image at ``rel`` cannot have its outputs' names (a skip reason), or None:
    its top folder is one of the job's own names, or an output's name (with any of the
    suffixes, asked for or not) is a folder other images' outputs go in (``folders``,
    from :func:`_output_folders`). Both images could not be written, and every run failed."""
    top, _, rest = rel.partition("/")
    if rest and top in RESERVED:
        return (f"name taken: its outputs would go in the folder {top!r} of the output, the name of "
                f"segment's own {RESERVED[top]}; rename or move the input folder {top!r}")
    for suffix in ALL_SUFFIXES:
        other = folders.get(rel + suffix)
        if other is not None:
            return (f"name taken: its output {rel + suffix!r} would be the folder that the outputs of "
                    f"{other!r} go in; rename one of them")
    return None


def input_under_out(images: str, out: Path) -> str | None:
    """The input folder's path below the output folder ('/'-separated), where ``out`` holds
    it (``--out photos/..``), else None."""
    if is_remote(images) or not os.path.isdir(images):
        return None
    inner, outer = os.path.realpath(images), os.path.realpath(out)
    if os.path.commonpath([inner, outer]) != outer or inner == outer:
        return None
    return os.path.relpath(inner, outer).replace(os.sep, "/")


def output_in_input(rel: str, input_below: str | None, images: str) -> str | None:
    """Why the image at ``rel`` cannot have its outputs (a skip reason), or None: with the
    input folder at ``input_below`` in the output folder, an output would be written into
    the input (``photos/photos/b.jpg`` with ``--out photos/..`` gives ``photos/b.jpg.png``),
    where the next run reads it as a photograph."""
    if input_below is None:
        return None
    for suffix in ALL_SUFFIXES:
        output = rel + suffix
        if output == input_below or output.startswith(input_below + "/"):
            return (f"name taken: its output {output!r} would be inside the input folder {images!r} (the "
                    "output folder holds it), where the next run would read it as an image; give an --out "
                    "outside the input folder")
    return None


def _output_name(name: str) -> bool:
    """Whether ``name`` is named as an image's output is: the image's own name (with its
    extension) and an output's suffix (``beach.jpg.png``, ``a.png.logits.npy``)."""
    return any(name.endswith(suffix) and has_extension(name[:-len(suffix)], IMAGE_EXTENSIONS)
               for suffix in ALL_SUFFIXES)


# The most names first_output_file looks at: a first run into a large folder that is no
# earlier run's output (a home folder) is not held up by a walk of all of it.
OUTPUT_SEARCH_NAMES = 100_000


def first_output_file(out: Path, images: str, most: int = OUTPUT_SEARCH_NAMES) -> str | None:
    """The path (below ``out``) of the first file found there named as an image's output
    is (a mask, logits, an overlay), or None; links are neither outputs nor followed, nor the statistics
    folder or an input folder inside ``out`` walked, and the walk ends after ``most``
    names. For a folder without labels.json: whatever made such files, no run can say
    which model it was."""
    skip = {os.path.realpath(out / STATS_DIR)}
    if not is_remote(images):
        skip.add(os.path.realpath(images))
    seen = 0
    for folder, folders, files in os.walk(out):
        seen += len(folders) + len(files)
        if seen > most:
            return None
        folders[:] = [f for f in folders if os.path.realpath(os.path.join(folder, f)) not in skip]
        found = next((f for f in files if _output_name(f) and not os.path.islink(os.path.join(folder, f))), None)
        if found is not None:
            return os.path.relpath(os.path.join(folder, found), out).replace(os.sep, "/")
    return None


# What segment's labels.json holds, and a dataset's own labels.json hardly all of
_LABELS_KEYS = {"arch", "categories", "palette", "preprocessing", "masks"}


def masks_folder_reason(folder: str) -> str | None:
    """Why a folder of the input is not read: it is segment's output of another run (its
    labels.json says so), whose masks would be segmented as photographs."""
    path = os.path.join(folder, LABELS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            labels = json.loads(fh.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return None  # not ours to judge: its images are read
    if isinstance(labels, dict) and _LABELS_KEYS <= labels.keys():
        return ("masks: the output of another segment run (its labels.json), not photographs; "
                "move it out of the input folder")
    return None


def _images(images: str, report: SkipReport, out: Path,
            outside_links: bool = False) -> Iterator[tuple[str, str, int | None]]:
    """``(rel_path, path, seconds)`` of every image under ``images``: a folder, a file, or
    a URL (an object, or a prefix listed as a folder is walked); ``seconds``: the store's
    time of an object (None for a file on disk, or where the store gives none)."""
    if is_remote(images):
        for obj in walk_remote(images, set(IMAGE_EXTENSIONS), on_skip=report.add,
                               on_other=report.pass_over):
            yield obj.rel, obj.url, _seconds(obj.mtime_ns)
        return
    root = Path(images)
    single = root.is_file()
    prefix = "" if str(root) == "." else os.path.join(str(root), "")  # walk_files' paths start so
    # An output folder inside the input is not listed: masks are PNGs and would be
    # segmented on the next run.
    for path in walk_files(root, set(IMAGE_EXTENSIONS), on_skip=report.add,
                           on_other=report.pass_over, exclude=out, outside_links=outside_links,
                           not_input=masks_folder_reason):
        full = str(path)
        if single:
            rel = path.name
        elif full.startswith(prefix):
            rel = full[len(prefix):].replace(os.sep, "/")
        else:
            rel = path.relative_to(root).as_posix()
        yield rel, full, None


def _seconds(stamp_ns: int | None) -> int | None:
    """The whole seconds of a :func:`~embedingest.sources.remote.stamp` (its sub-second
    part carries a digest of the object's version, not a time)."""
    return None if stamp_ns is None else stamp_ns // 1_000_000_000


class _FolderNames:
    """The names in the folders under ``out``, each folder listed once, when first asked."""

    def __init__(self, out: str):
        self.out = out
        self.names: dict[str, frozenset[str]] = {}
        self.folders: dict[str, frozenset[str]] = {}

    def _list(self, folder: str) -> None:
        """Its files and its folders, once (links are neither: a link is no mask, its
        image is redone and the link replaced, not followed)."""
        files, folders = [], []
        with contextlib.suppress(OSError):  # not made yet, or not a folder: nothing in it is done
            with os.scandir(os.path.join(self.out, folder)) as entries:
                for e in entries:
                    if e.is_file(follow_symlinks=False):
                        files.append(e.name)
                    elif e.is_dir(follow_symlinks=False):
                        folders.append(e.name)
        self.names[folder], self.folders[folder] = frozenset(files), frozenset(folders)

    def has(self, folder: str, name: str) -> bool:
        """Whether ``folder`` holds a file ``name`` (a folder of that name is no mask)."""
        if folder not in self.names:
            self._list(folder)
        return name in self.names[folder]

    def is_folder(self, folder: str, name: str) -> bool:
        """Whether ``name`` in ``folder`` is a folder (an output cannot replace it)."""
        if folder not in self.folders:
            self._list(folder)
        return name in self.folders[folder]


class _RemoteNames(_FolderNames):
    """The same, for an output URL: each prefix listed once (an object is whole or absent),
    with the store's time of each object."""

    def __init__(self, out: str):
        super().__init__(out)
        self.times: dict[str, dict[str, int | None]] = {}  # each object's store time, in seconds

    def _list(self, folder: str) -> None:
        fs, root = url_fs(posixpath.join(self.out.rstrip("/"), folder))
        try:
            times = {e["name"].rstrip("/").rsplit("/", 1)[-1]: _seconds(stamp(e))
                     for e in fs.ls(root, detail=True, refresh=True) if e.get("type") == "file"}
        except FileNotFoundError:  # nothing written there yet
            times = {}
        self.names[folder], self.times[folder] = frozenset(times), times

    def changed_since(self, folder: str, name: str, seconds: int | None) -> bool:
        """Whether an object whose store time is ``seconds`` was written after the object
        ``name`` (its mask) was: a later whole second. An object replaced within the second
        its mask was written in looks unchanged; the store keeps times to the second."""
        if folder not in self.times:
            self._list(folder)
        written = self.times[folder].get(name)
        return seconds is not None and written is not None and seconds > written

    def is_folder(self, folder: str, name: str) -> bool:
        return False  # object storage has no folders an object could not replace


def _written_here(name: str) -> bool:
    """Whether a run writes files named ``name`` (masks, overlays, logits, labels.json, the
    skip report, stats parts, the overwrite mark), so its temporary file is one to delete."""
    return name.endswith((MASK_SUFFIX, OVERLAY_SUFFIX, LOGITS_SUFFIX, ".parquet")) or name in (
        LABELS_FILE, REPORT_NAME, OVERWRITING)


def remove_stale_tmp_files(out: Path, todo: list[tuple[str, str]]) -> None:
    """Delete the temporary files (``.<name>.tmp-<pid>``, see ``atomic_write_bytes``) that a
    killed run left half-written in ``out`` and in the folders of the images still to do
    (an image whose write was cut is one of those: its mask, written last, is missing), and
    in the statistics folder."""
    subs = {"", STATS_DIR} | {posixpath.dirname(rel) for rel, _ in todo}
    for folder in {os.path.join(out, sub) for sub in subs}:
        if through_link(out, folder):  # never delete through a link: it may lead out of ``out``
            continue
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if is_tmp_name(entry.name, of=_written_here) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

