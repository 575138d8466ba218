"""Scale-out, the generic part: one process per device of a host (:mod:`.procs`,
:mod:`.devices`) and merged per-device stats (:mod:`.stats`). It imports no job:
each job owns its variants (``embedingest.jobs.build_index.devices`` and ``.ray``,
``embedingest.jobs.segment.devices``).

Importing this package loads neither torch nor Ray.
"""

from .devices import child_env, parse_devices, share_of_cpus, split_by_size
from .procs import DeviceJob, run_per_device

__all__ = ["DeviceJob", "child_env", "parse_devices", "run_per_device", "share_of_cpus",
           "split_by_size"]
