"""The form of a ``--device`` value, without torch: opening an index to search imports no
torch until its query encoder loads, yet a bad device is named when the index is opened.
:func:`embedingest.stages.device.resolve_device` builds on this and asks torch what the
machine has."""

from __future__ import annotations

from ..errors import ConfigError

KINDS = ("auto", "cpu", "cuda")
CHOICES = "use auto, cuda, cuda:N or cpu"


def device_name(device) -> str:
    """``device`` (text or a ``torch.device``) as the jobs load it: auto, cuda, cuda:N or
    cpu (cpu:N is the CPU too, a name safetensors refuses)."""
    text = str(device)
    kind, colon, number = text.partition(":")
    if kind not in KINDS or (colon and (kind == "auto" or not number.isdigit())):
        raise ConfigError(f"device={text!r} is not a device; {CHOICES}")
    return "cpu" if kind == "cpu" else text
