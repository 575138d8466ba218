"""Generic helpers for jobs that run over a Ray Dataset (Ray is optional: import this
module only where Ray is installed)."""

from __future__ import annotations

import contextlib

import ray.data


@contextlib.contextmanager
def in_order(dataset: ray.data.Dataset):
    """Run ``dataset`` with its output in input order (its context is shared with the
    datasets it derives from, so the setting is put back afterwards)."""
    options = dataset.context.execution_options
    saved = options.preserve_order
    options.preserve_order = True
    try:
        yield dataset
    finally:
        options.preserve_order = saved
