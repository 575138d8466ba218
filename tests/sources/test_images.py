"""Image decoding: every mode to RGB, EXIF rotation, the preset's resize and the letterbox,
bad files as reasons, regrouping by shape."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps
from segment_fixtures import SIZE, bad_files, exif_rotated_jpeg, image_tensor, image_tree, noise
from torch.utils.data import DataLoader
from torchvision.transforms import functional as TF
from torchvision.transforms.functional import _compute_resized_output_size

from embedingest.sources.image_decode import (LONG_SIDE_LIMIT, PAD_RGB, ImageMeta, ImageRejected,
                                              Preprocessing, content_size, header_size, open_rgb,
                                              short_side_size, to_rgb)
from embedingest.sources.images import (IMAGE_EXTENSIONS, BadImage, BatchJoiner, ChunkPlace, ImageBatch,
                                        ImageFileDataset, LoadedImage, collate_images, prepare_file,
                                        prepare_picture, regroup)

FIT = Preprocessing("fit", SIZE)
SHORT = Preprocessing("short", SIZE)


def test_extensions():
    assert IMAGE_EXTENSIONS == {".jpg", ".jpeg", ".jfif", ".jpe", ".png", ".webp", ".bmp", ".tif", ".tiff",
                                ".gif", ".avif"}


def test_a_jpeg_named_jfif_or_jpe_is_read(tmp_path):
    for name in ("a.jfif", "b.JPE"):
        Image.fromarray(noise(20, 30)).save(tmp_path / name, "JPEG")
        pixels, meta = prepare_file(name, str(tmp_path / name), FIT)
        assert (meta.width, meta.height) == (30, 20)


def test_avif_decodes_where_pillow_reads_it(tmp_path):
    from PIL import features

    if not features.check("avif"):
        pytest.skip("this Pillow has no AVIF support")
    Image.fromarray(np.full((30, 40, 3), 200, np.uint8)).save(tmp_path / "a.avif")
    im, size = open_rgb(tmp_path / "a.avif")
    assert size == (40, 30) and im.mode == "RGB" and abs(int(np.asarray(im).mean()) - 200) < 8


def test_animated_gif_is_its_first_frame(tmp_path):
    frames = [Image.fromarray(np.full((30, 40, 3), v, np.uint8)) for v in (0, 255)]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:])
    im, size = open_rgb(tmp_path / "a.gif")
    assert size == (40, 30) and im.mode == "RGB" and np.asarray(im).max() == 0


@pytest.mark.parametrize("width,height,expect", [
    (100, 50, (64, 32)), (50, 100, (32, 64)), (64, 64, (64, 64)), (10, 10, (64, 64)),
    (6400, 1, (64, 1)),
])
def test_content_size_keeps_aspect(width, height, expect):
    assert content_size(width, height, 64) == expect


def test_every_kind_decodes_with_its_own_size(tmp_path):
    sizes = image_tree(tmp_path)
    files = [(rel, str(tmp_path / rel)) for rel in sizes]
    ds = ImageFileDataset(files, FIT)
    for i, (rel, (w, h)) in enumerate(sizes.items()):
        item = ds[i]
        assert isinstance(item, LoadedImage), (rel, item)
        assert item.pixels.dtype == torch.uint8 and item.pixels.shape == (SIZE, SIZE, 3)
        meta = item.meta
        assert (meta.rel_path, meta.width, meta.height) == (rel, w, h)
        cw, ch = content_size(w, h, SIZE)
        assert (meta.content_width, meta.content_height) == (cw, ch)
        pad = item.pixels.numpy()
        assert (pad[ch:] == PAD_RGB).all() and (pad[:, cw:] == PAD_RGB).all()
    short = ImageFileDataset(files, SHORT)
    for i, (rel, (w, h)) in enumerate(sizes.items()):
        item = short[i]
        assert item.pixels.shape == (h, w, 3), rel  # the whole picture: the device resizes it
        assert (item.meta.content_width, item.meta.content_height) == short_side_size(w, h, SIZE)


@pytest.mark.parametrize("width,height", [(90, 60), (60, 90), (64, 64), (33, 100), (301, 80), (20, 20)])
def test_short_mode_hands_over_torchvisions_picture(tmp_path, width, height):
    """The workers' picture is what torchvision's own decoder reads; the model input size
    is the preset's Resize of it (the resize itself: tests/stages/test_segmentation.py)."""
    Image.fromarray(noise(height, width, seed=width)).save(tmp_path / "a.png")
    pixels, meta = prepare_file("a.png", str(tmp_path / "a.png"), SHORT)
    assert pixels.dtype == torch.uint8 and torch.equal(pixels.permute(2, 0, 1), image_tensor(tmp_path / "a.png"))
    assert (meta.width, meta.height) == (width, height)
    expect = TF.resize(image_tensor(tmp_path / "a.png"), [SIZE], antialias=True)
    assert (meta.content_height, meta.content_width) == tuple(expect.shape[1:])


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(32, 1024))
def test_short_side_size_is_torchvisions(width, height, size):
    expect_h, expect_w = _compute_resized_output_size((height, width), [size], LONG_SIDE_LIMIT * size)
    assert short_side_size(width, height, size, LONG_SIDE_LIMIT * size) == (max(1, expect_w), max(1, expect_h))
    expect_h, expect_w = _compute_resized_output_size((height, width), [size])
    assert short_side_size(width, height, size) == (expect_w, expect_h)


