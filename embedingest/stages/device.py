"""Device and precision: ``--device`` and ``--dtype`` values to torch's, with errors
that say what to pass. The one place for both rules; every job and stage asks here.

The engine sits below the stages and does not import them: it takes the device these
functions give (see :class:`~embedingest.engine.egress.EgressEngine`)."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .device_name import CHOICES, device_name

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str | torch.device) -> torch.device:
    """Accept auto (CUDA when torch sees a GPU), cpu, cuda or cuda:N (or a torch.device):
    the form by :func:`~embedingest.stages.device_name.device_name`, the GPU by torch."""
    try:
        text = device_name(name)
    except ConfigError as exc:
        if not _torch_knows(name):
            raise exc from None
        raise ConfigError(f"device={str(name)!r} is not supported; {CHOICES}") from None
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={text!r} asks for a GPU but torch sees no CUDA device; use device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device={text!r} does not exist: torch sees "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def _torch_knows(name) -> bool:
    """Whether ``name`` is a device of torch's (meta, mps, ...), if not one the jobs run on."""
    try:
        torch.device(name)
    except (RuntimeError, TypeError):
        return False
    return True


def precision(dtype: str, cuda: bool) -> str:
    """The precision a run uses: ``dtype`` as given, or for "auto" fp16 on CUDA (tensor
    cores) and fp32 elsewhere (fp16 on the CPU is slow, and for convolutions tens of
    times slower than fp32)."""
    return dtype if dtype != "auto" else ("fp16" if cuda else "fp32")


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """fp32/fp16/bf16, or "auto" (:func:`precision`), as a torch dtype for ``device``."""
    name = precision(name, torch.device(device).type == "cuda")
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype={name!r} is not one of auto, {', '.join(DTYPES)}") from None
