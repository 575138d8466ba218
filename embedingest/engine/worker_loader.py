"""Forking worker processes that never collect the parent's objects (a DataLoader's
workers, the header readers of ``sources.shape_batches``).

A worker forked from a process that already used CUDA (a library caller's second job, a
notebook, a test run) inherits that process's CUDA tensors and graphs. If the worker's
garbage collector frees one of them, its destructor calls into a CUDA context that is the
parent's: the CUDA runtime fails with "initialization error" and, inside a destructor, the
worker aborts (a graph's reset only warns). Freezing the garbage collector while the
workers fork puts every object of the parent into the permanent generation of each
worker, which its collector never examines; the parent unfreezes its own right after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from torch.utils.data import DataLoader


@contextlib.contextmanager
def frozen_gc() -> Iterator[None]:
    """Fork the processes that start in this block with the collector frozen."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class WorkerLoader(DataLoader):
    """:class:`torch.utils.data.DataLoader`, its workers forked with the collector frozen."""

    def __iter__(self):
        with frozen_gc():
            return super().__iter__()

    def check_worker_number_rationality(self) -> None:
        """Say nothing: the jobs size their workers from the cores they are given, or as
        the user asked (``--num-workers``), and torch's warning, printed raw to stderr
        twice, would only repeat that choice back."""
