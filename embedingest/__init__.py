"""embedingest: run models on a GPU over large batches and get their outputs off the GPU
without starving it.

The engine is importable on its own; the jobs (``build_index``, ``build_index_ray``,
``segment``) and the index reader (``open_index``) are imported lazily so ``import
embedingest`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "EgressEngine": "embedingest.engine.egress",
    "EngineStats": "embedingest.engine.telemetry",
    "EngineConfig": "embedingest.config",
    "build_index": "embedingest.jobs.build_index",
    "build_index_ray": "embedingest.jobs.build_index.ray",
    "IndexConfig": "embedingest.config",
    "open_index": "embedingest.index.search",
    "segment": "embedingest.jobs.segment",
    "segment_images": "embedingest.jobs.segment",
    "SegmentConfig": "embedingest.config",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'embedingest' has no attribute {name!r}")