def test_large_pictures_are_resized_in_the_worker_by_the_same_call(tmp_path):
    """Over 16 x size^2 pixels the worker resizes: exactly the preset's Resize."""
    Image.fromarray(noise(300, 280, seed=5)).save(tmp_path / "big.png")
    assert 300 * 280 > SHORT.device_resize_max_pixels
    pixels, meta = prepare_file("big.png", str(tmp_path / "big.png"), SHORT)
    expect = TF.resize(image_tensor(tmp_path / "big.png"), [SIZE], antialias=True)
    assert torch.equal(pixels.permute(2, 0, 1), expect) and pixels.is_contiguous()
    assert (meta.width, meta.height, meta.content_width, meta.content_height) == (280, 300, SIZE, 68)


def test_panoramas_are_capped_at_the_long_side_limit(tmp_path):
    Image.fromarray(noise(10, 100, seed=1)).save(tmp_path / "pano.png")
    pixels, meta = prepare_file("pano.png", str(tmp_path / "pano.png"), SHORT)
    assert (meta.content_height, meta.content_width) == (SIZE * 10 * LONG_SIDE_LIMIT // 100, SIZE * LONG_SIDE_LIMIT)
    assert SHORT.max_size == LONG_SIDE_LIMIT * SIZE and FIT.max_size is None


def test_sixteen_bit_is_scaled_not_clipped(tmp_path):
    a = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    Image.fromarray(a).save(tmp_path / "d.png")
    im, _ = open_rgb(tmp_path / "d.png")
    assert np.asarray(im)[0, :, 0].tolist() == [0, 1, 128, 255]
    as_int32 = to_rgb(Image.fromarray(a.astype(np.int32)))  # mode "I", as older Pillow reads them
    assert np.asarray(as_int32)[0, :, 1].tolist() == [0, 1, 128, 255]


def test_float_image_is_stretched():
    im = to_rgb(Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)))
    assert np.asarray(im)[0, :, 2].tolist() == [0, 128, 255]


def test_grey_palette_and_alpha_become_rgb():
    grey = to_rgb(Image.fromarray(np.full((2, 2), 77, np.uint8)))
    assert grey.mode == "RGB" and (np.asarray(grey) == 77).all()
    pal = Image.new("P", (2, 1))
    pal.putpalette([10, 20, 30, 200, 100, 50])
    pal.putpixel((1, 0), 1)
    assert np.asarray(to_rgb(pal))[0].tolist() == [[10, 20, 30], [200, 100, 50]]
    rgba = np.zeros((1, 2, 4), np.uint8)
    rgba[0, 0] = (0, 0, 0, 0)         # fully transparent: the background shows
    rgba[0, 1] = (10, 200, 30, 255)   # opaque: the colour stays
    assert np.asarray(to_rgb(Image.fromarray(rgba)))[0].tolist() == [[255, 255, 255], [10, 200, 30]]


