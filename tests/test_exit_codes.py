"""The exit statuses, defined once: the rule of a finished run, click's error status, and
the help paragraph of the job commands."""

from __future__ import annotations

import click
from click.testing import CliRunner

from embedingest.cli import main
from embedingest.exit_codes import (EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_SKIPPED, EXIT_TERMINATED,
                                    EXIT_USAGE, exit_code, exit_status_help)


def test_a_run_that_skipped_inputs_exits_with_its_own_status():
    assert (exit_code(0), exit_code(1), exit_code(7)) == (EXIT_OK, EXIT_SKIPPED, EXIT_SKIPPED)
    assert len({EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_SKIPPED, EXIT_INTERRUPTED, EXIT_TERMINATED}) == 6


def test_an_error_exits_with_clicks_status():
    assert click.ClickException("x").exit_code == EXIT_ERROR
    assert click.UsageError("x").exit_code == EXIT_USAGE


def test_a_refused_command_line_exits_with_the_usage_status_the_help_names(tmp_path):
    """The README and each job command's help name status 2; an input that does not exist
    and an unknown option give it."""
    for args in (["segment", str(tmp_path / "nope"), "--out", str(tmp_path / "o")],
                 ["build-index", str(tmp_path), "--no-such-option"]):
        assert CliRunner().invoke(main, args).exit_code == EXIT_USAGE


def test_the_job_commands_help_names_every_status():
    text = exit_status_help("all done", "inputs", "OUT")
    assert text == ("Exit status: 0 all done; 3 finished, but some inputs were skipped (see "
                    "skipped.jsonl in OUT); 1 error; 2 a command line refused before any work; 130 "
                    "interrupted, 143 stopped by SIGTERM (run the "
                    "same command again to resume).")
    for command in ("build-index", "segment"):
        r = CliRunner().invoke(main, [command, "--help"], terminal_width=1000)
        assert r.exit_code == 0 and "Exit status: 0 all " in r.output and "; 130 interrupted" in r.output
