"""The mask sink, called directly as a consumer process would call it; labels.json and
the per-image statistics."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pyarrow.dataset as ds
import pytest
from PIL import Image
from segment_fixtures import noise

import embedingest.sinks.masks as masks_module
from embedingest.errors import ConfigError
from embedingest.sinks.mask_stats import (StatsWriter, drop_stats_rows, part_files, stats_columns,
                                          row_counts)
from embedingest.sinks.masks import (VOC_PALETTE, MaskSinkFactory, labels_info, output_paths,
                                     restore_mask, split_flat, voc_palette, write_labels)
from embedingest.sources.image_decode import ImageMeta

S = 16


def blocks() -> np.ndarray:
    """A model-size mask whose top-left 8x4 content is classes 0..3 in 2x2 blocks."""
    mask = np.full((S, S), 9, np.uint8)  # the pad region: must be cropped away
    mask[:4, :8] = np.kron(np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.uint8), np.ones((2, 2), np.uint8))
    return mask


def content() -> np.ndarray:
    """The 8x4 image part of ``blocks``, flat: what the job hands over for a model-size mask."""
    return blocks()[:4, :8].reshape(-1)


def run_sink(factory: MaskSinkFactory, metas, arrays) -> dict:
    sink = pickle.loads(pickle.dumps(factory))(0)
    sink(tuple(metas), arrays)
    return sink.close()


def test_palette():
    assert VOC_PALETTE[:6] == [0, 0, 0, 128, 0, 0] and VOC_PALETTE[45:48] == [192, 128, 128]
    assert len(voc_palette()) == 768


def test_mask_is_cropped_and_scaled_to_the_image(tmp_path):
    meta = ImageMeta("a/b/c.jpg", "", 16, 8, 8, 4)  # the image is twice the content
    result = run_sink(MaskSinkFactory(str(tmp_path)), [meta], {"mask": content()})
    assert result == {"written": 1, "failed": [], "stats_rows": 0}
    im = Image.open(tmp_path / "a" / "b" / "c.jpg.png")
    assert im.mode == "P" and im.size == (16, 8) and im.getpalette()[:6] == [0, 0, 0, 128, 0, 0]
    expect = np.kron(np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.uint8), np.ones((4, 4), np.uint8))
    assert np.array_equal(np.asarray(im), expect)


def test_nearest_keeps_only_real_classes():
    meta = ImageMeta("x.png", "", 37, 23, 8, 4)
    out = restore_mask(blocks(), meta)
    assert out.shape == (23, 37) and set(np.unique(out)) == {0, 1, 2, 3}


def test_full_size_masks_pass_through_and_a_flat_batch_splits(tmp_path):
    """A batch of a full-size mask (made at the image's size), a model-size one, and a
    full one again, flat: each lands on its image unchanged or scaled."""
    full_a = (noise(6, 10, seed=1) % 5)[..., 0]
    full_b = (noise(3, 7, seed=2) % 5)[..., 0]
    metas = [ImageMeta("a.png", "", 10, 6, 4, 2, True), ImageMeta("b.png", "", 16, 8, 8, 4),
             ImageMeta("c.png", "", 7, 3, 9, 9, True)]
    flat = np.concatenate([full_a.ravel(), content(), full_b.ravel(), np.full(5, 77, np.uint8)])
    parts = split_flat(flat, metas)
    assert [p.shape for p in parts] == [(6, 10), (4, 8), (3, 7)]
    run_sink(MaskSinkFactory(str(tmp_path)), metas, {"mask": flat})
    assert np.array_equal(np.asarray(Image.open(tmp_path / "a.png.png")), full_a)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "c.png.png")), full_b)
    expect = np.kron(np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.uint8), np.ones((4, 4), np.uint8))
    assert np.array_equal(np.asarray(Image.open(tmp_path / "b.png.png")), expect)
    with pytest.raises(ValueError, match="short"):
        split_flat(flat[:50], metas)


def test_batch_logits_and_no_temporary_files(tmp_path):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 4, S, S)).astype(np.float16)
    masks = logits.argmax(1).astype(np.uint8)
    metas = [ImageMeta("one.png", "", S, S, S, S), ImageMeta("sub/two.tif", "", 8, 16, 8, 16)]
    flat_logits = np.concatenate([logits[0].ravel(), logits[1, :, :16, :8].ravel()])
    flat_masks = np.concatenate([masks[0].ravel(), masks[1, :16, :8].ravel()])
    result = run_sink(MaskSinkFactory(str(tmp_path), save_logits=True, num_classes=4), metas,
                      {"mask": flat_masks, "logits": flat_logits})
    assert result["written"] == 2
    saved = np.load(tmp_path / "sub" / "two.tif.logits.npy")
    assert saved.dtype == np.float16 and saved.shape == (4, 16, 8)
    np.testing.assert_array_equal(saved, logits[1, :, :16, :8])
    assert np.array_equal(np.asarray(Image.open(tmp_path / "one.png.png")), masks[0])
    names = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert names == ["one.png.logits.npy", "one.png.png", "sub", "sub/two.tif.logits.npy",
                     "sub/two.tif.png"]


def test_logits_alone_are_argmaxed(tmp_path):
    logits = np.zeros((1, 3, S, S), np.float16)
    logits[0, 2, :, 8:] = 1.0
    run_sink(MaskSinkFactory(str(tmp_path), num_classes=3), [ImageMeta("l.png", "", S, S, S, S)],
             {"logits": logits.ravel()})
    mask = np.asarray(Image.open(tmp_path / "l.png.png"))
    assert (mask[:, :8] == 0).all() and (mask[:, 8:] == 2).all()
    assert not (tmp_path / "l.png.logits.npy").exists()


def test_overlay_blends_classes_over_the_original(tmp_path):
    src = tmp_path / "in.png"
    Image.fromarray(np.full((8, 16, 3), 200, np.uint8)).save(src)
    meta = ImageMeta("in.png", str(src), 16, 8, 8, 4)
    out = tmp_path / "out"
    for alpha in (0.5, 0.25, 1.0):
        run_sink(MaskSinkFactory(str(out), overlay=True, overlay_alpha=alpha), [meta], {"mask": content()})
        ov = np.asarray(Image.open(out / "in.png.overlay.jpg")).astype(int)
        assert ov.shape == (8, 16, 3)
        assert np.abs(ov[0, 0] - 200).max() < 12, "background (class 0) keeps the original"
        red = 200 + alpha * (128 - 200)  # class 1 is (128, 0, 0), blended by alpha
        assert abs(ov[1, 5, 0] - red) < 10 and abs(ov[1, 5, 1] - 200 * (1 - alpha)) < 10, (alpha, ov[1, 5])


def test_overlay_source_gone_is_reported_and_the_mask_still_written(tmp_path):
    meta = ImageMeta("gone.jpg", str(tmp_path / "gone.jpg"), 16, 8, 8, 4)
    result = run_sink(MaskSinkFactory(str(tmp_path), overlay=True), [meta], {"mask": content()})
    assert result["written"] == 1 and (tmp_path / "gone.jpg.png").exists()
    [(path, reason)] = result["failed"]
    assert path == meta.path and reason.startswith("overlay source unreadable")


def test_a_picture_decoded_at_another_size_than_its_mask_is_reported_not_a_crash(tmp_path, monkeypatch):
    """A decoder that turns a picture its own way (a rotated TIFF's size turned twice)
    stopped the run at ``Image.blend``: ``ValueError: images do not match``."""
    src = tmp_path / "r.png"
    Image.fromarray(np.full((8, 16, 3), 200, np.uint8)).save(src)
    meta = ImageMeta("r.png", str(src), 16, 8, 8, 4)
    monkeypatch.setattr(masks_module, "open_rgb", lambda path, max_pixels=None: (
        Image.new("RGB", (8, 16)), (16, 8)))
    result = run_sink(MaskSinkFactory(str(tmp_path), overlay=True), [meta], {"mask": content()})
    assert result["written"] == 1 and (tmp_path / "r.png.png").exists()
    assert result["failed"] == [(str(src), "overlay: the picture decodes at 8x16, its mask is 16x8")]
    assert not (tmp_path / "r.png.overlay.jpg").exists()


def test_an_original_swapped_for_a_link_out_of_the_input_folder_gets_no_overlay(tmp_path):
    """An overlay re-reads the original: one swapped for a link to a picture outside the
    input folder after it was decoded (of the same size, so the size check passes) must
    not be drawn into the output; the mask is still written, the overlay reported."""
    images, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    images.mkdir()
    elsewhere.mkdir()
    Image.fromarray(np.full((8, 16, 3), 10, np.uint8)).save(elsewhere / "private.png")
    (images / "in.png").symlink_to(elsewhere / "private.png")
    meta = ImageMeta("in.png", str(images / "in.png"), 16, 8, 8, 4)
    out = tmp_path / "out"
    factory = MaskSinkFactory(str(out), overlay=True, within=os.path.realpath(images))
    result = run_sink(factory, [meta], {"mask": content()})
    assert result["written"] == 1 and (out / "in.png.png").exists()
    assert not (out / "in.png.overlay.jpg").exists()
    assert result["failed"] == [(meta.path, "overlay source unreadable: symbolic link out of the input "
                                 f"folder: to {os.path.realpath(elsewhere / 'private.png')}, not read "
                                 "(--follow-outside-links reads it)")]
    run_sink(MaskSinkFactory(str(out), overlay=True), [meta], {"mask": content()})  # no folder: read
    assert (out / "in.png.overlay.jpg").exists()


def test_write_failure_raises(tmp_path):
    (tmp_path / "blocked").write_text("a file where the folder should be")
    with pytest.raises(OSError):
        run_sink(MaskSinkFactory(str(tmp_path)), [ImageMeta("blocked/x.png", "", S, S, S, S)],
                 {"mask": blocks().ravel()})


def test_output_paths_keep_the_source_extension(tmp_path):
    a, b = output_paths(tmp_path, "d/a.jpg"), output_paths(tmp_path, "d/a.png")
    assert a["mask"] != b["mask"] and a["mask"].name == "a.jpg.png"
    assert a["logits"].name == "a.jpg.logits.npy" and a["overlay"].name == "a.jpg.overlay.jpg"


def test_sink_module_does_not_import_torch():
    code = ("import sys, pickle; import embedingest.sinks.masks as m; "
            "pickle.loads(pickle.dumps(m.MaskSinkFactory('x')))(0); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_random_mask_roundtrip(tmp_path):
    mask = (noise(S, S, seed=1) % 21)[..., 0]
    run_sink(MaskSinkFactory(str(tmp_path)), [ImageMeta("r.bmp", "", S, S, S, S)], {"mask": mask.ravel()})
    assert np.array_equal(np.asarray(Image.open(tmp_path / "r.bmp.png")), mask)


def test_a_link_in_the_output_tree_is_never_written_through(tmp_path):
    from embedingest.errors import ConfigError

    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "deeper").symlink_to(outside)
    with pytest.raises(ConfigError, match="deeper' .*is a symbolic link"):
        run_sink(MaskSinkFactory(str(out)), [ImageMeta("sub/deeper/x.png", "", S, S, S, S)],
                 {"mask": blocks().ravel()})
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"not yours")
    (out / "y.png.png").symlink_to(victim)  # a link at the mask's name is replaced
    run_sink(MaskSinkFactory(str(out)), [ImageMeta("y.png", "", S, S, S, S)], {"mask": blocks().ravel()})
    assert list(outside.iterdir()) == [] and victim.read_bytes() == b"not yours"
    assert not (out / "y.png.png").is_symlink() and Image.open(out / "y.png.png").size == (S, S)


def test_labels_json_is_written_and_guards_the_folder(tmp_path):
    prep = {"resize": "short", "size": 520}
    info = labels_info("fcn_resnet50", "random", ["__background__", "aeroplane", "bicycle"], prep,
                       40_000_000, "FCN_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1")
    assert info["palette"] == [[0, 0, 0], [128, 0, 0], [0, 128, 0]]
    path = write_labels(tmp_path, info)
    assert json.loads(path.read_text()) == info and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    write_labels(tmp_path, {**info, "weights": "file elsewhere/random"})  # the same weights: fine
    other = labels_info("fcn_resnet50", "random", info["categories"], {**prep, "resize": "fit"}, 0)
    with pytest.raises(ConfigError, match="preprocessing.*--overwrite"):
        write_labels(tmp_path, other)
    write_labels(tmp_path, other, replace=True)
    assert json.loads(path.read_text())["preprocessing"]["resize"] == "fit"
    path.write_text("[" * 200_000)  # nested past Python's stack: unreadable, not a traceback
    with pytest.raises(ConfigError, match=r"labels.json is unreadable \(maximum recursion depth.*or pass --overwrite$"):
        write_labels(tmp_path, other)
    write_labels(tmp_path, other, replace=True)


def test_stats_rows_are_committed_in_parts_and_read_as_one_table(tmp_path):
    writer = StatsWriter(str(tmp_path), ["__background__", "cat", "cat", "width"], rows_per_part=2)
    assert writer.columns == ["__background__", "cat", "class_2", "class_3"]
    masks = {"a.jpg": np.array([[0, 1], [1, 1]], np.uint8), "b/c.png": np.full((3, 5), 3, np.uint8),
             "d.png": np.array([[2, 0, 0]], np.uint8)}
    for source, mask in masks.items():
        writer.add(source, mask)
    assert len(part_files(tmp_path)) == 1 and writer.committed == 2  # the third is not yet committed
    writer.close()
    assert len(part_files(tmp_path)) == 2 and writer.committed == 3
    table = ds.dataset(tmp_path / "stats").to_table().to_pylist()
    rows = {r["source"]: r for r in table}
    assert set(rows) == set(masks) == set(row_counts(tmp_path))
    assert rows["a.jpg"] == {"source": "a.jpg", "width": 2, "height": 2, "__background__": 0.25,
                             "cat": 0.75, "class_2": 0.0, "class_3": 0.0}
    assert (rows["b/c.png"]["width"], rows["b/c.png"]["height"], rows["b/c.png"]["class_3"]) == (5, 3, 1.0)
    assert rows["d.png"]["class_2"] == pytest.approx(1 / 3)
    assert not [p for p in (tmp_path / "stats").iterdir() if p.name.startswith(".")]
    drop_stats_rows(tmp_path, {"a.jpg", "d.png"})
    assert set(row_counts(tmp_path)) == {"b/c.png"}
    assert sorted(r["source"] for r in ds.dataset(tmp_path / "stats").to_table().to_pylist()) == ["b/c.png"]


def test_sink_writes_stats_after_each_mask(tmp_path):
    metas = [ImageMeta("a.png", "", 16, 8, 8, 4), ImageMeta("b.png", "", 2, 1, 2, 1, True)]
    flat = np.concatenate([content(), np.array([1, 1], np.uint8)])
    result = run_sink(MaskSinkFactory(str(tmp_path), stats=True, categories=("bg", "x", "y", "z")),
                      metas, {"mask": flat})
    assert result["stats_rows"] == 2
    rows = {r["source"]: r for r in ds.dataset(tmp_path / "stats").to_table().to_pylist()}
    assert rows["a.png"] == {"source": "a.png", "width": 16, "height": 8, "bg": 0.25, "x": 0.25,
                             "y": 0.25, "z": 0.25}
    assert rows["b.png"]["x"] == 1.0
    assert stats_columns(["source"]) == ["class_0"]


# What mutation testing found missing (docs/TESTING.md, "masks.py and mask_stats.py with mutmut").

VOC_21 = [(0, 0, 0), (128, 0, 0), (0, 128, 0), (128, 128, 0), (0, 0, 128), (128, 0, 128), (0, 128, 128),
          (128, 128, 128), (64, 0, 0), (192, 0, 0), (64, 128, 0), (192, 128, 0), (64, 0, 128), (192, 0, 128),
          (64, 128, 128), (192, 128, 128), (0, 64, 0), (128, 64, 0), (0, 192, 0), (128, 192, 0), (0, 64, 128)]


def test_the_palette_is_the_pascal_voc_colour_map():
    """The 21 VOC classes' colours as the VOC devkit gives them, and the last entry (255,
    the VOC 'void' border) whose every bit is set."""
    assert voc_palette(21) == [v for rgb in VOC_21 for v in rgb]
    full = voc_palette()
    assert full[-3:] == [224, 224, 192] and full == VOC_PALETTE


def test_a_mask_of_any_integer_type_becomes_a_palette_image_of_its_classes():
    from embedingest.sinks.masks import mask_image

    mask = np.arange(12).reshape(3, 4) % 5  # int64, as an argmax gives it
    im = mask_image(mask)
    assert im.mode == "P" and np.array_equal(np.asarray(im), mask)


def test_split_flat_gives_planes_from_two_classes_on_and_says_how_short_a_batch_is():
    metas = [ImageMeta("a.png", "", 6, 4, 3, 2), ImageMeta("b.png", "", 10, 6, 4, 2, True)]
    flat = np.arange(2 * 2 * 3 + 2 * 2 * 4, dtype=np.float16)
    a, b = split_flat(flat, metas, per_pixel=2, full=False)
    assert a.shape == (2, 2, 3) and b.shape == (2, 2, 4)
    assert a[1, 0, 0] == 6 and b[0, 0, 0] == 12
    with pytest.raises(ValueError, match=r"^a batch of 28 values is short of its 2 images' 66 or more$"):
        split_flat(flat, metas)  # as masks: b's full-size one needs 60 values after a's 6


def test_labels_info_says_exactly_how_the_masks_were_made():
    fmt = "PNG, mode P: the class index of each pixel, at the image's own size, with the palette below"
    full = labels_info("a", "w", ["bg", "x"], {"size": 1}, 40_000_000, "P", "12ab")
    assert full == {"arch": "a", "weights": "w", "weights_sha256": "12ab", "weights_preset": "P", "num_classes": 2,
                    "categories": ["bg", "x"], "palette": [[0, 0, 0], [128, 0, 0]],
                    "preprocessing": {"size": 1}, "precisions": [],
                    "masks": {"format": fmt,
                              "resize": "the logits scaled bilinearly to the image's size, then the argmax "
                                        "(images over 40000000 pixels: the argmax at model size scaled "
                                        "nearest-neighbour)"}}
    assert list(full)[-2:] == ["masks", "palette"], "the format's 'palette below' is the next key of the file"
    model = labels_info("a", "w", ["bg", "x"], {"size": 1}, None)
    assert model == {**full, "weights_preset": "", "weights_sha256": None,
                     "masks": {"format": fmt,
                               "resize": "the argmax at model size, the pad cropped, scaled nearest-neighbour"}}


def test_labels_json_keeps_every_precision_its_masks_were_made_in_and_warns_of_a_new_one(tmp_path, caplog):
    """A resume in another precision (a GPU run's folder finished on a CPU) is allowed, its
    masks differing only where two classes score nearly alike, but never silently: it is
    logged, and labels.json lists both. A run that makes no mask adds none."""
    made = lambda precision: labels_info("fcn_resnet50", "random", ["bg", "x"], {"size": 8}, None,  # noqa: E731
                                         precision=precision)
    path = write_labels(tmp_path, made("float16"))
    assert json.loads(path.read_text())["precisions"] == ["float16"]
    os.utime(path, ns=(0, 0))
    with caplog.at_level("WARNING", logger="embedingest"):
        write_labels(tmp_path, made("float16"))
        write_labels(tmp_path, made(None))
    assert path.stat().st_mtime_ns == 0 and not caplog.records, "the same precision, or none: not rewritten"
    with caplog.at_level("WARNING", logger="embedingest"):
        write_labels(tmp_path, made("float32"))
    assert json.loads(path.read_text())["precisions"] == ["float16", "float32"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path} holds masks made in float16; this run makes them in float32: where two classes score nearly "
        "alike a pixel's class can differ between the two (--dtype fp16 gives the folder's precision, --overwrite "
        "redoes every image)"]
    write_labels(tmp_path, made("bfloat16"), replace=True)
    assert json.loads(path.read_text())["precisions"] == ["bfloat16"], "--overwrite: this run's alone"
    old = {k: v for k, v in made(None).items() if k != "precisions"}  # labels of an older embedingest
    path.write_text(json.dumps(old))
    caplog.clear()
    with caplog.at_level("WARNING", logger="embedingest"):
        write_labels(tmp_path, made("float32"))
    assert json.loads(path.read_text())["precisions"] == ["float32"] and not caplog.records


def test_labels_json_is_indented_refuses_other_weights_and_notes_the_same_weights_moved(tmp_path):
    """Weights are told apart by their file's sha256: the same bytes at another path are
    the same weights (the new path noted); other bytes, at the same path or not, or random
    weights, would mix two models' masks in one folder and are refused."""
    info = labels_info("fcn_resnet50", "file w.pth", ["bg", "x"], {"size": 8}, None, "", "aa" * 32)
    path = write_labels(tmp_path, info)
    assert path.read_text() == json.dumps(info, indent=2) + "\n"
    os.utime(path, ns=(0, 0))
    assert write_labels(tmp_path, info) == path and path.stat().st_mtime_ns == 0, "the same labels: not rewritten"
    write_labels(tmp_path, {**info, "weights": "file /moved/w.pth"})
    assert json.loads(path.read_text())["weights"] == "file /moved/w.pth", "the same weights moved: noted"
    for weights, sha, differ in (("file /moved/w.pth", "bb" * 32, f"weights_sha256 differ: weights_sha256='{'aa' * 32}' "
                                                                  f"(this run: '{'bb' * 32}')"),
                                 ("random", None, "weights, weights_sha256 differ: weights='file /moved/w.pth' (this run: "
                                                  f"'random'), weights_sha256='{'aa' * 32}' (this run: None)")):
        with pytest.raises(ConfigError) as err:
            write_labels(tmp_path, {**info, "weights": weights, "weights_sha256": sha})
        assert str(err.value) == (f"{tmp_path} holds masks made with other settings ({differ}); use another "
                                  "--out, or --overwrite to redo every image")
    legacy = {k: v for k, v in info.items() if k != "weights_sha256"}  # labels written before the sha256
    path.write_text(json.dumps(legacy))
    with pytest.raises(ConfigError, match=r"\(weights differ: weights='file w.pth' \(this run: 'file other.pth'\)\)"):
        write_labels(tmp_path, {**info, "weights": "file other.pth"})
    write_labels(tmp_path, info)
    assert json.loads(path.read_text()) == info, "the same source: the sha256 now recorded"
    path.write_text(json.dumps(info))
    other = {**info, "arch": "deeplabv3_resnet50", "num_classes": 3, "categories": ["bg", "x", "y"]}
    msg = (f"{tmp_path} holds masks made with other settings (arch, num_classes, categories differ: "
           "arch='fcn_resnet50' (this run: 'deeplabv3_resnet50'), num_classes=2 (this run: 3), categories: 2 names "
           "(this run: 3)); use another --out, or --overwrite to redo every image")
    with pytest.raises(ConfigError) as err:
        write_labels(tmp_path, other)
    assert str(err.value) == msg
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))} is unreadable .*; remove it or pass --overwrite$"):
        write_labels(tmp_path, info)
    for text, kind in (("[1, 2]", "array"), ('"labels"', "string"), ("3", "number"), ("null", "null")):
        path.write_text(text)  # JSON, but not the object of labels: an AttributeError's traceback before
        with pytest.raises(ConfigError) as err:
            write_labels(tmp_path, info)
        assert str(err.value) == (f"{path} holds a JSON {kind}, not the object of labels segment writes; "
                                  "remove it or pass --overwrite")
    path.write_text(json.dumps({"traceEvents": []}))  # a trace written there: was "other settings (arch=None ...)"
    with pytest.raises(ConfigError) as err:
        write_labels(tmp_path, info)
    assert str(err.value) == (f"{path} holds a JSON object without segment's labels (no 'arch', no 'categories'): "
                              "another program's file; move it out of the folder, or pass --overwrite")
    path.unlink()
    path.mkdir()  # there, but not readable as a file
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))} is unreadable .*; remove it or pass --overwrite$"):
        write_labels(tmp_path, info)


