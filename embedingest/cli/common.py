"""What every command shares: library errors as clean messages, JSON output, the
Ctrl-C-safe import of a job and the quick exit after it, running a job command
(:func:`run_options`, :func:`run_job`), the options generated from a config dataclass
(:func:`config_options`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import sqlite3
import sys
import threading
import typing
from typing import NoReturn

import click

from ..config import load_config
from ..errors import ConfigError, EmbedingestError, SettingError
from ..interrupts import Terminated, redeliver_swallowed_interrupts, sigterm_interrupts
from ..exit_codes import EXIT_INTERRUPTED, EXIT_TERMINATED


def library_errors(fn=None, *, kept: str = "what was committed before is kept"):
    """Turn embedingest's own errors into clean CLI messages instead of tracebacks; an
    OSError (disk full, permissions, I/O, in a sink too) also says what is ``kept``.
    Use as ``@library_errors`` or ``@library_errors(kept="...")``."""
    if fn is None:
        return functools.partial(library_errors, kept=kept)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SettingError as exc:  # refused before any work, as a bad option is: status 2
            raise click.UsageError(str(exc)) from exc
        except (EmbedingestError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from exc
        except (OSError, sqlite3.Error) as exc:
            if isinstance(exc, BrokenPipeError) and output_reader_gone():
                end_quietly()
            # (a broken pipe of the command's own is a failure: click would end it silently)
            raise click.ClickException(f"{exc}; {kept}: fix the cause and run the same command "
                                       "again") from exc

    return wrapper


def output_reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (``| head``): the
    usual end of a reader that has what it wanted, not a failure of the command."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def end_quietly() -> NoReturn:
    """End the command whose reader went away: nothing more is written to it (the flush
    at exit would fail again), no message, status 0, as ``head`` expects of a writer."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(0)


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


class InputPath(click.ParamType):
    """A file or folder that exists, or a URL (``s3://bucket/prefix``, ``file:///...``),
    which the job itself checks before it writes anything."""

    name = "path_or_url"

    def convert(self, value, param, ctx):
        from ..sources.remote import is_remote, local_path

        if is_remote(value):
            return value
        return click.Path(exists=True, path_type=str).convert(local_path(value), param, ctx)


class IndexPath(click.ParamType):
    """An index folder that exists, or the URL of an index in object storage
    (``s3://bucket/prefix``), which opening it checks."""

    name = "folder_or_url"

    def convert(self, value, param, ctx):
        from ..sources.remote import is_remote, local_path

        if is_remote(value):
            return value
        return click.Path(exists=True, file_okay=False, path_type=str).convert(local_path(value), param, ctx)


def end_process(code) -> NoReturn:
    """End the program with ``code`` (a :class:`SystemExit`'s) once its command is over,
    without the interpreter's teardown of torch, CUDA and the model: most of a second after
    every run on the lent GPU machine, seconds on a loaded one, which also pushed an
    interrupted run past the 5 s it promises.

    Standard output and error are flushed and the ``atexit`` callbacks run (logging's
    handlers flushed, multiprocessing's children joined, temporary folders removed), then
    :func:`os._exit`. A code that is not a number (a message), a thread that is not a
    daemon still running, or output that cannot be flushed (a full disk) gets the usual
    exit, which prints the message, waits, or reports the lost output with status 120,
    without the last garbage collection (``gc.freeze``)."""
    import atexit
    import gc

    gc.freeze()
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)  # CPython's; elsewhere the usual exit
    if (not (code is None or isinstance(code, int)) or run_exitfuncs is None
            or any(t.is_alive() and not t.daemon for t in others)):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a full disk, a broken pipe: the usual exit says so (120)
            sys.exit(code)
    run_exitfuncs()
    os._exit(code or 0)


def import_interruptibly(module: str):
    """Import a job's module (torch, numpy, faiss, transformers: seconds) with SIGINT
    (and SIGTERM) held back until it is done, so a Ctrl-C meanwhile arrives as a KeyboardInterrupt
    right after it, where the command turns it into EXIT_INTERRUPTED. Inside those
    imports it is not safe: torch imports numpy from C and takes any error for "no numpy"
    (the Ctrl-C is lost, numpy left half imported), and pybind11 aborts the process."""
    import importlib
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        return importlib.import_module(module)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        return importlib.import_module(module)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def in_existing_folder(ctx, param, value: str | None) -> str | None:
    """A click callback for a file the command writes at its end (a timeline, a trace, a
    benchmark's JSON): its folder must exist now, so a typo stops the command before its
    work rather than losing the summary after it."""
    if value is None:
        return value
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise click.BadParameter(f"{value!r}: the folder {folder!r} does not exist; create it or give "
                                 "another path", ctx=ctx, param=param)
    return value


def run_options(preset: str, timeline: str, trace: str):
    """The options of a job command beside its config fields: ``--config`` (a preset),
    ``--json``, ``--timeline`` and ``--trace``, with the help given."""
    options = [
        click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
                     help=f"TOML preset of these options ({preset}); options given here win."),
        click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON."),
        click.option("--timeline", type=click.Path(dir_okay=False), callback=in_existing_folder, help=timeline),
        click.option("--trace", type=click.Path(dir_okay=False), callback=in_existing_folder, help=trace),
    ]

    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


