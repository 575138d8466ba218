"""What every command shares: library errors as clean messages, JSON output, the
Ctrl-C-safe import of a job and the quick exit after it, the options generated from a
config dataclass."""

from __future__ import annotations

import functools
import json
import sqlite3
import sys
from typing import NoReturn

import click

from ..errors import EmbedingestError


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
        except (OSError, sqlite3.Error) as exc:  # disk full, permissions, I/O errors, in a sink too
            raise click.ClickException(f"{exc}; what was committed before is kept: fix the "
                                       "cause and run the same command again") from exc

    return wrapper


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def exit_quickly(code: int) -> NoReturn:
    """Exit with ``code`` once the run is over (its files written, its processes gone),
    without the interpreter's last garbage collection over torch, transformers and the
    model: seconds on a loaded machine, which pushed an interrupted run past the 5 s it
    promises. Objects are still finalized as modules are torn down."""
    import gc

    gc.freeze()
    sys.exit(code)


def import_interruptibly(module: str):
    """Import a job's module (torch, numpy, faiss, transformers: seconds) with SIGINT
    held back until it is done, so a Ctrl-C meanwhile arrives as a KeyboardInterrupt
    right after it, where the command turns it into exit 130. Inside those imports it
    is not safe: torch imports numpy from C and takes any error for "no numpy" (the
    Ctrl-C is lost, numpy left half imported), and pybind11 aborts the process."""
    import importlib
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        return importlib.import_module(module)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return importlib.import_module(module)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)



def _config_options(cls, skip=()):
    """One click option per dataclass field (kebab-case), defaulting to None so a preset
    or the dataclass default applies unless the option is given."""
    import dataclasses

    def decorate(fn):
        for f in reversed(dataclasses.fields(cls)):
            if f.name in skip:
                continue
            name = "--" + f.name.replace("_", "-")
            if f.type in ("bool", bool):
                opt = click.option(f"{name}/--no-{name[2:]}", f.name, default=None,
                                   help=f"[default: {f.default}]")
            else:
                kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
                opt = click.option(name, f.name, type=kind, default=None,
                                   help=f"[default: {f.default}]")
            fn = opt(fn)
        return fn

    return decorate
