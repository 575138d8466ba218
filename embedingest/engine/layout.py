"""The layout of one host slot: which arrays it holds, their dtypes, shapes and offsets.

A layout is fixed when the pool is made (from the first batch, or declared up front),
so every later batch is checked against it: a shorter leading dimension is fine (the
last batch of a dataset), anything else is a clear error naming both sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

ALIGN = 4096  # page aligned, so each array starts on its own page (DMA friendly)

# torch dtypes without a numpy twin travel as raw bits of the same width.
RAW_BITS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def named_arrays(outputs) -> dict:
    """What ``submit`` takes (one array, or a mapping of names to arrays) as a dict of
    names to arrays, each checked to be an array (a tensor or a numpy array): a list or a
    number is refused naming it."""
    arrays = dict(outputs) if isinstance(outputs, Mapping) else {"out": outputs}
    for name, value in arrays.items():
        if not isinstance(name, str):  # the slot layout names them with text: 1 never matched '1'
            raise ConfigError(f"output name {name!r} is of type {type(name).__name__}; name outputs with text "
                              f"(e.g. {str(name)!r})")
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise ConfigError(f"output {name!r} is a {type(value).__name__}; submit a torch tensor or "
                              f"a numpy array (or a dict of them)")
    return arrays


def numpy_dtype(dtype) -> np.dtype:
    """Map a torch or numpy dtype (or its name, or a numpy scalar type such as
    ``np.float32``) to the numpy dtype used on the host."""
    name = str(dtype).replace("torch.", "")
    if name in RAW_BITS:
        return np.dtype(RAW_BITS[name])
    for candidate in (dtype, name):
        try:
            return np.dtype(candidate)
        except TypeError:
            continue
    raise ConfigError(f"dtype {dtype} has no host type: cast the array to a numpy type "
                      f"(bfloat16 and float8 travel as raw bits) before submit")


@dataclass(frozen=True)
class Field:
    name: str
    dtype: str  # numpy dtype string of the host array
    shape: tuple[int, ...]  # full slot shape; shape[0] is the batch capacity
    offset: int
    source_dtype: str = ""  # the submitted dtype's name when it differs (bfloat16 -> uint16 bits)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class SlotLayout:
    fields: tuple[Field, ...]
    slot_bytes: int

    @classmethod
    def from_spec(cls, spec: Mapping[str, tuple[tuple[int, ...], object]]) -> SlotLayout:
        """Build from ``{name: (shape, dtype)}``; shape[0] is the largest batch."""
        if not spec:
            raise ConfigError("a slot needs at least one array; got an empty output dict")
        fields, offset = [], 0
        for name, (shape, dtype) in spec.items():
            shape = tuple(int(s) for s in shape)
            if not shape or any(s < 0 for s in shape):
                raise ConfigError(f"array {name!r} has shape {shape}; the engine needs a "
                                  "leading batch dimension (a 0-d value cannot be sliced)")
            if numpy_dtype(dtype).hasobject:
                raise ConfigError(f"array {name!r} holds Python objects (dtype {dtype}), which cannot "
                                  f"be copied to another process; submit numbers or fixed-width bytes")
            source = str(dtype).replace("torch.", "")
            f = Field(str(name), numpy_dtype(dtype).str, shape, offset,
                      source if source in RAW_BITS else "")
            fields.append(f)
            offset += -(-max(f.nbytes, 1) // ALIGN) * ALIGN
        return cls(tuple(fields), offset)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def lengths(self, arrays: Mapping[str, object]) -> dict[str, int]:
        """Check a batch against the layout and return each array's leading length."""
        names = [f.name for f in self.fields]
        if sorted(arrays) != sorted(names):
            raise ConfigError(f"batch has arrays {sorted(arrays)} but the slots were sized "
                              f"for {sorted(names)}; submit the same names every time")
        out = {}
        for f in self.fields:
            a = arrays[f.name]
            shape, dtype = tuple(a.shape), numpy_dtype(a.dtype)
            if dtype != np.dtype(f.dtype):
                raise ConfigError(f"array {f.name!r} has dtype {a.dtype}, the slots hold "
                                  f"{np.dtype(f.dtype)}; cast it before submit")
            if len(shape) != len(f.shape) or shape[1:] != f.shape[1:]:
                raise ConfigError(f"array {f.name!r} has shape {shape}, the slots hold "
                                  f"{f.shape} (only the first dimension may be smaller)")
            if shape[0] > f.shape[0]:
                raise ConfigError(
                    f"array {f.name!r} has {shape[0]} rows but a slot holds at most "
                    f"{f.shape[0]} (sized from the first batch or the declared slot_spec); "
                    "declare slot_spec with the largest batch size, or keep batches no larger")
            out[f.name] = shape[0]
        return out

    def views(self, buf) -> dict[str, np.ndarray]:
        """Numpy views of every array of one slot over ``buf`` (a buffer of slot_bytes)."""
        return {f.name: np.frombuffer(buf, dtype=f.dtype, count=int(np.prod(f.shape)),
                                      offset=f.offset).reshape(f.shape)
                for f in self.fields}