def test_exif_rotation_is_applied(tmp_path):
    pixels, meta = prepare_file("r.jpg", str(exif_rotated_jpeg(tmp_path / "r.jpg", 48, 24)), FIT)
    assert (meta.width, meta.height) == (24, 48)
    assert (meta.content_width, meta.content_height) == (32, 64)
    pixels = pixels.numpy()
    top, bottom = pixels[4, 16].astype(int), pixels[60, 16].astype(int)
    assert top[0] > 200 and top[2] < 60, "orientation 6 turns the red left half to the top"
    assert bottom[2] > 200 and bottom[0] < 60


@pytest.mark.parametrize("orientation", [1, 3, 5, 6, 7, 8])
def test_a_rotated_tiff_keeps_its_upright_size(tmp_path, orientation):
    """Pillow 11.2+ reports a rotated TIFF's size already upright and turns its pixels on
    load; the size was turned a second time, so a 160x90 TIFF of orientation 6 (shown
    90x160) got a 160x90 mask and its overlay stopped the run."""
    a = np.zeros((90, 160, 3), np.uint8)
    a[:, :80] = (255, 0, 0)
    Image.fromarray(a).save(tmp_path / "r.tif", tiffinfo={0x0112: orientation})
    upright = _turned(a, orientation)
    im, size = open_rgb(tmp_path / "r.tif")
    assert size == im.size == header_size(tmp_path / "r.tif") == upright.shape[1::-1]
    assert np.array_equal(np.asarray(im), upright)
    _, meta = prepare_file("r.tif", str(tmp_path / "r.tif"), SHORT)
    assert (meta.width, meta.height) == upright.shape[1::-1]


def _turned(a: np.ndarray, orientation: int) -> np.ndarray:
    """``a`` as a viewer shows it under EXIF ``orientation`` (from a JPEG's, which Pillow
    turns after load in every version)."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG", exif=exif.tobytes())
    return np.asarray(ImageOps.exif_transpose(Image.open(buf)))


def test_large_jpeg_keeps_its_full_size_when_drafted(tmp_path):
    Image.fromarray(noise(768, 1024, seed=3)).save(tmp_path / "big.jpg", quality=80)
    pixels, meta = prepare_file("big.jpg", str(tmp_path / "big.jpg"), FIT)
    assert (meta.width, meta.height, meta.content_width, meta.content_height) == (1024, 768, 64, 48)
    _, meta = prepare_file("big.jpg", str(tmp_path / "big.jpg"), SHORT)
    assert (meta.width, meta.height, meta.content_width, meta.content_height) == (1024, 768, 85, 64)


def test_bad_files_become_reasons(tmp_path):
    expected = bad_files(tmp_path)
    ds = ImageFileDataset([(rel, str(tmp_path / rel)) for rel in expected], SHORT)
    for i, (rel, kind) in enumerate(expected.items()):
        item = ds[i]
        assert isinstance(item, BadImage), rel
        assert item.rel_path == rel and item.reason
        if kind:
            assert item.reason.startswith(kind + ":"), (rel, item.reason)


def test_a_file_of_no_image_format_is_named_without_python_s_words_and_pillow_warns_nothing(tmp_path, recwarn):
    """The reason said 'cannot identify image file <_io.BufferedReader name=...>'; a large
    image under max_pixels printed Pillow's DecompressionBombWarning to stderr."""
    (tmp_path / "text.jpg").write_bytes(b"hello")
    with pytest.raises(ImageRejected) as err:
        open_rgb(tmp_path / "text.jpg")
    assert err.value.reason == "not an image: Pillow recognises no image format in it"
    Image.new("L", (10_000, 9_000)).save(tmp_path / "big.png")  # over Pillow's own 89.5M pixels
    assert open_rgb(tmp_path / "big.png", max_pixels=100_000_000)[1] == (10_000, 9_000)
    assert [w for w in recwarn if "PIL" in str(w.filename) or "Pillow" in str(w.message)] == []


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ImageRejected, match="^unreadable: .*No such file"):
        open_rgb(tmp_path / "gone.png")
    Image.fromarray(noise(8, 8)).save(tmp_path / "locked.png")
    (tmp_path / "locked.png").chmod(0)
    if os.access(tmp_path / "locked.png", os.R_OK):
        pytest.skip("running as root: permissions are not enforced")
    with pytest.raises(ImageRejected, match="^unreadable: .*Permission denied"):
        open_rgb(tmp_path / "locked.png")


