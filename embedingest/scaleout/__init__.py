"""Scale-out: every GPU of a host (``build-index --devices``) and a Ray cluster
(:mod:`embedingest.scaleout.ray`, imported only on demand since Ray is optional).

Importing this package loads neither torch nor Ray.
"""

from .devices import child_env, parse_devices, share_of_cpus, split_by_size
from .procs import DeviceJob, run_per_device

__all__ = ["DeviceJob", "child_env", "parse_devices", "run_per_device", "share_of_cpus",
           "split_by_size"]
