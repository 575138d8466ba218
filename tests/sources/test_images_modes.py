"""Grey images of ranges past 16 bits, read from files as the job reads them."""

from __future__ import annotations

import numpy as np
from PIL import Image

from embedingest.sources.image_decode import open_rgb, to_rgb


def test_a_32_bit_or_signed_grey_tiff_is_stretched_not_clipped_to_one_colour(tmp_path):
    """A 32-bit integer TIFF (Pillow's mode "I") was scaled as 0..65535: every value over
    it became white, a whole image of one colour; a signed one lost its negatives to black."""
    wide = np.array([[0, 2**29, 2**30, 2**31 - 1]], dtype=np.int32)
    Image.fromarray(wide).save(tmp_path / "wide.tif")
    signed = np.array([[-32768, -1, 0, 32767]], dtype=np.int32)
    Image.fromarray(signed).save(tmp_path / "signed.tif")
    for name, expected in (("wide.tif", [0, 64, 128, 255]), ("signed.tif", [0, 127, 128, 255])):
        im, size = open_rgb(tmp_path / name)
        assert Image.open(tmp_path / name).mode == "I" and size == (4, 1)
        assert np.asarray(im)[0, :, 0].tolist() == expected, name
    sixteen = np.array([[0, 257, 65535]], dtype=np.int32)  # within 0..65535: scaled as before
    assert np.asarray(to_rgb(Image.fromarray(sixteen)))[0, :, 0].tolist() == [0, 1, 255]


def test_an_infinity_in_a_float_image_is_its_end_of_the_range_not_the_range():
    """An infinity made the stretch's top ~3e38, so every finite value became 0."""
    a = np.array([[0.0, 0.5, 1.0, np.inf, -np.inf, np.nan]], dtype=np.float32)
    assert np.asarray(to_rgb(Image.fromarray(a)))[0, :, 0].tolist() == [0, 128, 255, 255, 0, 0]
