import json
import logging
import os
import stat
import time

from fault_helpers import unblock_later

from embedingest.report import SkipReport, passed_over_sentence


def test_report_is_json_lines_even_for_names_that_are_not_utf8(tmp_path):
    report = SkipReport()
    report.add("/data/caf\udce9.txt", "binary: NUL byte", stage="list")
    report.add("/data/a.jsonl:line 3", "json: line 3: bad")
    path = report.write(tmp_path)
    text = path.read_text(encoding="utf-8")  # valid UTF-8: the odd byte is an escape
    rows = [json.loads(line) for line in text.splitlines()]
    assert "caf\\udce9" in text and rows[0]["path"] == "/data/caf\udce9.txt"  # reads back as it was
    assert rows[1]["stage"] == "read"
    assert report.by_reason() == {"binary": 1, "json": 1}


def test_passed_over_counts_by_suffix_and_says_so():
    report = SkipReport()
    for name in ("a.PPTX", "b.pptx", "notes", "c.docx"):
        report.pass_over(name)
    counts = dict(report.passed_over.most_common())
    assert counts == {".pptx": 2, "(no suffix)": 1, ".docx": 1}
    assert passed_over_sentence({"passed_over": counts}).startswith(
        " Passed over 4 files of formats it does not read (.pptx 2, (no suffix) 1, .docx 1)")
    assert passed_over_sentence({"passed_over": {}}) == ""
    assert passed_over_sentence({"passed_over": {".txt": 1}}) == (
        " Passed over 1 file of formats it does not read (.txt 1); the README lists the ones it does.")


def test_hidden_files_and_folders_are_counted_apart_from_formats():
    """Hidden images (``.photo.jpg``, ``.cache/``) were dropped without a word."""
    report = SkipReport()
    for name in ("/p/.photo.jpg", "/p/.cache", "/p/a.heic"):
        report.pass_over(name)
    counts = dict(report.passed_over.most_common())
    assert counts == {"(hidden)": 2, ".heic": 1}
    assert passed_over_sentence({"passed_over": counts}) == (
        " Passed over 1 file of formats it does not read (.heic 1); the README lists the ones it does."
        " Passed over 2 hidden entries (a name starting with '.'; a folder's files not counted): give one as the "
        "input itself to read it.")
    assert passed_over_sentence({"passed_over": {"(hidden)": 1}}) == (
        " Passed over 1 hidden entry (a name starting with '.'; a folder's files not counted): give one as the "
        "input itself to read it.")


def test_earlier_runs_stay_in_the_report_each_entry_naming_its_run(tmp_path):
    first = SkipReport()
    first.add("/data/a.jsonl:line 2", "json: bad")
    first.add("/data/bin.txt", "binary: NUL byte", stage="list")
    first.write(tmp_path)
    second = SkipReport()  # an unchanged corpus: only the file skipped whole is read again
    second.add("/data/bin.txt", "binary: NUL byte", stage="list")
    second.write(tmp_path)
    third = SkipReport()  # nothing skipped at all
    path = third.write(tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"path": "/data/a.jsonl:line 2", "reason": "json: bad", "stage": "read", "run": first.run},
        {"path": "/data/bin.txt", "reason": "binary: NUL byte", "stage": "list", "run": second.run},
    ]
    assert first.run != second.run and (second.earlier, third.earlier) == (1, 2)
    (tmp_path / "elsewhere.jsonl").write_text('{"path": "x", "reason": "y"}\n')
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.jsonl")  # not read through, replaced
    third.write(tmp_path)
    assert not path.is_symlink() and path.read_text() == ""
    assert (tmp_path / "elsewhere.jsonl").read_text() == '{"path": "x", "reason": "y"}\n'


def test_a_report_that_is_a_pipe_or_device_is_replaced_never_waited_for(tmp_path, caplog):
    """``skipped.jsonl`` a named pipe (a read waits for a writer for ever), a link to one
    or to a device: the earlier report is not read, a warning names it, and the new report
    replaces it; the pipe's link target stays a pipe."""
    os.mkfifo(tmp_path / "elsewhere")
    path = tmp_path / "skipped.jsonl"
    for make, kind in ((lambda: os.mkfifo(path), "a named pipe (FIFO)"),
                       (lambda: path.symlink_to(tmp_path / "elsewhere"), "a symbolic link"),
                       (lambda: path.symlink_to("/dev/zero"), "a symbolic link")):
        make()
        unblock_later(path)
        report = SkipReport()
        report.add("/data/x.txt", "empty")
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, "embedingest"):
            assert report.write(tmp_path) == path
        assert time.monotonic() - start < 5
        assert f"cannot read the earlier skip report {path} (not a regular file: {kind}): it is replaced" in caplog.text
        assert path.is_file() and not path.is_symlink()
        assert [json.loads(line)["path"] for line in path.read_text().splitlines()] == ["/data/x.txt"]
        path.unlink()
        caplog.clear()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "elsewhere").st_mode)
