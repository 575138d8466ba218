"""A slot's layout: offsets, sizes and the checks of every batch against it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedingest.engine.layout import ALIGN, SlotLayout, numpy_dtype
from embedingest.errors import ConfigError


@pytest.mark.parametrize("dtype, host", [
    (torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "uint16"),
    (torch.float8_e4m3fn, "uint8"), (torch.float8_e5m2, "uint8"), (torch.int64, "int64"),
    (np.int32, "int32"), (np.dtype("<f4"), "float32"), ("float64", "float64"), ("torch.bool", "bool"),
    (torch.bool, "bool"), (torch.uint8, "uint8"),
])
def test_host_dtypes(dtype, host):
    assert numpy_dtype(dtype) == np.dtype(host)


def test_a_dtype_without_a_host_type_is_refused_by_name():
    # torch's quantized types: no numpy twin (complex32 has one once onnx is imported)
    with pytest.raises(ConfigError, match=r"dtype torch.qint8 has no host type: cast the array"):
        numpy_dtype(torch.qint8)
    with pytest.raises(ConfigError, match="dtype quaternion has no host type"):
        SlotLayout.from_spec({"x": ((2,), "quaternion")})


def test_offsets_are_page_aligned_and_sizes_exact():
    layout = SlotLayout.from_spec({"emb": ((1024, 384), torch.float16), "ids": ((1024,), np.int64),
                                   "tiny": ((1,), np.uint8), "none": ((0, 3), np.float32)})
    emb, ids, tiny, none = layout.fields
    assert (emb.name, emb.dtype, emb.shape, emb.offset, emb.nbytes) == ("emb", "<f2", (1024, 384), 0, 786432)
    assert (ids.offset, ids.nbytes) == (786432, 8192)  # 192 pages, then 2
    assert (tiny.offset, tiny.nbytes) == (786432 + 8192, 1)
    assert (none.offset, none.nbytes) == (786432 + 8192 + ALIGN, 0)
    assert layout.slot_bytes == 786432 + 8192 + 2 * ALIGN  # even an empty array takes a page
    assert all(f.offset % ALIGN == 0 for f in layout.fields)
    assert emb.source_dtype == "" and ids.source_dtype == ""


def test_raw_bits_remember_the_submitted_dtype():
    (f,) = SlotLayout.from_spec({"x": ((8, 2), torch.bfloat16)}).fields
    assert (f.dtype, f.source_dtype, f.nbytes) == ("<u2", "bfloat16", 32)


@pytest.mark.parametrize("spec, match", [
    ({}, "^a slot needs at least one array; got an empty output dict$"),
    ({"x": ((), np.float32)}, r"array 'x' has shape \(\); the engine needs a leading batch dimension"),
    ({"x": ((4, -1), np.float32)}, r"array 'x' has shape \(4, -1\)"),
    ({"x": ((4,), object)}, r"^array 'x' holds Python objects \(dtype <class 'object'>\)"),
])
def test_bad_specs_are_refused(spec, match):
    with pytest.raises(ConfigError, match=match):
        SlotLayout.from_spec(spec)


def test_field_by_name():
    layout = SlotLayout.from_spec({"a": ((2,), np.float32), "b": ((2,), np.int64)})
    assert layout.field("b").offset == ALIGN
    with pytest.raises(KeyError, match="'c'"):
        layout.field("c")


def test_lengths_take_shorter_batches_and_name_every_mismatch():
    layout = SlotLayout.from_spec({"emb": ((8, 4), np.float32), "ids": ((8,), np.int64)})
    ok = {"ids": np.zeros(3, np.int64), "emb": np.zeros((3, 4), np.float32)}
    assert layout.lengths(ok) == {"emb": 3, "ids": 3}
    assert layout.lengths({"emb": torch.zeros(8, 4), "ids": torch.zeros(0, dtype=torch.int64)}) == {"emb": 8, "ids": 0}
    cases = [
        ({"emb": ok["emb"]}, r"batch has arrays \['emb'\] but the slots were sized for \['emb', 'ids'\]"),
        ({**ok, "x": ok["ids"]}, r"batch has arrays \['emb', 'ids', 'x'\]"),
        ({**ok, "ids": np.zeros(3, np.int32)}, r"array 'ids' has dtype int32, the slots hold int64; cast"),
        ({**ok, "emb": np.zeros((3, 5), np.float32)},
         r"array 'emb' has shape \(3, 5\), the slots hold \(8, 4\) \(only the first dimension"),
        ({**ok, "emb": np.zeros((3, 4, 1), np.float32)}, r"array 'emb' has shape \(3, 4, 1\)"),
        ({**ok, "emb": np.zeros((9, 4), np.float32)},
         r"array 'emb' has 9 rows but a slot holds at most 8 \(sized from the first batch or the declared "
         r"slot_spec\); declare slot_spec with the largest batch size, or keep batches no larger$"),
    ]
    for arrays, match in cases:
        with pytest.raises(ConfigError, match=match):
            layout.lengths(arrays)


def test_views_cover_one_slot_each_in_place():
    layout = SlotLayout.from_spec({"a": ((2, 3), np.float32), "b": ((4,), np.int64)})
    buf = bytearray(layout.slot_bytes)
    views = layout.views(buf)
    assert views["a"].shape == (2, 3) and views["b"].shape == (4,)
    views["a"][:] = 1.5
    views["b"][:] = [1, 2, 3, 4]
    assert np.frombuffer(buf, np.float32, 6).tolist() == [1.5] * 6
    assert np.frombuffer(buf, np.int64, 4, offset=ALIGN).tolist() == [1, 2, 3, 4]
