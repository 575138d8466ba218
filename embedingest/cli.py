"""The ``embedingest`` command line: a thin layer over the library's jobs.

Each command's options map one-to-one onto the fields of the job's config dataclass;
``--config FILE.toml`` fills the same fields from a preset. Library errors become
``click.ClickException`` (exit code 1) with the library's message.
"""

from __future__ import annotations

import functools
import json
import logging
import sys

import click

from . import __version__
from .errors import EmbedingestError


def library_errors(fn):
    """Turn embedingest's own errors into clean CLI messages instead of tracebacks."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EmbedingestError as exc:
            raise click.ClickException(str(exc)) from exc
        except FileNotFoundError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="embedingest")
@click.option("-v", "--verbose", is_flag=True, help="Log progress details to stderr.")
def main(verbose: bool) -> None:
    """Run models on a GPU over large batches and get their outputs off the GPU fast."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


@main.group()
def bench() -> None:
    """Side-by-side benchmarks (the GPU parts need a CUDA GPU)."""


@bench.command("segmentation")
@click.option("--steps", default=30, show_default=True, help="Timed steps for the fast loops.")
@click.option("--warmup", default=5, show_default=True, help="Steps before the clock starts.")
@click.option("--batch-size", default=64, show_default=True)
@click.option("--image-size", default=512, show_default=True)
@click.option("--consumers", default=8, show_default=True, help="Consumer processes.")
@click.option("--slots", default=12, show_default=True, help="Engine host slots.")
@click.option("--loader-workers", default=8, show_default=True)
@click.option("--only", default="", help="Comma list of row groups: bound, seed, engine.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write rows here.")
@library_errors
def bench_segmentation(steps, warmup, batch_size, image_size, consumers, slots, loader_workers,
                       only, json_path) -> None:
    """The seed article's DeepLabV3 workload: its five loops, the forward-only bound and
    embedingest's engine, in one run."""
    import torch

    if not torch.cuda.is_available():
        raise click.ClickException("this benchmark needs a CUDA GPU; torch sees none here")
    from .bench.report import machine_info, table, write_json
    from .bench.segmentation import SegBenchConfig, run_all

    cfg = SegBenchConfig(batch_size=batch_size, image_size=image_size, loader_workers=loader_workers,
                         consumers=consumers, slots=slots, warmup=warmup, steps=steps)
    select = {s.strip() for s in only.split(",") if s.strip()} or None
    info = machine_info()
    click.echo(f"# {info.get('gpu', '?')} driver {info.get('driver', '?')}, torch {info.get('torch')}, {info['date']}")
    rows = run_all(cfg, select, log=lambda m: click.echo(m, err=True))
    click.echo(table(rows, "steps/s"))
    if json_path:
        write_json(json_path, {"machine": info, "config": cfg.__dict__, "rows": rows})
