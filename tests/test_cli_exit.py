"""The program's end (:func:`embedingest.cli.common.end_process`): flushed output, the
``atexit`` callbacks run, the exit status kept, the interpreter's teardown skipped; the
usual exit where a thread still runs or the code is a message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, pathlib, sys, threading, time
    from embedingest.cli.common import end_process

    out = pathlib.Path(sys.argv[1])
    mode, code = sys.argv[2], sys.argv[3]

    class Torn:
        def __init__(self, path):
            self.path = path

        def __del__(self, _open=open):  # runs only in the interpreter's teardown
            with _open(self.path, "w") as fh:
                fh.write("ran")

    kept = Torn(str(out / "teardown"))
    real_exit = os._exit

    def spied_exit(status):
        (out / "os_exit").write_text(str(status))
        real_exit(status)

    os._exit = spied_exit
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    sys.stdout.write("no newline, still buffered")  # a pipe: block-buffered
    if mode == "thread":
        def late():
            time.sleep(0.3)
            (out / "thread").write_text("done")
        threading.Thread(target=late).start()
    if mode == "usual":
        sys.exit(int(code))
    end_process(None if code == "none" else int(code) if code.isdigit() else code)
""")


def _end(tmp_path: Path, mode: str, code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # the pipe stays buffered
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode, code],
                          capture_output=True, text=True, timeout=60, env=env)


def test_the_end_flushes_runs_atexit_keeps_the_status_and_skips_the_teardown(tmp_path):
    run = _end(tmp_path, "plain", "3")
    assert run.returncode == 3
    assert run.stdout == "no newline, still buffered"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()
    assert (tmp_path / "os_exit").read_text() == "3"


def test_the_usual_exit_would_have_torn_down(tmp_path):
    """The control of the test above: the teardown it looks for does run on the usual exit."""
    run = _end(tmp_path, "usual", "3")
    assert run.returncode == 3 and (tmp_path / "teardown").read_text() == "ran"


def test_no_code_is_success(tmp_path):
    assert _end(tmp_path, "plain", "none").returncode == 0
    assert (tmp_path / "os_exit").read_text() == "0"


def test_a_running_thread_gets_the_usual_exit_which_waits_for_it(tmp_path):
    run = _end(tmp_path, "thread", "4")
    assert run.returncode == 4
    assert (tmp_path / "thread").read_text() == "done"
    assert not (tmp_path / "os_exit").exists()
    assert (tmp_path / "atexit").read_text() == "ran"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_output_lost_to_a_full_disk_is_reported_not_dropped(tmp_path):
    """Standard output on a full device: the flush fails, and the usual exit reports it
    with Python's status 120 instead of a silent 0."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open("/dev/full", "w") as full:
        run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), "plain", "0"], stdout=full,
                             stderr=subprocess.PIPE, text=True, timeout=60, env=env)
    assert run.returncode == 120
    assert "No space left on device" in run.stderr
    assert not (tmp_path / "os_exit").exists()


def test_a_message_for_a_code_is_printed_with_status_1(tmp_path):
    run = _end(tmp_path, "plain", "the-message")
    assert run.returncode == 1
    assert "the-message" in run.stderr
    assert run.stdout == "no newline, still buffered"


def test_the_program_prints_the_whole_summary_and_its_exit_status(tmp_path):
    """``python -m embedingest`` through :func:`embedingest.cli.run`: a job's JSON summary
    whole on a pipe, the status the summary gives (3: an input skipped), a usage error's status 2."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("One short document about rivers.\n", encoding="utf-8")
    (tmp_path / "corpus" / "empty.txt").write_bytes(b"")
    run = subprocess.run([sys.executable, "-m", "embedingest", "build-index", str(tmp_path / "corpus"),
                          "--out", str(tmp_path / "ix"), "--device", "cpu", "--num-workers", "0", "--json"],
                         capture_output=True, text=True, timeout=300)
    summary = json.loads(run.stdout)
    assert (summary["chunks"], summary["skipped_by_reason"]) == (1, {"empty": 1})
    assert run.returncode == summary["exit_code"] == 3
    usage = subprocess.run([sys.executable, "-m", "embedingest", "build-index", str(tmp_path / "missing")],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "does not exist" in usage.stderr


def test_a_skipped_file_s_name_is_logged_on_one_line_with_its_controls_escaped(tmp_path):
    """A corpus file named with a newline and an escape sequence (a forged log line, a
    terminal command) is skipped as empty, and the program's warning names it on one
    line, escaped."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("One short document about rivers.\n", encoding="utf-8")
    (corpus / "x\x1b[2J\nWARNING forged.txt").write_bytes(b"")
    run = subprocess.run([sys.executable, "-m", "embedingest", "build-index", str(corpus),
                          "--out", str(tmp_path / "ix"), "--device", "cpu", "--num-workers", "0", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr
    assert "\x1b" not in run.stderr
    warnings = [line for line in run.stderr.splitlines() if line.startswith("WARNING")]
    assert warnings == [f"WARNING embedingest: skipped {corpus}/x\\x1b[2J\\x0aWARNING forged.txt: "
                        "empty: the file has no bytes"], run.stderr


PIPE_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import click
    from embedingest.cli.common import end_process, library_errors

    @click.command()
    @click.argument("where")
    @library_errors
    def cmd(where):
        time.sleep(0.5)  # the reader of standard output is gone by now
        if where == "stdout":
            for _ in range(10_000):
                click.echo("a hit " * 20)
        else:  # another pipe of the command's own, its reader gone: a real failure
            r, w = os.pipe()
            os.close(r)
            os.write(w, b"x")

    try:
        cmd()
    except SystemExit as done:
        end_process(done.code)
""")


@pytest.mark.parametrize("where", ["stdout", "own"])
def test_a_reader_that_closes_the_output_ends_the_command_quietly(where):
    """``search ... | head -1``: standard output's reader closing early is not a failure
    (before: "Error: [Errno 32] Broken pipe; what was committed before is kept", status 1);
    a broken pipe of the command's own still is."""
    proc = subprocess.Popen([sys.executable, "-c", PIPE_SCRIPT, where], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    if where == "stdout":
        proc.stdout.close()
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    if where == "own":
        assert proc.stdout.read() == b""
        proc.stdout.close()
    assert proc.wait(timeout=60) == (0 if where == "stdout" else 1)
    assert stderr == ("" if where == "stdout" else
                      "Error: [Errno 32] Broken pipe; what was committed before is kept: fix the cause "
                      "and run the same command again\n")


STOP_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from embedingest.cli.common import end_process, stops_as_exits

    try:
        with stops_as_exits("the index is as it was; run the same command again"):
            if sys.argv[1] == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise KeyboardInterrupt
            time.sleep(5)
    except SystemExit as done:
        end_process(done.code)
""")


@pytest.mark.parametrize("stop, code, said", [("ctrl-c", 130, "interrupted:"), ("sigterm", 143, "terminated (SIGTERM):")])
def test_a_command_s_stops_end_it_with_its_status_and_a_line(stop, code, said):
    """What run_job and reindex share: reindex printed click's 'Aborted!' with status 1 on
    Ctrl-C, and died of SIGTERM without a word."""
    run = subprocess.run([sys.executable, "-c", STOP_SCRIPT, stop], capture_output=True, text=True, timeout=60)
    assert run.returncode == code
    assert run.stderr == f"\n{said} the index is as it was; run the same command again\n"
