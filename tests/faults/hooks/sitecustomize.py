"""Fault hooks for the fault-injection tests, loaded only in the processes those tests start.

The tests put this folder on ``PYTHONPATH``, so Python imports this module at start-up in
the CLI process and in every process it starts (spawned engine consumers, DataLoader
workers): faults can be injected in any of them, before any embedingest module exists.
Nothing happens unless one of these environment variables is set:

``EMBEDINGEST_FI_SINK_DELAY=SECONDS``
    consumer processes sleep this long before each batch their sink receives (a slow
    disk), so a run lasts long enough to be hit at a chosen moment.

``EMBEDINGEST_FI_COMMIT_DELAY=SECONDS``
    consumer processes sleep this long before committing each shard
    (``embedingest.sinks.shard_writer.ShardWriter.commit``: a slow disk at commit time), so
    a consumer's last commit lands well after its run's main process died.

``EMBEDINGEST_FI_KILL=PROC:PATTERN:N:PHASE``
    the process of kind PROC (``main`` or ``consumer``) kills itself with SIGKILL at the
    N-th ``os.replace`` (1-based) whose destination name matches the glob PATTERN:
    ``mid``: after cutting the temporary file to half its bytes (a crash while the file
    was being written); ``before``: with the temporary file whole but not renamed;
    ``after``: just after the rename.

``EMBEDINGEST_FI_ENOSPC=N`` (with ``EMBEDINGEST_FI_COUNTER=FILE``)
    the disk is "full" after N output files: in consumer processes, shard commits
    (``embedingest.sinks.shard_writer.ShardWriter.commit``) and mask writes (the
    ``atomic_write_bytes`` of ``embedingest.sinks.masks``) beyond the N-th, counted over
    all processes of the run through FILE, raise ``OSError(ENOSPC)``.

``EMBEDINGEST_FI_EACCES=PATTERN``
    opening a file whose name matches the glob PATTERN raises ``PermissionError`` (an
    unreadable file, for runs as root, where ``chmod 000`` does not stop reading).

``EMBEDINGEST_FI_CTRL_C_IN_CHILD_START=1``
    the main process sends SIGINT to its process group (a Ctrl-C in the terminal) inside
    its first ``embedingest.interrupts.children_ignore_sigint`` block, just after the
    child's start: the moment a Ctrl-C was lost, hit every time.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import signal
import sys

_DELAY = os.environ.get("EMBEDINGEST_FI_SINK_DELAY")
_COMMIT_DELAY = os.environ.get("EMBEDINGEST_FI_COMMIT_DELAY")
_KILL = os.environ.get("EMBEDINGEST_FI_KILL")
_ENOSPC = os.environ.get("EMBEDINGEST_FI_ENOSPC")
_EACCES = os.environ.get("EMBEDINGEST_FI_EACCES")
_CTRL_C_IN_CHILD_START = os.environ.get("EMBEDINGEST_FI_CTRL_C_IN_CHILD_START")


def _proc_kind() -> str:
    import multiprocessing

    name = multiprocessing.current_process().name
    if name.startswith("embedingest-consumer"):
        return "consumer"
    return "main" if name == "MainProcess" else "other"


def _disk_full() -> bool:
    """Count one output file over all processes; True once more than N were written."""
    fd = os.open(os.environ["EMBEDINGEST_FI_COUNTER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x")
        return os.fstat(fd).st_size > int(_ENOSPC)
    finally:
        os.close(fd)


def _enospc(what: str) -> OSError:
    return OSError(errno.ENOSPC, f"No space left on device (injected) while writing {what}")


if _KILL:
    _proc, _pattern, _nth, _phase = _KILL.split(":")
    _seen = 0
    _real_replace = os.replace

    def _replace(src, dst, *args, **kwargs):
        global _seen
        name = os.path.basename(os.fsdecode(dst))
        if fnmatch.fnmatch(name, _pattern) and _proc_kind() == _proc:
            _seen += 1
            if _seen == int(_nth):
                if _phase == "mid":
                    os.truncate(src, os.stat(src).st_size // 2)
                if _phase in ("mid", "before"):
                    os.kill(os.getpid(), signal.SIGKILL)
                _real_replace(src, dst, *args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)
        return _real_replace(src, dst, *args, **kwargs)

    os.replace = _replace


if _EACCES:
    import builtins
    import io

    _real_open = io.open

    def _open(file, *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and fnmatch.fnmatch(
                os.path.basename(os.fsdecode(file)), _EACCES):
            raise PermissionError(errno.EACCES, "Permission denied (injected)", os.fsdecode(file))
        return _real_open(file, *args, **kwargs)

    builtins.open = io.open = _open


def _slow_down(sink_class) -> None:
    """Every batch the sink receives waits ``EMBEDINGEST_FI_SINK_DELAY`` seconds first."""
    call = sink_class.__call__

    def slow_call(self, batch_id, arrays, _call=call):
        import time

        time.sleep(float(_DELAY))
        return _call(self, batch_id, arrays)

    sink_class.__call__ = slow_call


def _patch_masks(mod) -> None:
    if _DELAY:
        _slow_down(mod.MaskSink)
    if _ENOSPC:
        write = mod.atomic_write_bytes

        def full_write(path, data, _write=write):
            if _proc_kind() == "consumer" and _disk_full():
                raise _enospc(os.fspath(path))
            return _write(path, data)

        mod.atomic_write_bytes = full_write


def _patch_shard_writer(mod) -> None:
    """The faults of shard commits (a commit writes the Parquet, embeddings and faiss
    files, then the commit record)."""
    if _DELAY:
        _slow_down(mod.ShardSink)
    commit = mod.ShardWriter.commit
    if _ENOSPC:
        def full_commit(self, _commit=commit):
            if _proc_kind() == "consumer" and _disk_full():
                raise _enospc(self.name)
            return _commit(self)

        mod.ShardWriter.commit = full_commit
        commit = full_commit
    if _COMMIT_DELAY:
        def slow_commit(self, _commit=commit):
            if _proc_kind() == "consumer":
                import time

                time.sleep(float(_COMMIT_DELAY))
            return _commit(self)

        mod.ShardWriter.commit = slow_commit


def _patch_interrupts(mod) -> None:
    """A Ctrl-C in the main process's first child start (patched before the modules that
    start children import it)."""
    import contextlib

    if not _CTRL_C_IN_CHILD_START:
        return
    start = mod.children_ignore_sigint
    sent = []

    @contextlib.contextmanager
    def ctrl_c_in_the_start(_start=start):
        with _start():
            yield
            if not sent and _proc_kind() == "main":
                sent.append(1)
                os.killpg(0, signal.SIGINT)

    mod.children_ignore_sigint = ctrl_c_in_the_start


_PATCHES = {"embedingest.sinks.shard_writer": _patch_shard_writer,
            "embedingest.sinks.masks": _patch_masks,
            "embedingest.interrupts": _patch_interrupts}


class _PatchAfterImport:
    """Meta path finder: lets the normal finders load a module, then patches it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _PATCHES:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def patched_exec(module, _exec=exec_module, _patch=_PATCHES[fullname]):
            _exec(module)
            _patch(module)

        loader.exec_module = patched_exec
        return spec


if _DELAY or _ENOSPC or _COMMIT_DELAY or _CTRL_C_IN_CHILD_START:
    sys.meta_path.insert(0, _PatchAfterImport())
