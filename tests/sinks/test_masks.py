"""The mask sink, called directly as a consumer process would call it."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from segment_fixtures import noise

from embedingest.sinks.masks import (VOC_PALETTE, MaskSinkFactory, output_paths, restore_mask,
                                     voc_palette)
from embedingest.sources.image_decode import ImageMeta

S = 16


def blocks() -> np.ndarray:
    """A model-size mask whose top-left 8x4 content is classes 0..3 in 2x2 blocks."""
    mask = np.full((S, S), 9, np.uint8)  # the pad region: must be cropped away
    mask[:4, :8] = np.kron(np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.uint8), np.ones((2, 2), np.uint8))
    return mask


def run_sink(factory: MaskSinkFactory, metas, arrays) -> dict:
    sink = pickle.loads(pickle.dumps(factory))(0)
    sink(tuple(metas), arrays)
    return sink.close()


def test_palette():
    assert VOC_PALETTE[:6] == [0, 0, 0, 128, 0, 0] and VOC_PALETTE[45:48] == [192, 128, 128]
    assert len(voc_palette()) == 768


def test_mask_is_cropped_and_scaled_to_the_image(tmp_path):
    meta = ImageMeta("a/b/c.jpg", "", 16, 8, 8, 4)  # the image is twice the content
    result = run_sink(MaskSinkFactory(str(tmp_path)), [meta], {"mask": blocks()[None]})
    assert result == {"written": 1, "failed": []}
    im = Image.open(tmp_path / "a" / "b" / "c.jpg.png")
    assert im.mode == "P" and im.size == (16, 8) and im.getpalette()[:6] == [0, 0, 0, 128, 0, 0]
    expect = np.kron(np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.uint8), np.ones((4, 4), np.uint8))
    assert np.array_equal(np.asarray(im), expect)


def test_nearest_keeps_only_real_classes():
    meta = ImageMeta("x.png", "", 37, 23, 8, 4)
    out = restore_mask(blocks(), meta)
    assert out.shape == (23, 37) and set(np.unique(out)) == {0, 1, 2, 3}


def test_batch_logits_and_no_temporary_files(tmp_path):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 4, S, S)).astype(np.float32)
    masks = logits.argmax(1).astype(np.uint8)
    metas = [ImageMeta("one.png", "", S, S, S, S), ImageMeta("sub/two.tif", "", 8, 16, 8, 16)]
    result = run_sink(MaskSinkFactory(str(tmp_path), save_logits=True), metas,
                      {"mask": masks, "logits": logits})
    assert result["written"] == 2
    saved = np.load(tmp_path / "sub" / "two.tif.logits.npy")
    assert saved.dtype == np.float16 and saved.shape == (4, 16, 8)
    np.testing.assert_array_equal(saved, logits[1, :, :16, :8].astype(np.float16))
    assert np.array_equal(np.asarray(Image.open(tmp_path / "one.png.png")), masks[0])
    names = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert names == ["one.png.logits.npy", "one.png.png", "sub", "sub/two.tif.logits.npy",
                     "sub/two.tif.png"]


def test_logits_alone_are_argmaxed(tmp_path):
    logits = np.zeros((1, 3, S, S), np.float16)
    logits[0, 2, :, 8:] = 1.0
    run_sink(MaskSinkFactory(str(tmp_path)), [ImageMeta("l.png", "", S, S, S, S)], {"logits": logits})
    mask = np.asarray(Image.open(tmp_path / "l.png.png"))
    assert (mask[:, :8] == 0).all() and (mask[:, 8:] == 2).all()
    assert not (tmp_path / "l.png.logits.npy").exists()


def test_overlay_blends_classes_over_the_original(tmp_path):
    src = tmp_path / "in.png"
    Image.fromarray(np.full((8, 16, 3), 200, np.uint8)).save(src)
    meta = ImageMeta("in.png", str(src), 16, 8, 8, 4)
    out = tmp_path / "out"
    run_sink(MaskSinkFactory(str(out), overlay=True, overlay_alpha=0.5), [meta], {"mask": blocks()[None]})
    ov = np.asarray(Image.open(out / "in.png.overlay.jpg")).astype(int)
    assert ov.shape == (8, 16, 3)
    assert np.abs(ov[0, 0] - 200).max() < 12, "background (class 0) keeps the original"
    assert abs(ov[0, 5, 0] - (200 + 128) / 2) < 12 and ov[0, 5, 1] < 130, "class 1 is tinted red"


def test_overlay_source_gone_is_reported_and_the_mask_still_written(tmp_path):
    meta = ImageMeta("gone.jpg", str(tmp_path / "gone.jpg"), 16, 8, 8, 4)
    result = run_sink(MaskSinkFactory(str(tmp_path), overlay=True), [meta], {"mask": blocks()[None]})
    assert result["written"] == 1 and (tmp_path / "gone.jpg.png").exists()
    [(path, reason)] = result["failed"]
    assert path == meta.path and reason.startswith("overlay source unreadable")


def test_write_failure_raises(tmp_path):
    (tmp_path / "blocked").write_text("a file where the folder should be")
    with pytest.raises(OSError):
        run_sink(MaskSinkFactory(str(tmp_path)), [ImageMeta("blocked/x.png", "", S, S, S, S)],
                 {"mask": blocks()[None]})


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
    run_sink(MaskSinkFactory(str(tmp_path)), [ImageMeta("r.bmp", "", S, S, S, S)], {"mask": mask[None]})
    assert np.array_equal(np.asarray(Image.open(tmp_path / "r.bmp.png")), mask)


def test_a_link_in_the_output_tree_is_never_written_through(tmp_path):
    from embedingest.errors import ConfigError

    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "deeper").symlink_to(outside)
    with pytest.raises(ConfigError, match="deeper' .*is a symbolic link"):
        run_sink(MaskSinkFactory(str(out)), [ImageMeta("sub/deeper/x.png", "", S, S, S, S)],
                 {"mask": blocks()[None]})
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"not yours")
    (out / "y.png.png").symlink_to(victim)  # a link at the mask's name is replaced
    run_sink(MaskSinkFactory(str(out)), [ImageMeta("y.png", "", S, S, S, S)], {"mask": blocks()[None]})
    assert list(outside.iterdir()) == [] and victim.read_bytes() == b"not yours"
    assert not (out / "y.png.png").is_symlink() and Image.open(out / "y.png.png").size == (S, S)