def test_labels_json_at_a_url_is_one_put_and_guards_the_prefix(tmp_path, monkeypatch):
    """An fsspec URL (``local://``: any URL goes the same way) takes the remote branch."""
    monkeypatch.chdir(tmp_path)  # where a path made relative would land
    out = f"local://{tmp_path}/bucket/masks/"
    url = f"local://{tmp_path}/bucket/masks"
    info = labels_info("fcn_resnet50", "random", ["bg", "x"], {"size": 8}, None)
    (tmp_path / "bucket" / "masks").mkdir(parents=True)
    file = tmp_path / "bucket" / "masks" / "labels.json"
    assert write_labels(out.rstrip("/"), info) == f"{url}/labels.json"
    assert json.loads(file.read_text()) == info
    assert write_labels(out, info) == f"{url}/labels.json", "a trailing slash makes no '//'"
    os.utime(file, ns=(0, 0))
    assert write_labels(url, info) == f"{url}/labels.json" and file.stat().st_mtime_ns == 0
    write_labels(url, {**info, "weights": "file moved/random"})  # the same weights (None: random) moved
    assert json.loads(file.read_text())["weights"] == "file moved/random"
    with pytest.raises(ConfigError, match=r"\(weights, weights_sha256 differ: weights='file moved/random' \(this run: "
                                          r"'file w.pth'\), weights_sha256=None \(this run: 'cccc"):
        write_labels(url, {**info, "weights": "file w.pth", "weights_sha256": "cc" * 32})
    other = {**info, "arch": "lraspp"}
    with pytest.raises(ConfigError, match=f"^{re.escape(url)} holds masks made with other settings "
                                          r"\(arch differ: arch='fcn_resnet50' \(this run: 'lraspp'\)\)"):
        write_labels(url, other)
    write_labels(url, other, replace=True)
    assert json.loads(file.read_text())["arch"] == "lraspp"
    file.write_text("{not json")
    with pytest.raises(ConfigError, match=f"^{re.escape(url)}/labels.json is unreadable "):
        write_labels(url, info)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bucket"], "nothing written outside the URL's folder"


