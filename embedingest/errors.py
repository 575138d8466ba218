"""Exceptions that embedingest raises to its callers.

Library errors derive from :class:`EmbedingestError`, so the CLI can turn every one of
them into a clean message and a non-zero exit, while errors raised inside a user's own
sink keep their original type.
"""

from __future__ import annotations

import pickle
import traceback


class EmbedingestError(Exception):
    """Base class of the errors embedingest itself raises."""


class ConfigError(EmbedingestError, ValueError):
    """A setting or argument has a value embedingest cannot use; the message names it."""


class SettingError(ConfigError):
    """A setting refused before any work, as a bad option is: the CLI exits with the usage
    status (2), not the error status of a run that failed."""


class EngineError(EmbedingestError, RuntimeError):
    """The egress engine failed (a consumer died, the pool could not be made, ...)."""


class ConsumerDied(EngineError):
    """A consumer process ended without being asked to (SIGKILL, OOM killer, crash)."""

    def __init__(self, message: str, worker: int, exitcode: int | None, batch_id=None):
        super().__init__(message)
        self.worker = worker
        self.exitcode = exitcode
        self.batch_id = batch_id


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised in another process.

    It is attached as ``__cause__`` of the re-raised exception, so the caller's traceback
    shows where the error really happened.
    """

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return "\n\n" + self.tb


def error_payload(exc: BaseException) -> tuple[bytes | None, str, str]:
    """What another process needs to re-raise ``exc``: the pickled exception (None when it
    does not survive a round trip), a one-line summary and the formatted traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        data = None
    return data, f"{type(exc).__name__}: {exc}", tb


def rebuild_error(payload: bytes | None, fallback: str, where: str, tb: str) -> BaseException:
    """The exception :func:`error_payload` described, re-made in this process: the original
    type when it unpickles and is an ``Exception``, else an :class:`EngineError` with
    ``fallback`` as message (a ``SystemExit`` or ``KeyboardInterrupt`` raised over there
    would end or interrupt this process); the remote traceback (labelled ``where``)
    becomes its cause."""
    exc = None
    if payload is not None:
        try:
            exc = pickle.loads(payload)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = EngineError(fallback)
    elif not isinstance(exc, Exception):  # SystemExit(0) re-raised here ended the caller, silently
        exc = EngineError(f"{fallback} (an exit or interrupt {where} is an error of the run, not an exit "
                          "of this process)")
    exc.__cause__ = RemoteTraceback(f"{where}:\n{tb}")
    return exc
