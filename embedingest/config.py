"""Settings as dataclasses, presets as TOML.

Every job takes one dataclass; every CLI option maps one-to-one onto a field of it
(``--num-consumers`` is ``num_consumers``), and ``--config preset.toml`` fills the same
fields from a file, with options given on the command line winning.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")


@dataclass
class EngineConfig:
    """How outputs leave the GPU and reach the sinks."""

    # Consumer processes that run the sink; each builds its own sink (one FAISS shard each).
    num_consumers: int = 4
    # Host buffer slots in the pinned pool; 0 means twice the consumers. Memory used is
    # slots x the size of one batch's outputs, whatever the speed of the consumers.
    num_slots: int = 0
    # Seconds a consumer gets to finish and close its sink when the run is stopped early.
    shutdown_timeout: float = 5.0
    # Register the host pool with CUDA (page-locked); turn off only to measure the difference.
    pin_memory: bool = True

    def slots(self) -> int:
        return self.num_slots or max(2, 2 * self.num_consumers)


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Build ``cls`` from an optional TOML preset, then ``overrides`` (None values are ignored).

    Unknown keys are an error naming the key and the fields that exist, so a typo in a
    preset never passes silently.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                values.update(tomllib.load(fh))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config preset {str(path)!r}: {exc}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}; "
            f"known settings are: {', '.join(sorted(names))}")
    return cls(**values)