def test_masks_to_a_url_are_staged_uploaded_mask_last_and_the_stage_removed(tmp_path, monkeypatch):
    import tempfile

    import fsspec

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    src = tmp_path / "in.png"
    Image.fromarray(np.full((8, 16, 3), 200, np.uint8)).save(src)
    metas = [ImageMeta("d/in.png", str(src), 16, 8, 8, 4), ImageMeta("e.png", str(src), 8, 4, 8, 4)]
    logits = np.zeros((2, 3, 4, 8), np.float16)
    logits[:, 1] = 1.0
    puts = []
    local = type(fsspec.filesystem("local"))
    real_put = local.put_file
    monkeypatch.setattr(local, "put_file", lambda fs, lpath, rpath, **kw: (puts.append(rpath),
                                                                          real_put(fs, lpath, rpath, **kw)))
    out = tmp_path / "bucket" / "masks"
    (out / "d").mkdir(parents=True)  # an object store needs none; the local filesystem does
    sink = MaskSinkFactory(f"local://{out}", save_logits=True, overlay=True, num_classes=3)(0)
    [stage] = (tmp_path / "tmp").iterdir()
    assert stage.name.startswith("embedingest-masks-")
    sink(tuple(metas), {"mask": np.concatenate([content(), np.ones(32, np.uint8)]), "logits": logits.ravel()})
    assert [p for p in stage.rglob("*") if p.is_file()] == [], "each file deleted once uploaded"
    assert sink.close() == {"written": 2, "failed": [(str(src), "overlay source changed: now 16x8, was 8x4")],
                            "stats_rows": 0}
    assert not stage.exists()
    assert puts == [f"{out}/d/in.png.logits.npy", f"{out}/d/in.png.overlay.jpg", f"{out}/d/in.png.png",
                    f"{out}/e.png.logits.npy", f"{out}/e.png.png"]
    expect = np.kron(np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.uint8), np.ones((4, 4), np.uint8))
    assert np.array_equal(np.asarray(Image.open(out / "d" / "in.png.png")), expect)
    assert np.array_equal(np.asarray(Image.open(out / "e.png.png")), np.ones((4, 8), np.uint8))
    assert np.load(out / "e.png.logits.npy").shape == (3, 4, 8)
    assert Image.open(out / "d" / "in.png.overlay.jpg").size == (16, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bucket", "in.png", "tmp"]


def test_closing_a_url_sink_whose_stage_is_already_gone(tmp_path, monkeypatch):
    import shutil
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sink = MaskSinkFactory(f"local://{tmp_path}/out")(0)
    shutil.rmtree(sink._stage)  # a tmp cleaner, say
    assert sink.close() == {"written": 0, "failed": [], "stats_rows": 0}


def test_the_logits_of_an_image_with_a_full_size_mask_stay_at_model_size_as_float16(tmp_path):
    metas = [ImageMeta("f.png", "", 10, 6, 4, 2, True), ImageMeta("m.png", "", 8, 4, 8, 4)]
    logits = np.arange(3 * 2 * 4 + 3 * 4 * 8, dtype=np.float32) / 64  # float32 in: float16 on disk
    full = (noise(6, 10, seed=3) % 3)[..., 0]
    run_sink(MaskSinkFactory(str(tmp_path), save_logits=True, num_classes=3), metas,
             {"mask": np.concatenate([full.ravel(), np.zeros(32, np.uint8)]), "logits": logits})
    f = np.load(tmp_path / "f.png.logits.npy")
    assert f.dtype == np.float16 and f.shape == (3, 2, 4)
    np.testing.assert_array_equal(f, logits[:24].reshape(3, 2, 4).astype(np.float16))
    assert np.load(tmp_path / "m.png.logits.npy").shape == (3, 4, 8)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "f.png.png")), full)


