import os
import time

import pytest

from embedingest.sources.files import (NotRegularFile, OutsideInput, input_folder, open_regular,
                                      os_error_reason, reads_within, walk_files)
from fault_helpers import unblock_later


def walk(root, extensions=None, outside_links=False):
    skipped = []
    found = list(walk_files(root, extensions, on_skip=lambda p, r: skipped.append((os.path.basename(p), r)),
                            outside_links=outside_links))
    return [p.relative_to(root).as_posix() for p in found], skipped


def test_sorted_hidden_passed_over_suffix_filtered(tmp_path):
    for rel in ("b.txt", "a.TXT", "c.bin", ".hidden.txt", "sub/d.txt", ".git/e.txt", "f.jsonl.GZ"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert walk(tmp_path, {".txt", ".jsonl.gz"}) == (["a.TXT", "b.txt", "f.jsonl.GZ", "sub/d.txt"], [])
    other = []
    list(walk_files(tmp_path, {".txt"}, on_other=other.append))
    # hidden entries are told too (a folder once, not entered): they were dropped unsaid
    assert [os.path.basename(p) for p in other] == [".git", ".hidden.txt", "c.bin", "f.jsonl.GZ"]


def test_links_loops_and_special_files_are_reported(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ok.txt").write_text("x")
    (tmp_path / "sub" / "loop").symlink_to(tmp_path / "sub")
    (tmp_path / "dead.txt").symlink_to(tmp_path / "nowhere.txt")
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes here")
    os.mkfifo(tmp_path / "pipe.txt")
    os.mkfifo(tmp_path / "pipe.other")
    found, skipped = walk(tmp_path, {".txt"})
    assert found == ["sub/ok.txt"]
    assert sorted(skipped) == [("dead.txt", "broken or looping symbolic link"),
                               ("loop", "symlink loop: a link to a folder that holds it"),
                               ("pipe.txt", "not a regular file: a named pipe (FIFO)")]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_links_to_pipes_and_devices_say_so(tmp_path):
    """Once reported as "broken or looping symbolic link"."""
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "to-pipe.txt").symlink_to(tmp_path / "pipe")
    (tmp_path / "to-zero.txt").symlink_to("/dev/zero")
    (tmp_path / "to-zero.other").symlink_to("/dev/zero")  # another suffix: not an input
    (tmp_path / "to-self.txt").symlink_to(tmp_path / "to-self.txt")
    (tmp_path / "to-file.txt").symlink_to(tmp_path / "pipe.txt.real")
    (tmp_path / "pipe.txt.real").write_text("x")
    found, skipped = walk(tmp_path, {".txt"}, outside_links=True)
    assert found == ["to-file.txt"]
    assert sorted(skipped) == [
        ("to-pipe.txt", "not a regular file: a symbolic link to a named pipe (FIFO)"),
        ("to-self.txt", "cannot stat: Too many levels of symbolic links"),
        ("to-zero.txt", "not a regular file: a symbolic link to a character device")]
    # by default a link out of the folder is not followed at all
    assert sorted(walk(tmp_path, {".txt"})[1])[-1] == (
        "to-zero.txt", "symbolic link out of the input folder: to /dev/zero, not read "
                       "(--follow-outside-links reads it)")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_links_out_of_the_folder_are_reported_not_followed(tmp_path):
    """A link planted in a corpus must not pull other files of the machine (/etc/passwd,
    a key) into an index that is then searched or served: links to files or folders
    outside the input folder are skipped and reported, links within it followed;
    ``outside_links`` follows them all."""
    corpus, outside = tmp_path / "corpus", tmp_path / "outside"
    (corpus / "sub").mkdir(parents=True)
    (outside / "deep").mkdir(parents=True)
    (corpus / "own.txt").write_text("x")
    (corpus / "sub" / "inner.txt").write_text("x")
    (outside / "secret.txt").write_text("x")
    (outside / "deep" / "more.txt").write_text("x")
    (corpus / "to-secret.txt").symlink_to(outside / "secret.txt")
    (corpus / "sub" / "relative.txt").symlink_to("../../outside/secret.txt")
    (corpus / "to-outside").symlink_to(outside)
    (corpus / "to-outside.bin").symlink_to(outside / "secret.txt")  # not an input anyway
    (corpus / "to-inner.txt").symlink_to(corpus / "sub" / "inner.txt")
    (corpus / "to-sub").symlink_to("sub")
    found, skipped = walk(corpus, {".txt"})
    assert found == ["own.txt", "to-inner.txt", "sub/inner.txt"]
    real = os.path.realpath(outside)
    # another path to a folder read already: no loop (the reason once said so)
    # its key in skipped_by_reason is "already read", not one per path
    twice = (f"already read: a symbolic link to a folder read before, as "
             f"{os.path.realpath(corpus / 'sub')!r}; read once")
    out_of = "symbolic link out of the input folder: to {}, not read (--follow-outside-links reads it)"
    expected = sorted([("relative.txt", out_of.format(f"{real}/secret.txt")),
                       ("to-outside", out_of.format(real)),
                       ("to-secret.txt", out_of.format(f"{real}/secret.txt")),
                       ("to-sub", twice)])
    assert sorted(skipped) == expected
    # a root given through a link is judged by where it really is
    (tmp_path / "corpus-link").symlink_to(corpus)
    assert walk(tmp_path / "corpus-link", {".txt"}) == (found, skipped)
    found, skipped = walk(corpus, {".txt"}, outside_links=True)
    assert found == ["own.txt", "to-inner.txt", "to-secret.txt", "sub/inner.txt", "sub/relative.txt",
                     "to-outside/secret.txt", "to-outside/deep/more.txt"]
    assert skipped == [("to-sub", twice)]


def test_open_regular_never_blocks(tmp_path):
    fifo = tmp_path / "a.txt"
    os.mkfifo(fifo)
    unblock_later(fifo)
    start = time.monotonic()
    with pytest.raises(NotRegularFile) as err:
        open_regular(fifo)
    assert time.monotonic() - start < 5
    assert str(err.value) == "not a regular file: a named pipe (FIFO)"
    with pytest.raises(NotRegularFile, match="a character device"):
        open_regular("/dev/zero")
    with pytest.raises(IsADirectoryError):
        open_regular(tmp_path)
    (tmp_path / "f").write_bytes(b"data")
    with open_regular(tmp_path / "f") as fh:
        assert fh.read() == b"data" and os.get_blocking(fh.fileno())


def test_open_regular_of_an_output_file_reads_no_link(tmp_path):
    """``follow_links=False`` (a file of an output folder): a link is refused naming what
    it is, to a file or a pipe alike; a regular file reads as usual."""
    (tmp_path / "f").write_bytes(b"data")
    os.mkfifo(tmp_path / "fifo")
    for target in ("f", "fifo"):
        (tmp_path / f"to-{target}").symlink_to(tmp_path / target)
        with pytest.raises(NotRegularFile) as err:
            open_regular(tmp_path / f"to-{target}", follow_links=False)
        assert str(err.value) == "not a regular file: a symbolic link"
    with pytest.raises(NotRegularFile, match="a named pipe"):
        open_regular(tmp_path / "fifo", follow_links=False)
    with open_regular(tmp_path / "f", follow_links=False) as fh:
        assert fh.read() == b"data"


def test_a_file_root_is_yielded_whatever_its_suffix(tmp_path):
    (tmp_path / "one.weird").write_text("x")
    assert list(walk_files(tmp_path / "one.weird", {".txt"})) == [tmp_path / "one.weird"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(walk_files(tmp_path / "missing", {".txt"}))


def test_an_excluded_folder_is_not_entered_by_any_path(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text("{}")
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "link").symlink_to(tmp_path / "out")
    found = list(walk_files(tmp_path, {".json"}, exclude=tmp_path / "out"))
    assert [p.name for p in found] == ["a.json"]
    assert len(list(walk_files(tmp_path, {".json"}, exclude=tmp_path / "not-made-yet"))) == 2


def swapped_corpus(tmp_path):
    """A corpus whose files were listed, then one file swapped for a link to a file
    outside and one folder for a link to a folder outside (as a writer racing the run
    would); the outside files' real paths."""
    corpus, outside = tmp_path / "corpus", tmp_path / "outside"
    (corpus / "sub").mkdir(parents=True)
    (outside / "dir").mkdir(parents=True)
    for path in (corpus / "a.txt", corpus / "sub" / "b.txt", corpus / "own.txt",
                 outside / "secret.txt", outside / "dir" / "b.txt"):
        path.write_text(path.name)
    listed = [str(p) for p in walk_files(corpus, {".txt"})]
    (corpus / "a.txt").unlink()
    (corpus / "a.txt").symlink_to(outside / "secret.txt")
    (corpus / "sub" / "b.txt").unlink()
    (corpus / "sub").rmdir()
    (corpus / "sub").symlink_to(outside / "dir")
    return corpus, listed, os.path.realpath(outside)


def test_a_listed_file_swapped_for_a_link_out_of_the_folder_is_refused_when_opened(tmp_path):
    """The walk skips links out of the input folder, but a file it listed may be swapped
    for one (the file itself, or a folder above it) before a worker reads it: inside
    ``reads_within`` what was opened is judged, and refused with the walk's own reason."""
    corpus, listed, real = swapped_corpus(tmp_path)
    within = input_folder(corpus)
    assert within == os.path.realpath(corpus)
    opened, refused = {}, {}
    with reads_within(within):
        for path in listed:
            try:
                with open_regular(path) as fh:
                    opened[os.path.relpath(path, corpus)] = fh.read()
            except OSError as exc:
                refused[os.path.relpath(path, corpus)] = os_error_reason(exc)
                assert isinstance(exc, OutsideInput)
    assert opened == {"own.txt": b"own.txt"}
    out_of = "symbolic link out of the input folder: to {}, not read (--follow-outside-links reads it)"
    assert refused == {"a.txt": out_of.format(f"{real}/secret.txt"),
                       os.path.join("sub", "b.txt"): out_of.format(f"{real}/dir/b.txt")}
    # outside the block, or with --follow-outside-links (no folder), they are read
    with open_regular(corpus / "a.txt") as fh:
        assert fh.read() == b"secret.txt"
    with reads_within(input_folder(corpus, outside_links=True)), open_regular(corpus / "a.txt") as fh:
        assert fh.read() == b"secret.txt"


def test_links_within_the_folder_and_a_root_reached_through_a_link_are_read(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "real.txt").write_text("r")
    (corpus / "alias.txt").symlink_to("real.txt")
    (tmp_path / "via").symlink_to(corpus)
    with reads_within(input_folder(tmp_path / "via")):
        for name in ("real.txt", "alias.txt"):
            with open_regular(tmp_path / "via" / name) as fh:
                assert fh.read() == b"r"


def test_the_input_folder_of_a_file_an_option_or_nothing_is_none(tmp_path):
    (tmp_path / "one.txt").write_text("x")
    assert input_folder(tmp_path / "one.txt") is None
    assert input_folder(tmp_path, outside_links=True) is None
    assert input_folder(None) is None
    assert input_folder(tmp_path / "missing") is None
    with reads_within(None), open_regular(tmp_path / "one.txt") as fh:  # no check
        assert fh.read() == b"x"


def test_a_folder_that_cannot_be_listed_now_is_reported_and_named_as_unlisted(tmp_path, monkeypatch):
    """A folder whose listing fails (permissions, an I/O error) is not a folder of no
    files: ``on_unlisted`` names it, so a caller keeps what it knew of it; a folder
    that is gone by the time it is listed is gone, and is not named."""
    import embedingest.sources.files as files

    for rel in ("a.txt", "locked/b.txt", "locked/deep/c.txt", "gone/d.txt", "z.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    real = os.scandir

    def scandir(path):
        if os.path.basename(path) == "locked":
            raise PermissionError(13, "Permission denied", path)
        if os.path.basename(path) == "gone":
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path)

    monkeypatch.setattr(files.os, "scandir", scandir)
    skipped, unlisted = [], []
    found = list(walk_files(tmp_path, {".txt"}, on_skip=lambda p, r: skipped.append((os.path.basename(p), r)),
                            on_unlisted=unlisted.append))
    assert [p.relative_to(tmp_path).as_posix() for p in found] == ["a.txt", "z.txt"]
    assert skipped == [("gone", "cannot list folder: No such file or directory"),
                       ("locked", "cannot list folder: Permission denied")]
    assert unlisted == [str(tmp_path / "locked")]
    unlisted.clear()
    monkeypatch.setattr(files.os, "scandir", lambda path: (_ for _ in ()).throw(OSError(5, "I/O error", path)))
    assert list(walk_files(tmp_path, {".txt"}, on_unlisted=unlisted.append)) == []
    assert unlisted == [str(tmp_path)]