@contextlib.contextmanager
def stops_as_exits(interrupted: str):
    """In the block, Ctrl-C and SIGTERM stop the command with ``interrupted: <interrupted>``
    (``terminated (SIGTERM): ...``) and :data:`EXIT_INTERRUPTED` (:data:`EXIT_TERMINATED`),
    also when the Ctrl-C landed where Python swallows it (a finalizer, an import lock's
    callback): it is delivered again."""
    previous, sys.unraisablehook = sys.unraisablehook, redeliver_swallowed_interrupts(signal.SIGINT)
    try:
        with sigterm_interrupts():
            yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one now would end it by the signal
        click.echo(f"\nterminated (SIGTERM): {interrupted}", err=True)
        sys.exit(EXIT_TERMINATED)
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: {interrupted}", err=True)
        sys.exit(EXIT_INTERRUPTED)  # the program then ends at once (end_process)
    finally:
        sys.unraisablehook = previous


def run_job(module: str, call, *, as_json: bool, paragraph, interrupted: str) -> NoReturn:
    """Import the job's ``module`` (Ctrl-C-safe), run ``call(module)`` and print the summary
    it returns (as JSON, or as ``paragraph(summary)``), then exit with its ``exit_code``;
    on Ctrl-C say ``interrupted: <interrupted>`` and exit with :data:`EXIT_INTERRUPTED`
    (on SIGTERM, ``terminated (SIGTERM): ...`` and :data:`EXIT_TERMINATED`), also when the Ctrl-C landed where Python swallows it (a finalizer, an import lock's
    callback): it is delivered again."""
    threads_hook, process_hook = threading.excepthook, sys.excepthook
    try:
        with stops_as_exits(interrupted):
            job = import_interruptibly(module)
            from ..engine.consumers import quiet_resource_sharer, quiet_resource_sharer_sys  # imported with the job

            threading.excepthook, sys.excepthook = quiet_resource_sharer, quiet_resource_sharer_sys
            summary = call(job)
    finally:
        threading.excepthook, sys.excepthook = threads_hook, process_hook
    if as_json:
        emit_json(summary)
    else:
        click.echo(paragraph(summary))
    sys.exit(summary["exit_code"])


def command_config(cls, path=None, **options):
    """:func:`embedingest.config.load_config` for a command, the settings' own checks run
    (``validate``): a preset or an option they refuse is refused as a bad option is, before
    any work (status 2, :class:`SettingError`)."""
    try:
        config = load_config(cls, path, **options)
        if hasattr(config, "validate"):
            config.validate()
    except ConfigError as exc:
        raise SettingError(str(exc)) from exc
    return config


def config_options(cls, skip: tuple[str, ...] = ()):
    """Decorate a command with one option per field of the dataclass ``cls`` (but ``skip``).

    The option is the field's name in kebab-case (``num_consumers``: ``--num-consumers``;
    a bool also gets ``--no-...``), its help the field's documentation (see
    :func:`embedingest.config.setting`) with the default shown, and its type follows the
    field: ``click.Choice`` for a fixed set of values, ``click.Path`` for paths,
    ``click.IntRange`` for bounds. Every option defaults to None, so a ``--config`` preset,
    or else the dataclass default, applies unless the option is given; the command builds
    the config with :func:`embedingest.config.load_config`.
    """
    hints = typing.get_type_hints(cls)

    def decorate(fn):
        for f in reversed(dataclasses.fields(cls)):
            if f.name not in skip:
                option = click.option(*_option_names(f, hints[f.name]), f.name,
                                      **_option_settings(f, hints[f.name]))
                fn = option(fn)
        return fn

    return decorate


def _option_names(f: dataclasses.Field, hint) -> tuple[str, ...]:
    if "flags" in f.metadata:
        return tuple(f.metadata["flags"])
    name = f.name.replace("_", "-")
    return (f"--{name}/--no-{name}",) if hint is bool else (f"--{name}",)


def _option_settings(f: dataclasses.Field, hint) -> dict:
    meta = f.metadata
    if "doc" not in meta:
        raise TypeError(f"{f.name}: a config field needs its documentation (config.setting)")
    kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    shown = meta.get("shown")
    if shown is None and f.default not in (None, ""):
        shown = ("on" if f.default else "off") if kind is bool else f.default
    settings = {"default": None, "metavar": meta.get("metavar"),
                "help": meta["doc"] + (f"  [default: {shown}]" if shown is not None else "")}
    if "choices" in meta:
        settings["type"] = click.Choice(meta["choices"])
    elif "path" in meta:
        settings["type"] = click.Path(exists=meta.get("exists", False), file_okay=meta["path"] != "dir",
                                      dir_okay=meta["path"] != "file", path_type=str)
    elif "range" in meta:
        settings["type"] = (click.IntRange if kind is int else click.FloatRange)(*meta["range"])
    elif kind is not bool:
        settings["type"] = kind
    return settings