def test_pixel_limit_rejects_with_reason_and_restores_pillow(tmp_path):
    Image.fromarray(noise(100, 100)).save(tmp_path / "a.png")
    saved = Image.MAX_IMAGE_PIXELS
    for limit, size in ((5000, "100x100 = 10000 pixels"), (1000, "10000 pixels")):
        # 1000: over twice the limit, Pillow itself refuses (its text named twice the limit)
        with pytest.raises(ImageRejected) as err:
            open_rgb(tmp_path / "a.png", max_pixels=limit)
        assert err.value.reason == f"too large: {size} is over max_pixels={limit}; raise --max-pixels to read it"
    assert Image.MAX_IMAGE_PIXELS == saved
    assert open_rgb(tmp_path / "a.png", max_pixels=0)[1] == (100, 100)


def test_loader_drops_bad_files_and_carries_them(tmp_path):
    sizes = image_tree(tmp_path / "good")
    bad = bad_files(tmp_path)
    files = [(rel, str(tmp_path / "good" / rel)) for rel in sizes] + \
            [(rel, str(tmp_path / rel)) for rel in bad]
    loader = DataLoader(ImageFileDataset(files, SHORT), batch_size=4, num_workers=2,
                        collate_fn=collate_images)
    good, dropped = [], []
    for batch in loader:
        for pixels, metas, hw in batch.groups:
            assert pixels.shape[0] == len(metas)
            assert all(pixels.shape[1:3] == (m.height, m.width) for m in metas)
            assert all(hw == (m.content_height, m.content_width) for m in metas)
        good += [m.rel_path for m in batch.items]
        dropped += [b.rel_path for b in batch.bad]
    assert sorted(good) == sorted(sizes) and dropped == list(bad)
    all_bad = collate_images([BadImage("x", "x", "empty file: 0 bytes")])
    assert all_bad.groups == [] and len(all_bad) == 0 and len(all_bad.bad) == 1


def test_a_chunk_crosses_to_the_main_process_as_one_buffer():
    """Each group was a tensor of its own: for photographs of varied sizes, one shared-memory
    segment (made, sent, mapped) per picture; now one per chunk, each group a view of it."""
    pictures = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8) for h, w in
                ((30, 40), (30, 40), (50, 20), (30, 40), (7, 9))]
    samples = [LoadedImage(p, ImageMeta(str(i), "", p.shape[1], p.shape[0], p.shape[1], p.shape[0]), i)
               for i, p in enumerate(pictures)]
    batch = collate_images(samples[:2] + [BadImage("b", "", "empty file: 0 bytes", 9)] + samples[2:])
    assert [(tuple(px.shape), [m.rel_path for m in metas]) for px, metas, _ in batch.groups] == [
        ((3, 30, 40, 3), ["0", "1", "3"]), ((1, 50, 20, 3), ["2"]), ((1, 7, 9, 3), ["4"])]
    assert len({px.untyped_storage().data_ptr() for px, _, _ in batch.groups}) == 1
    assert batch.groups[0][0].untyped_storage().nbytes() == sum(p.numel() for p in pictures)
    queue = torch.multiprocessing.get_context("spawn").SimpleQueue()
    queue.put(batch)  # as a worker hands it over: shared memory, then rebuilt here
    got = queue.get()
    by_name = {m.rel_path: px[k] for px, metas, _ in got.groups for k, m in enumerate(metas)}
    assert all(torch.equal(by_name[str(i)], p) for i, p in enumerate(pictures))
    assert [b.rel_path for b in got.bad] == ["b"] and got.first == 0


