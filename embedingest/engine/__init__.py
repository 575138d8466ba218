"""The generic egress engine: pinned shared host slots, an egress stream, consumers."""

from .egress import EgressEngine
from .telemetry import BatchRecord, EngineStats

__all__ = ["EgressEngine", "EngineStats", "BatchRecord"]
