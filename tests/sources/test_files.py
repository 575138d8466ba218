import os

import pytest

from embedingest.sources.files import walk_files


def walk(root, extensions=None):
    skipped = []
    found = list(walk_files(root, extensions, on_skip=lambda p, r: skipped.append((os.path.basename(p), r))))
    return [p.relative_to(root).as_posix() for p in found], skipped


def test_sorted_hidden_passed_over_suffix_filtered(tmp_path):
    for rel in ("b.txt", "a.TXT", "c.bin", ".hidden.txt", "sub/d.txt", ".git/e.txt", "f.jsonl.GZ"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert walk(tmp_path, {".txt", ".jsonl.gz"}) == (["a.TXT", "b.txt", "f.jsonl.GZ", "sub/d.txt"], [])
    other = []
    list(walk_files(tmp_path, {".txt"}, on_other=other.append))
    assert [os.path.basename(p) for p in other] == ["c.bin", "f.jsonl.GZ"]


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
                               ("loop", "symlink loop: folder already visited"),
                               ("pipe.txt", "not a regular file (a pipe, socket or device)")]


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