@pytest.mark.needs_cuda
def test_a_chunk_is_pinned_as_one_buffer():
    pictures = [torch.randint(0, 256, (h, w, 3), dtype=torch.uint8) for h, w in ((30, 40), (50, 20), (30, 40))]
    batch = collate_images([LoadedImage(p, ImageMeta(str(i), "", p.shape[1], p.shape[0], p.shape[1],
                                                     p.shape[0]), i) for i, p in enumerate(pictures)])
    pinned = batch.pin_memory()
    assert all(px.is_pinned() for px, _, _ in pinned.groups)
    assert len({px.untyped_storage().data_ptr() for px, _, _ in pinned.groups}) == 1
    assert torch.equal(pinned.groups[0][0], torch.stack([pictures[0], pictures[2]]))
    assert torch.equal(pinned.groups[1][0][0], pictures[1])


def _chunk(shapes: list[tuple[int, int]], start: int, bad: int = 0) -> ImageBatch:
    """A decoded chunk of dataset indices ``start``, ``start + 1``...: the images of
    ``shapes`` (each filled with its index), then ``bad`` bad ones."""
    samples = [LoadedImage(torch.full((h, w, 3), start + i, dtype=torch.uint8),
                           ImageMeta(f"{start + i}", "", w, h, w, h), start + i)
               for i, (h, w) in enumerate(shapes)]
    samples += [BadImage(f"bad{start + i}", "", "empty file: 0 bytes", start + i)
                for i in range(len(shapes), len(shapes) + bad)]
    return collate_images(samples)


def _planned(plan, bads) -> tuple[list[ImageBatch], dict[int, ChunkPlace]]:
    """``plan``: batches, each a list of chunks, each a list of image shapes; each chunk
    gets ``bads[k]`` bad images too (at least one where it has no shapes: the sampler
    never makes an empty chunk). The chunks in planned order and where each goes."""
    made, places, start = [], {}, 0
    for number, batch in enumerate(plan):
        for part, shapes in enumerate(batch):
            chunk = _chunk(shapes, start, max(bads[len(made) % len(bads)], 0 if shapes else 1))
            places[chunk.first] = ChunkPlace(number, part, len(batch))
            made.append(chunk)
            start += len(chunk) + len(chunk.bad)
    return made, places


def _described(batches) -> list[tuple[list[str], list[str]]]:
    return [([m.rel_path for m in b.items], [x.rel_path for x in b.bad]) for b in batches]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.lists(st.sampled_from([(4, 6), (6, 4)]), max_size=3),
                         min_size=1, max_size=3), max_size=6),
       st.lists(st.integers(0, 2), min_size=18, max_size=18), st.randoms(use_true_random=False))
def test_regroup_gives_the_planned_batches_as_their_last_chunk_comes(plan, bads, rng):
    """The chunks come in any order (as the workers finish them): each batch goes as
    planned the moment its last chunk comes, the same batches as in order, and only the
    chunks of incomplete batches wait. A header may have been wrong, so one planned
    batch can hold two shapes: it goes as one batch per shape. Bad images go with the
    batch they were planned in."""
    made, places = _planned(plan, bads)
    batch_of = [places[chunk.first].batch for chunk in made]
    order = list(range(len(made)))
    rng.shuffle(order)
    asked = []

    def place(first):
        asked.append(first)
        return places[first]

    joiner = BatchJoiner(place)
    got, arrived = [], set()
    for step, k in enumerate(order):
        got += [(step, batch) for batch in joiner.add(made[k])]
        arrived.add(k)
        incomplete = {batch_of[j] for j in arrived
                      if any(batch_of[i] == batch_of[j] and i not in arrived for i in range(len(made)))}
        assert set(joiner.waiting) == incomplete
        assert joiner.held == sum(batch_of[j] in incomplete for j in arrived)
    assert not joiner.waiting and joiner.held == 0, "the buffer empties"
    assert sorted(asked) == sorted(places), "each chunk placed once"
    planned = []
    for number, batch in enumerate(plan):
        ks = [k for k in range(len(made)) if batch_of[k] == number]
        last = max(order.index(k) for k in ks)
        images = [i for k in ks for i in made[k].items]
        bad = [b.rel_path for k in ks for b in made[k].bad]
        shapes = list(dict.fromkeys((m.content_height, m.content_width) for m in images))
        for n, shape in enumerate(shapes or [None]):
            of_shape = [m.rel_path for m in images if (m.content_height, m.content_width) == shape]
            planned.append((last, of_shape, bad if n == 0 else []))
    in_order = list(regroup(iter(made), places.__getitem__))
    assert _described(in_order) == [(images, bad) for _, images, bad in planned]
    # each as soon as its last chunk came (sorted stably: one batch's shapes keep their order)
    assert [(step, *_described([batch])[0]) for step, batch in got] == sorted(planned, key=lambda p: p[0])
    for _, batch in got:
        for pixels, metas, hw in batch.groups:
            for image, meta in zip(pixels, metas, strict=True):
                assert int(image[0, 0, 0]) == int(meta.rel_path), "pixels stay with their meta"
                assert image.shape[:2] == hw == (meta.content_height, meta.content_width)