def test_logits_alone_give_the_stats_rows_of_their_argmax(tmp_path):
    logits = np.zeros((3, 4, 8), np.float16)
    logits[2, :, 6:] = 1.0
    result = run_sink(MaskSinkFactory(str(tmp_path), num_classes=3, stats=True, categories=("bg", "x", "y")),
                      [ImageMeta("l.png", "", 8, 4, 8, 4)], {"logits": logits.ravel()})
    assert result["stats_rows"] == 1
    [row] = ds.dataset(tmp_path / "stats").to_table().to_pylist()
    assert row == {"source": "l.png", "width": 8, "height": 4, "bg": 0.75, "x": 0.0, "y": 0.25}


def test_the_png_compress_level_is_the_factory_s(tmp_path):
    mask = np.kron(np.arange(16, dtype=np.uint8).reshape(4, 4), np.ones((16, 16), np.uint8))  # 64x64, flat regions
    meta = ImageMeta("p.png", "", 64, 64, 64, 64)
    sizes = {}
    for level in (0, 9):
        run_sink(MaskSinkFactory(str(tmp_path / str(level)), png_compress_level=level), [meta], {"mask": mask.ravel()})
        path = tmp_path / str(level) / "p.png.png"
        assert np.array_equal(np.asarray(Image.open(path)), mask)
        sizes[level] = path.stat().st_size
    assert sizes[0] > 64 * 64 > 4 * sizes[9], sizes  # level 0 stores the pixels as they are (and a 768-byte palette)


