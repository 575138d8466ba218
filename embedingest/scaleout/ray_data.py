"""Generic helpers for jobs that run over a Ray Dataset (Ray is optional: import this
module only where Ray is installed)."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0, max_restarts=0)
class NumberBlocks:
    """Hands out blocks of consecutive integers, each number once: the tasks of a
    Dataset ask for a block per batch instead of one round trip per row.

    It never restarts (a restarted one would count from ``first`` again and hand out
    numbers twice): when it dies, the tasks that ask it fail, and so does the run."""

    def __init__(self, first: int, last: int):
        self.next, self.last = first, last

    def take(self, n: int) -> int:
        """The first of ``n`` numbers no one got before; ValueError past ``last``."""
        start = self.next
        if start + n - 1 > self.last:
            raise ValueError(f"{n} numbers from {start} would pass {self.last}")
        self.next += n
        return start


def number_blocks(first: int, last: int):
    """A :class:`NumberBlocks` actor on the driver's node (a node that leaves the cluster
    takes its actors with it; the driver's stays as long as the run)."""
    here = ray.get_runtime_context().get_node_id()
    return NumberBlocks.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote(first, last)
