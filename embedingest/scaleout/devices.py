"""Which devices a run uses and how its work is split between them.

Shared by every job that runs one process per device: the parent parses ``--devices``,
splits its inputs with :func:`split_by_size` and starts the processes with
:func:`~embedingest.scaleout.procs.run_per_device`, each seeing only its own GPU
(:func:`child_env`), so CUDA contexts, pinned memory and NVML samples stay on it.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence

from ..errors import ConfigError


def parse_devices(spec: str) -> list[str]:
    """``"all"``, ``"0,1"``, ``"cuda:0,cuda:1"``, ``"cpu,cpu"`` -> torch device names.

    A GPU may be named twice (two processes share it); CPU and GPUs cannot be mixed,
    because the index records one precision for all its vectors.
    """
    spec = (spec or "").strip()
    if not spec:
        return []
    if spec == "all":
        count = _cuda_count()
        if count == 0:
            raise ConfigError("devices='all' but torch sees no CUDA GPU; give CPU processes "
                              "as devices='cpu,cpu' or leave devices out")
        return [f"cuda:{i}" for i in range(count)]
    names = []
    for part in (p.strip() for p in spec.split(",")):
        if part == "cpu":
            names.append("cpu")
            continue
        number = part.removeprefix("cuda:")
        if not number.isdigit():
            raise ConfigError(f"devices={spec!r}: {part!r} is not a device; use 'all', GPU "
                              "numbers such as '0,1', 'cuda:0,cuda:1' or 'cpu,cpu'")
        names.append(f"cuda:{int(number)}")
    gpus = [int(n.split(":")[1]) for n in names if n != "cpu"]
    if gpus and len(gpus) != len(names):
        raise ConfigError(f"devices={spec!r} mixes CPU and GPUs; use GPUs only or 'cpu' only")
    if gpus:
        count = _cuda_count()
        if count == 0:
            raise ConfigError(f"devices={spec!r} but torch sees no CUDA GPU; use 'cpu,cpu' "
                              "for CPU processes")
        if max(gpus) >= count:
            raise ConfigError(f"devices={spec!r}: there is no GPU {max(gpus)}; torch sees "
                              f"{count}, numbered 0..{count - 1}")
    return names


def _cuda_count() -> int:
    """The GPUs torch sees, counted through NVML where it can, which (unlike
    ``torch.cuda.is_available()``) leaves CUDA uninitialised in this process, so the
    device processes can be forked."""
    import torch

    return torch.cuda.device_count()


def devices_of(config) -> list[str]:
    """The devices of a job config's ``devices`` (several: one process each), [] when
    the job runs on its one ``device``; both given is an error naming them."""
    if not config.devices:
        return []
    if config.device not in ("auto", "", None):
        raise ConfigError(f"device={config.device!r} and devices={config.devices!r} are both given; "
                          "use devices alone (devices=cuda:1 for one GPU)")
    return parse_devices(config.devices)


def child_env(device: str) -> tuple[dict[str, str], str]:
    """The environment and device name for the process of ``device``: a GPU becomes the
    only visible one (``cuda:0`` inside), translated through the parent's own
    ``CUDA_VISIBLE_DEVICES`` when it has one."""
    if device == "cpu":
        return {}, "cpu"
    index = int(device.split(":")[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",")[index].strip() if visible else str(index)
    return {"CUDA_VISIBLE_DEVICES": physical}, "cuda:0"


def split_by_size(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``parts`` groups of nearly equal total size.

    Largest first onto the lightest group (within 4/3 of the best split), so one big file
    does not leave a device idle at the end; each group keeps the input order.
    """
    if parts < 1:
        raise ConfigError(f"cannot split work into {parts} parts")
    heap = [(0, p) for p in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: -max(int(sizes[i] or 0), 1)):
        load, p = heapq.heappop(heap)
        groups[p].append(i)
        heapq.heappush(heap, (load + max(int(sizes[i] or 0), 1), p))
    return [sorted(g) for g in groups]


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's
    share), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_of_cpus(per_process: int, processes: int = 1) -> int:
    """Loader workers per device process: ``per_process`` when given (>= 0), else the
    usable cores shared out, two kept per process for its main thread (with the
    pin-memory thread) and consumers; tokenizing is the host's heaviest work."""
    if per_process >= 0:
        return per_process
    return max(1, min(32, (usable_cpus() - 2 * processes) // processes))
