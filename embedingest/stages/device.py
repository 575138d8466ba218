"""Turn a ``--device`` value into a torch device, with errors that say what to pass."""

from __future__ import annotations

import torch

from ..errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """Accept auto (CUDA when torch sees a GPU), cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device={name!r} is not a device; use auto, cuda, cuda:N or cpu") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but torch sees no CUDA GPU; use --device cpu")
    if device.type not in ("cuda", "cpu"):
        raise ConfigError(f"device={name!r} is not supported; use auto, cuda, cuda:N or cpu")
    return device