def test_the_overlay_source_is_read_under_the_factory_s_pixel_limit(tmp_path):
    src = tmp_path / "in.png"
    Image.fromarray(np.full((8, 16, 3), 200, np.uint8)).save(src)
    meta = ImageMeta("in.png", str(src), 16, 8, 8, 4)
    result = run_sink(MaskSinkFactory(str(tmp_path / "out"), overlay=True, max_pixels=100), [meta],
                      {"mask": content()})
    assert result["written"] == 1 and (tmp_path / "out" / "in.png.png").exists()
    assert not (tmp_path / "out" / "in.png.overlay.jpg").exists()
    [(path, reason)] = result["failed"]
    assert path == str(src) and reason.startswith("overlay source unreadable: too large: 16x8 = 128 pixels"), reason


def test_the_sink_commits_stats_as_often_as_the_factory_says(tmp_path):
    metas = [ImageMeta("a.png", "", 8, 4, 8, 4), ImageMeta("b.png", "", 8, 4, 8, 4)]
    sink = MaskSinkFactory(str(tmp_path), stats=True, categories=("bg", "x"), stats_commit_seconds=0.0)(0)
    sink(tuple(metas), {"mask": np.zeros(64, np.uint8)})
    assert len(part_files(tmp_path)) == 2 and sink.stats.committed == 2, "a part per row at 0 seconds"
    assert sink.close()["stats_rows"] == 2


