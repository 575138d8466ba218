"""The ``embedingest`` command line: a thin layer over the library's jobs.

Each command's options map one-to-one onto the fields of the job's config dataclass;
``--config FILE.toml`` fills the same fields from a preset. Library errors become
``click.ClickException`` (exit code 1) with the library's message. One module per command
group; :mod:`.common` holds what they share.
"""

from __future__ import annotations

import logging
from typing import NoReturn

import click

from .. import __version__
from ..terminal import log_to_stderr
from .bench import bench
from .common import end_process
from .index import build_index_cmd, export, reindex
from .search import search, serve
from .segment import segment_command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="embedingest")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
def main(verbose: bool) -> None:
    """Run models on a GPU over large batches and get their outputs off the GPU fast."""
    log_to_stderr(logging.INFO if verbose else logging.WARNING)


for command in (build_index_cmd, reindex, export, search, serve, segment_command, bench):
    main.add_command(command)


def run() -> NoReturn:
    """The program (the ``embedingest`` script, ``python -m embedingest``): the command
    line, then the process ends at once (:func:`~.common.end_process`). ``main`` is the
    click group, for callers that stay in their process (click's test runner)."""
    try:
        main(prog_name="embedingest")
    except SystemExit as done:
        end_process(done.code)
    end_process(0)


__all__ = ["main", "run"]
