"""``WorkerLoader`` forks its DataLoader workers with the parent's garbage collector frozen
(a worker must never collect the parent's objects: a CUDA tensor or graph freed there
aborts it), and the parent's own collector runs as before once they are started, or once
starting them failed.

Mutmut makes no mutant of ``worker_loader.py`` (``frozen_gc`` is decorated, and
``__iter__`` holds nothing it changes); these tests were checked against the changes by
hand (docs/TESTING.md, "worker_loader.py")."""

from __future__ import annotations

import gc
import multiprocessing
import os

import pytest
from torch.utils.data import Dataset

from embedingest.engine.worker_loader import WorkerLoader, frozen_gc


class FreezeCounts(Dataset):
    """Each item: how many objects the collector of the process that reads it has frozen."""

    def __len__(self):
        return 3

    def __getitem__(self, i):
        return gc.get_freeze_count()


@pytest.fixture
def unfrozen():
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()  # whatever a failing test left


def test_workers_fork_with_the_parent_s_objects_frozen_and_the_parent_thaws_at_once(unfrozen):
    loader = WorkerLoader(FreezeCounts(), batch_size=None, num_workers=2,
                          multiprocessing_context=multiprocessing.get_context("fork"))
    it = iter(loader)
    assert gc.get_freeze_count() == 0  # the workers run, the parent's collector is back
    counts = list(it)
    assert len(counts) == 3 and min(counts) > 1000  # every object of this test process
    assert gc.get_freeze_count() == 0


def test_read_in_this_process_nothing_is_frozen(unfrozen):
    assert list(WorkerLoader(FreezeCounts(), batch_size=None, num_workers=0)) == [0, 0, 0]


class NoProcesses(type(multiprocessing.get_context("fork"))):
    """A start method under which no worker can be started (a process limit reached)."""

    @staticmethod
    def Process(*args, **kwargs):  # noqa: N802 - multiprocessing's name
        raise BlockingIOError(11, "Resource temporarily unavailable")


def test_workers_that_cannot_start_leave_the_parent_s_collector_running(unfrozen):
    loader = WorkerLoader(FreezeCounts(), batch_size=None, num_workers=2,
                          multiprocessing_context=NoProcesses())
    with pytest.raises(BlockingIOError):
        iter(loader)
    assert gc.get_freeze_count() == 0


def test_frozen_gc_freezes_inside_its_block_only(unfrozen):
    keep = [object() for _ in range(100)]
    with frozen_gc():
        assert gc.get_freeze_count() >= len(keep)
    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyError), frozen_gc():
        raise KeyError("a failure in the block")
    assert gc.get_freeze_count() == 0


def test_more_workers_than_cores_are_started_without_torch_s_warning(unfrozen, recwarn):
    """torch printed 'This DataLoader will create 4 worker processes in total. Our
    suggested max ...' raw to stderr, twice, for a --num-workers the user chose."""
    loader = WorkerLoader(FreezeCounts(), batch_size=None, num_workers=(os.cpu_count() or 1) + 2,
                          multiprocessing_context=multiprocessing.get_context("fork"))
    assert len(list(loader)) == 3
    assert [str(w.message) for w in recwarn if "DataLoader will create" in str(w.message)] == []
