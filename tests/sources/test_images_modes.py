"""Grey images of ranges past 16 bits, read from files as the job reads them."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from PIL import Image

from embedingest.sources import image_decode
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


def test_threads_reading_at_once_leave_pillow_s_own_pixel_limit(tmp_path):
    """Two threads in ``open_rgb`` at once (``segment_images`` in a service's thread pool):
    the second saved the limit the first had set, restored it last, and the process kept
    it: with max_pixels=0, Pillow's decompression-bomb guard was off for good."""
    own = Image.MAX_IMAGE_PIXELS
    inside, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with image_decode._pixel_limit(0):
            inside.set()
            second_in.wait(1.0)  # the second gets in now only where nothing holds it out
        first_out.set()

    def second():
        inside.wait()
        with image_decode._pixel_limit(0):
            second_in.set()
            first_out.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, own  # the next tests get Pillow's own
    assert left == own is not None


def test_a_child_forked_while_a_thread_reads_reads_too(tmp_path):
    """A DataLoader worker forked while another thread of the parent held the pixel
    limit's lock would wait on it for good: the child starts with it free."""
    Image.fromarray(np.zeros((2, 3), np.uint8)).save(tmp_path / "a.png")
    held, done = threading.Event(), threading.Event()

    def reader():
        with image_decode._pixel_limit(0):
            held.set()
            done.wait(10)

    thread = threading.Thread(target=reader)
    thread.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if open_rgb(tmp_path / "a.png")[1] == (3, 2) else 1)
        deadline = time.monotonic() + 10
        while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        if waited == (0, 0):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert waited[0] == pid and os.waitstatus_to_exitcode(waited[1]) == 0
    finally:
        done.set()
        thread.join()