def test_a_url_s_last_folder_is_kept_whole_but_for_a_trailing_slash(tmp_path, monkeypatch):
    """Only "/" comes off the end of an output URL: a prefix may end in an "X" or a space."""
    monkeypatch.chdir(tmp_path)
    info = labels_info("fcn_resnet50", "random", ["bg"], {}, None)
    for name, end in (("masksX", "/"), ("masks ", "")):
        (tmp_path / name).mkdir()
        write_labels(f"local://{tmp_path}/{name}{end}", info)
        assert json.loads((tmp_path / name / "labels.json").read_text()) == info
    assert sorted(p.name for p in tmp_path.iterdir()) == ["masks ", "masksX"]


def test_labels_json_that_is_no_regular_file_is_refused_unopened_and_replaced_by_overwrite(tmp_path):
    """``labels.json`` a named pipe (reading it waited for a writer for ever), a link (to
    labels elsewhere, which would vouch for these masks, or to a device): refused at once
    with what it is and what to do; ``--overwrite`` replaces it, the link's target untouched."""
    import time

    from fault_helpers import unblock_later

    info = labels_info("fcn_resnet50", "random", ["bg", "x"], {"size": 8}, None)
    elsewhere = write_labels(tmp_path, info).rename(tmp_path / "theirs.json")
    out = tmp_path / "out"
    out.mkdir()
    path = out / "labels.json"
    for make, kind in ((lambda: os.mkfifo(path), "a named pipe (FIFO)"),
                       (lambda: path.symlink_to(elsewhere), "a symbolic link"),
                       (lambda: path.symlink_to("/dev/zero"), "a symbolic link")):
        make()
        unblock_later(path)
        start = time.monotonic()
        with pytest.raises(ConfigError) as err:
            write_labels(out, info)
        assert time.monotonic() - start < 5
        assert str(err.value) == (f"{path} is {kind}, not a regular file; remove it, or pass --overwrite "
                                  "to redo every image")
        assert write_labels(out, info, replace=True) == path
        assert not path.is_symlink() and json.loads(path.read_text()) == info
        path.unlink()
    assert json.loads(elsewhere.read_text()) == info