def test_regroup_gives_a_batch_of_bad_images_alone_with_its_reasons():
    made, places = _planned([[[(4, 6)]], [[], []], [[(4, 6)]]], [0, 2, 1, 0])
    assert _described(made[1:3]) == [([], ["bad1", "bad2"]), ([], ["bad3"])]
    want = [(["0"], []), ([], ["bad1", "bad2", "bad3"]), (["4"], [])]
    got = list(regroup(iter(made), places.__getitem__))
    assert _described(got) == want and got[1].groups == [] and len(got[1]) == 0
    shuffled = list(regroup(iter([made[2], made[3], made[1], made[0]]), places.__getitem__))
    assert _described(shuffled) == [want[2], want[1], want[0]]


def test_regroup_refuses_chunks_that_end_inside_a_batch():
    with pytest.raises(RuntimeError, match="inside a planned batch"):
        list(regroup(iter([_chunk([(4, 6)], 0)]), lambda first: ChunkPlace(0, 0, 2)))
    with pytest.raises(RuntimeError, match="inside a planned batch"):  # bad images only
        list(regroup(iter([_chunk([], 0, bad=1)]), lambda first: ChunkPlace(0, 1, 2)))


def test_prepare_picture_accepts_arrays_and_pil():
    _, meta = prepare_picture(noise(30, 40), FIT)
    assert (meta.width, meta.height) == (40, 30)
    _, meta = prepare_picture(noise(30, 40, channels=1, dtype=np.uint16), SHORT)
    assert (meta.width, meta.height) == (40, 30)
    _, meta = prepare_picture(Image.new("LA", (5, 9)), SHORT)
    assert (meta.width, meta.height) == (5, 9)
    with pytest.raises(ImageRejected, match="float64"):
        prepare_picture(np.zeros((4, 4, 3)), SHORT)


def test_an_image_swapped_for_a_link_out_of_the_input_folder_is_not_decoded(tmp_path):
    """A listed picture swapped for a link to one outside the input folder before its
    decoder reads it is a bad image with the walk's reason, not pixels."""
    images, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    images.mkdir()
    elsewhere.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "own.png")
    Image.fromarray(noise(20, 30, seed=1)).save(elsewhere / "private.png")
    (images / "swapped.png").symlink_to(elsewhere / "private.png")
    files = [("own.png", str(images / "own.png")), ("swapped.png", str(images / "swapped.png"))]
    ds = ImageFileDataset(files, SHORT, within=os.path.realpath(images))
    assert isinstance(ds[0], LoadedImage)
    bad = ds[1]
    assert isinstance(bad, BadImage)
    assert bad.reason == ("symbolic link out of the input folder: to "
                          f"{os.path.realpath(elsewhere / 'private.png')}, not read (--follow-outside-links reads it)")
    assert isinstance(ImageFileDataset(files, SHORT)[1], LoadedImage)  # no folder: read