def test_the_overlay_of_an_image_wider_than_a_jpeg_holds_is_scaled_down_and_the_mask_kept_whole(tmp_path):
    """A panorama 70,000 pixels wide: its overlay failed to encode (``Maximum supported
    image dimension is 65500 pixels``), which stopped the run before its mask, every run."""
    src = tmp_path / "pano.png"
    Image.fromarray(np.full((4, 70_000, 3), 200, np.uint8)).save(src)
    mask = np.zeros((4, 70_000), np.uint8)
    mask[:, 35_000:] = 1
    meta = ImageMeta("pano.png", str(src), 70_000, 4, 8, 4, full_mask=True)
    out = tmp_path / "out"
    result = run_sink(MaskSinkFactory(str(out), overlay=True), [meta], {"mask": mask.reshape(-1)})
    assert result == {"written": 1, "failed": [], "stats_rows": 0}
    assert np.array_equal(np.asarray(Image.open(out / "pano.png.png")), mask)
    overlay = Image.open(out / "pano.png.overlay.jpg")
    assert overlay.format == "JPEG" and overlay.size == (65_500, 4)
    ov = np.asarray(overlay).astype(int)
    assert np.abs(ov[:, :30_000] - 200).max() < 12 and ov[:, 36_000:, 0].mean() < 180, "class 1 on the right"


def test_a_refusal_names_the_settings_that_differ_with_the_folder_s_value_and_this_run_s(tmp_path):
    """A resume with another --size or --resize named only the folder's whole preprocessing
    (and the masks' text), not which setting differs nor this run's value."""
    prep = {"resize": "fit", "size": 256, "max_size": None, "mean": [0.485, 0.456, 0.406]}
    write_labels(tmp_path, labels_info("a", "random", ["bg", "cat"], prep, None))
    other = labels_info("a", "random", ["bg", "dog"], {**prep, "resize": "short", "size": 300}, 40_000_000)
    with pytest.raises(ConfigError) as err:
        write_labels(tmp_path, other)
    assert str(err.value) == (f"{tmp_path} holds masks made with other settings (categories, preprocessing, masks "
                              "differ: categories[1]='cat' (this run: 'dog'), preprocessing.resize='fit' (this run: "
                              "'short'), preprocessing.size=256 (this run: 300)); use another --out, or --overwrite "
                              "to redo every image")
    with pytest.raises(ConfigError, match=r"differ: preprocessing.max_size=None \(this run: 2080\)\)"):
        write_labels(tmp_path, labels_info("a", "random", ["bg", "cat"], {**prep, "max_size": 2080}, None))
