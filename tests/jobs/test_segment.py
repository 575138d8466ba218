"""The segment job end to end on the real engine (CPU here, CUDA where there is one)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import time

import numpy as np
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from PIL import Image
from segment_fixtures import small  # noqa: F401 (fixture)
from segment_fixtures import (NUM_CLASSES, SIZE, SMALL, bad_files, image_tensor, image_tree, noise,
                              photo_set, random_weights_file, reference_model, refused_either_way)
from torchvision.models import get_model_weights
from torchvision.transforms.functional import pil_to_tensor

from embedingest.config import load_config
from embedingest.errors import ConfigError
from embedingest.index.lock import RUN_LOCK
from embedingest.jobs.segment import SegmentConfig, list_inputs, segment, segment_images
from embedingest.jobs.segment.listing import first_output_file
from embedingest.cli.segment import segment_command
from embedingest.report import SkipReport
from embedingest.sinks.mask_stats import part_files, row_counts
from embedingest.sinks.masks import output_paths
from embedingest.sources.image_decode import open_rgb
from embedingest.stages.segmentation import ARCHITECTURES, Segmenter


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return random_weights_file(tmp_path_factory.mktemp("w") / "r50.pth")


def torchvision_masks(model, arch: str, *paths, size: int = SIZE, decode=image_tensor) -> list[np.ndarray]:
    """torchvision's own pipeline, one image at a time: ``weights.transforms()`` (at
    ``size``, the tests' small preset) on the image as ``decode`` reads it, the model, the
    logits scaled to the image's size, the argmax."""
    transforms = get_model_weights(arch).DEFAULT.transforms(resize_size=size)
    masks = []
    for path in paths:
        image = decode(path)
        with torch.inference_mode():
            logits = model(transforms(image)[None])["out"]
            up = F.interpolate(logits, size=tuple(image.shape[1:]), mode="bilinear", align_corners=False)
        masks.append(up.argmax(1)[0].to(torch.uint8).numpy())
    return masks


def ours_decoded(path) -> torch.Tensor:
    """Our decoder's picture (EXIF rotation, 16-bit and alpha handling), as a tensor."""
    return pil_to_tensor(open_rgb(path)[0])


@pytest.fixture(scope="module")
def reference(weights):
    """Masks of files computed torchvision's way (see ``torchvision_masks``), with the
    pictures our decoder makes (torchvision's own decoder reads no EXIF rotation, 16-bit
    or alpha the way the job does)."""
    model = reference_model(weights)
    return lambda *paths: torchvision_masks(model, "deeplabv3_resnet50", *paths, decode=ours_decoded)


def mask_of(out, rel) -> np.ndarray:
    return np.asarray(Image.open(output_paths(out, rel)["mask"]))


@pytest.fixture
def tree(tmp_path):
    images = tmp_path / "images"
    sizes = image_tree(images)
    bad = bad_files(images / "sub")
    return images, sizes, {f"sub/{rel}": kind for rel, kind in bad.items()}


def config(images, out, weights, **kw) -> SegmentConfig:
    base = dict(images=str(images), out=str(out), weights=str(weights), size=SIZE, batch_size=3,
                num_workers=2, num_consumers=2, device="cpu")
    if "small" in weights.name:
        base.update(arch=SMALL, num_workers=0, num_consumers=1)
    return SegmentConfig(**{**base, **kw})


def hidden_files(folder) -> list[str]:
    """Hidden files but the run lock (``.run.lock``, kept: see ``index.lock``)."""
    return [str(p) for p in folder.rglob(".*") if p.name != RUN_LOCK]


def test_segment_folder_end_to_end(tree, tmp_path, weights, reference, no_leaks):
    images, sizes, bad = tree
    out = tmp_path / "out"
    summary = segment(config(images, out, weights, save_logits=True, overlay=True), progress=False)
    assert summary["images"] == len(sizes) + len(bad)
    assert summary["written"] == len(sizes) and summary["skipped"] == len(bad)
    assert summary["already_done"] == 0 and summary["num_classes"] == NUM_CLASSES
    assert summary["engine"]["batches"] >= len(sizes) // 3 and summary["out"] == str(out)
    assert sum(summary["phases"].values()) == pytest.approx(summary["seconds"], abs=0.01)
    timing = summary["timing"]
    assert min(timing.values()) >= 0 and timing["load_model_s"] > 0 and timing["first_forward_s"] > 0
    assert sum(timing.values()) <= summary["phases"]["segment_s"] + 0.01
    expected = dict(zip(sizes, reference(*(images / rel for rel in sizes)), strict=True))
    for rel, (w, h) in sizes.items():
        paths = output_paths(out, rel)
        mask_im = Image.open(paths["mask"])
        assert mask_im.mode == "P" and mask_im.size == (w, h), rel
        mask = np.asarray(mask_im)
        assert int(mask.max()) < NUM_CLASSES
        assert np.array_equal(mask, expected[rel]), f"{rel} differs from torchvision"
        assert Image.open(paths["overlay"]).size == (w, h)
        logits = np.load(paths["logits"])
        short = min(w, h)
        model_size = (round(SIZE * h / short) if h > w else SIZE, round(SIZE * w / short) if w > h else SIZE)
        assert logits.dtype == np.float16 and logits.shape[0] == NUM_CLASSES
        assert abs(logits.shape[1] - model_size[0]) <= 1 and abs(logits.shape[2] - model_size[1]) <= 1
    report = {os.path.relpath(e["path"], images): e
              for e in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
    assert set(report) == set(bad) and all(e["stage"] == "read" for e in report.values())
    for rel, kind in bad.items():
        assert report[rel]["reason"].startswith(f"{kind}: "), (rel, report[rel]["reason"])
    assert sum(summary["skipped_by_reason"].values()) == len(bad)
    assert not hidden_files(out), "temporary files left behind"


def test_masks_are_torchvisions_pipeline_for_every_aspect_ratio(tmp_path, weights, monkeypatch):
    """Real photographs of nine sizes and aspect ratios, PNG and JPEG: every mask equals,
    pixel for pixel, torchvision's pipeline run on each image alone (its decoder,
    ``weights.transforms()``, the model, the logits scaled to the image's size, argmax).
    Exact: the job batches images of one shape (five batches here), and batching does not
    change the float result on this path; so no tolerance is needed. Today's letterbox
    (``--resize fit``) on the same images is far off, so the comparison can fail."""
    images, out = tmp_path / "photos", tmp_path / "out"
    sizes = photo_set(images)
    calls = []
    logits = Segmenter.logits
    monkeypatch.setattr(Segmenter, "logits", lambda self, x, once=False: (
        calls.append((tuple(x.shape), once)), logits(self, x, once))[1])
    summary = segment(config(images, out, weights, batch_size=4), progress=False)
    assert summary["written"] == len(sizes) and summary["resize"] == "short"
    assert 1 <= summary["decoders"] <= 2  # num_workers=2, fewer on a machine of one core
    shapes = summary["batch_shapes"]
    # the short batches, and no full one, are run once (no cuDNN set-up on a GPU): a
    # shape has one short batch, after its full ones
    assert sorted((n, h, w) for (n, _, h, w), once in calls if once) == sorted(
        (n, h, w) for n, h, w, k in shapes if n < 4 for _ in range(k))
    assert all(k == 1 for n, h, w, k in shapes if n < 4)
    assert any(once for _, once in calls) and not all(once for _, once in calls)
    # 90x60, 45x30, 120x80, 330x220 (resized in its worker) make one batch; 60x90 and 50x75 another
    assert [4, SIZE, 96, 1] in shapes and [2, 96, SIZE, 1] in shapes, shapes
    assert len(shapes) == 5 and sum(n * k for n, _, _, k in shapes) == len(sizes)
    paths = [images / rel for rel in sizes]
    expected = dict(zip(sizes, torchvision_masks(reference_model(weights), "deeplabv3_resnet50", *paths),
                        strict=True))
    for rel, (w, h) in sizes.items():
        assert len(np.unique(expected[rel])) > 1, "a mask of one class would say little"
        mask = mask_of(out, rel)
        assert mask.shape == (h, w) and np.array_equal(mask, expected[rel]), rel
    fit = segment(config(images, tmp_path / "fit", weights, batch_size=4, resize="fit"), progress=False)
    assert fit["batch_shapes"] == [[1, SIZE, SIZE, 1], [4, SIZE, SIZE, 2]]
    # (a square photo has no pad: there only the resize and the mask scaling differ)
    wrong = [(mask_of(tmp_path / "fit", rel) != expected[rel]).mean() for rel, (w, h) in sizes.items() if w != h]
    assert min(wrong) > 0.02 and np.mean(wrong) > 0.05, wrong
    labels = json.loads((out / "labels.json").read_text())
    assert labels["preprocessing"] == {"resize": "short", "size": SIZE, "max_size": 4 * SIZE,
                                       "interpolation": "bilinear", "antialias": True,
                                       "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    assert labels["arch"] == "deeplabv3_resnet50" and labels["num_classes"] == NUM_CLASSES


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if "101" in a else a
                                  for a in ARCHITECTURES])
def test_every_arch_runs_with_random_weights_and_matches_torchvision(tmp_path, arch):
    """Each torchvision segmentation model through --weights, on small photographs."""
    path = random_weights_file(tmp_path / "w.pth", arch=arch)
    images = tmp_path / "photos"
    sizes = photo_set(images, [("chelsea.png", (45, 30), "png"), ("coffee.png", (60, 40), "jpg"),
                               ("rocket.jpg", (30, 50), "jpg")])
    summary = segment(config(images, tmp_path / "out", path, arch=arch, batch_size=2, num_workers=0,
                             num_consumers=1), progress=False)
    assert summary["written"] == 3 and summary["arch"] == arch and summary["num_classes"] == NUM_CLASSES
    assert summary["batch_shapes"] == sorted([[2, SIZE, 96, 1], [1, 106, SIZE, 1]])
    expected = torchvision_masks(reference_model(path, arch=arch), arch, *(images / rel for rel in sizes))
    for rel, mask in zip(sizes, expected, strict=True):
        assert np.array_equal(mask_of(tmp_path / "out", rel), mask), rel
    labels = json.loads((tmp_path / "out" / "labels.json").read_text())
    assert labels["arch"] == arch and labels["weights"] == f"file {path}"
    assert labels["weights_preset"].endswith(".COCO_WITH_VOC_LABELS_V1")


def test_resume_skips_done_images_and_overwrite_redoes_them(tmp_path, small):
    images, out = tmp_path / "images", tmp_path / "out"
    (images / "sub").mkdir(parents=True)
    for i, rel in enumerate(["a.png", "b.jpg", "sub/c.webp"]):
        Image.fromarray(noise(20 + i, 30, seed=i)).save(images / rel)
    (images / "bad.png").write_bytes(b"")
    first = segment(config(images, out, small), progress=False)
    assert first["written"] == 3 and first["skipped"] == 1
    done = output_paths(out, "a.png")["mask"]
    kept = done.stat().st_ino  # a mask written again is a new file (written aside, then replaced)
    output_paths(out, "sub/c.webp")["mask"].unlink()
    again = segment(config(images, out, small), progress=False)
    assert again["already_done"] == 2 and again["written"] == 1
    assert again["skipped"] == 1, "bad files are retried and reported again"
    assert done.stat().st_ino == kept
    redo = segment(config(images, out, small, overwrite=True), progress=False)
    assert redo["written"] == 3 and done.stat().st_ino != kept
    (images / "bad.png").unlink()
    nothing = segment(config(images, out, small), progress=False)
    assert nothing["written"] == 0 and nothing["already_done"] == 3
    # nothing to do: the model is never run; the keys are there, null, as in build-index's
    # summary of a run with nothing to encode (the README: both jobs, the same field names)
    assert nothing["engine"] is None and nothing["timing"] is None
    assert nothing["batch_shapes"] == [] and nothing["decoders"] == 0  # the README's keys, empty
    assert list(nothing["phases"]) == ["list_s", "segment_s", "finish_s"]
    with_logits = segment(config(images, out, small, save_logits=True), progress=False)
    assert with_logits["written"] == 3, "an output asked for and missing makes the image redone"


def test_a_resume_in_another_precision_is_recorded_and_told(tmp_path, small, caplog):
    """labels.json lists the precisions of the folder's masks: a run finished in another
    one (bf16 after fp32 here; on a GPU, fp16 then a CPU's fp32) says so; a run with
    nothing to do adds none."""
    images, out = three_images(tmp_path)
    segment(config(images, out, small), progress=False)
    labels = lambda: json.loads((out / "labels.json").read_text())["precisions"]  # noqa: E731
    assert labels() == ["float32"]
    Image.fromarray(noise(25, 30, seed=7)).save(images / "3.png")
    with caplog.at_level("WARNING", logger="embedingest"):
        resumed = segment(config(images, out, small, dtype="bf16"), progress=False)
        segment(config(images, out, small, dtype="fp32"), progress=False)
    assert resumed["written"] == 1 and labels() == ["float32", "bfloat16"]
    assert [r.getMessage() for r in caplog.records if "precision" in r.getMessage() or "made in" in r.getMessage()] == [
        f"{out} holds masks made in float32; this run makes them in bfloat16: where two classes score nearly alike "
        "a pixel's class can differ between the two (--dtype fp32 gives the folder's precision, --overwrite redoes "
        "every image)"]


def three_images(tmp_path):
    """``tmp_path/images`` with 0.png, 1.png and 2.png (noise of three sizes), and the
    output folder to give (not made)."""
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        Image.fromarray(noise(20 + i, 30, seed=i)).save(images / f"{i}.png")
    return images, tmp_path / "out"


def test_masks_or_stats_without_labels_are_refused_unless_overwrite(tmp_path, small):
    """labels.json gone, the folder was taken as new: another model's masks stayed beside
    this run's and its stats rows were read under this model's classes, exit 0."""
    images, out = three_images(tmp_path)
    segment(config(images, out, small, stats=True), progress=False)
    (out / "labels.json").unlink()
    (out / "0.png.png").unlink()
    with pytest.raises(ConfigError) as err:
        segment(config(images, out, small, stats=True), progress=False)
    parts = len(part_files(out))
    assert str(err.value) == (f"{str(out)!r} holds the masks of 2 images and {parts} --stats "
                              f"{'part' if parts == 1 else 'parts'} but no labels.json, which says the model that "
                              "made them: pass --overwrite to redo every image, or give another --out")
    (out / "1.png.png").unlink()
    with pytest.raises(ConfigError, match=r"holds the masks of 1 image and \d+ --stats parts? but no labels.json"):
        segment(config(images, out, small), progress=False)
    (out / "2.png.png").unlink()
    with pytest.raises(ConfigError, match=r"holds \d+ --stats parts? but no labels.json"):
        segment(config(images, out, small), progress=False)  # rows alone, and without --stats too
    redo = segment(config(images, out, small, stats=True, overwrite=True), progress=False)
    assert redo["written"] == 3 and (out / "labels.json").is_file()
    assert row_counts(out) == {f"{i}.png": 1 for i in range(3)}


def test_an_unfinished_overwrite_is_finished_by_an_overwrite_only(tmp_path, small, monkeypatch):
    """An --overwrite with other weights stopped part-way (Ctrl-C, kill -9): the resume the
    message invited kept the old model's masks of the images not yet redone, under the new
    labels.json, as done."""
    import embedingest.jobs.segment as job

    images, out = three_images(tmp_path)
    segment(config(images, out, small), progress=False)
    real = job.segment_on_device

    def stopped(config, *args, before_writes=None, **kw):
        before_writes()
        raise KeyboardInterrupt  # after labels and deletes, before the images are all redone

    monkeypatch.setattr(job, "segment_on_device", stopped)
    with pytest.raises(KeyboardInterrupt):
        segment(config(images, out, small, overwrite=True), progress=False)
    monkeypatch.setattr(job, "segment_on_device", real)
    with pytest.raises(ConfigError) as err:
        segment(config(images, out, small), progress=False)
    assert str(err.value) == (f"a segment --overwrite run into {str(out)!r} stopped before it redid every image, "
                              "so masks made with the settings before it may remain beside its own: run it "
                              "again with --overwrite")
    assert segment(config(images, out, small, overwrite=True), progress=False)["written"] == 3
    assert hidden_files(out) == []  # the mark goes once every image is redone
    assert segment(config(images, out, small), progress=False)["already_done"] == 3


@pytest.mark.parametrize("kind", ["folder", "link", "special file"])
def test_a_folder_or_link_with_the_marks_name_is_refused_and_left_alone(tmp_path, small, kind):
    """Something else under the overwrite mark's name (a tampered folder): a resume and an
    --overwrite are refused with what to do, and nothing there is removed or followed (an
    --overwrite wrote its mark over a folder or through a link)."""
    from embedingest.jobs.segment.overwrite_mark import OVERWRITING

    images, out = three_images(tmp_path)
    segment(config(images, out, small), progress=False)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    if kind == "folder":
        (out / OVERWRITING).mkdir()
        (out / OVERWRITING / "keep.txt").write_text("mine")
    elif kind == "link":
        (out / OVERWRITING).symlink_to(outside / "keep.txt")
    else:
        os.mkfifo(out / OVERWRITING)  # opened, it would hang the run
    want = (f"{out}/{OVERWRITING} is a {kind}, not the mark (a file) that segment --overwrite keeps there "
            "while it redoes the images: move or delete it, then run again")
    refused_either_way(lambda overwrite: segment(config(images, out, small, overwrite=overwrite), progress=False),
                       want)
    assert (outside / "keep.txt").read_text() == "mine"
    assert kind != "folder" or (out / OVERWRITING / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    shutil.rmtree(out / OVERWRITING) if kind == "folder" else (out / OVERWRITING).unlink()
    assert segment(config(images, out, small), progress=False)["already_done"] == 3


def test_a_photograph_replaced_since_its_mask_is_redone_even_with_an_older_mtime(tmp_path, small, caplog):
    """A photograph replaced by another of the same name kept the first one's mask (and
    statistics row) on every resume. Now it is redone, also where the copy kept an older
    modification time (``cp -p``): its status-change time is what is compared."""
    import logging

    import pandas as pd

    images, out = three_images(tmp_path)
    segment(config(images, out, small, stats=True), progress=False)
    untouched = output_paths(out, "0.png")["mask"].stat().st_ino
    replaced = images / "1.png"
    Image.fromarray(noise(41, 17, seed=9)).save(tmp_path / "new.png")
    os.replace(tmp_path / "new.png", replaced)
    os.utime(replaced, (1, 1))  # older than every mask
    with caplog.at_level(logging.INFO, logger="embedingest"):
        again = segment(config(images, out, small, stats=True), progress=False)
    assert (again["written"], again["already_done"]) == (1, 2)
    assert "1 image changed since its mask was written: redone" in caplog.text
    assert np.asarray(Image.open(output_paths(out, "1.png")["mask"])).shape == (41, 17)
    assert output_paths(out, "0.png")["mask"].stat().st_ino == untouched
    table = pd.read_parquet(out / "stats").set_index("source")
    assert len(table) == 3 and tuple(table.loc["1.png", ["width", "height"]]) == (17, 41)
    assert segment(config(images, out, small, stats=True), progress=False)["already_done"] == 3


def test_overwrite_drops_each_image_s_earlier_overlay_and_logits(tmp_path, small):
    """--overwrite (another model, say) without --overlay --save-logits kept the earlier
    overlays and logits, and a later run asking for them took them as done."""
    images, out = three_images(tmp_path)
    segment(config(images, out, small, overlay=True, save_logits=True), progress=False)
    paths = output_paths(out, "0.png")
    assert paths["overlay"].is_file() and paths["logits"].is_file()
    assert segment(config(images, out, small, overwrite=True), progress=False)["written"] == 3
    assert paths["mask"].is_file() and not paths["overlay"].exists() and not paths["logits"].exists()
    again = segment(config(images, out, small, overlay=True, save_logits=True), progress=False)
    assert again["written"] == 3 and paths["overlay"].is_file()  # redone, not taken as done
    kept = segment(config(images, out, small, overlay=True, overwrite=True), progress=False)
    assert kept["written"] == 3 and paths["overlay"].is_file() and not paths["logits"].exists()


def test_a_batch_size_past_the_images_reserves_no_slots_for_them(tmp_path, small):
    """--batch-size 30000 over three images: every host slot was sized for 30000 model
    inputs (490 MB each, 4.6 GB of the process's memory) though each batch held one image."""
    images, out = three_images(tmp_path)
    big = segment(config(images, out, small, batch_size=30_000), progress=False)
    again = segment(config(images, tmp_path / "o2", small, batch_size=3), progress=False)
    assert big["written"] == again["written"] == 3
    assert big["engine"]["slot_bytes"] == again["engine"]["slot_bytes"]  # 30000 inputs: 491 MB a slot


def test_masks_of_other_images_without_labels_are_refused(tmp_path, small):
    """Another model's masks under names this run's images do not have (a folder of an
    earlier archive, labels.json lost) were not noticed: this run wrote its labels beside them."""
    images, out = three_images(tmp_path)
    (out / "2019" / "trip").mkdir(parents=True)
    (out / "2019" / "trip" / "beach.jpg.png").write_bytes(b"a mask")
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError) as err:
        segment(config(images, out, small), progress=False)
    assert str(err.value) == (f"{str(out)!r} holds outputs of a run ('2019/trip/beach.jpg.png' and maybe more) "
                              "but no labels.json, which says the model that made them: pass --overwrite to "
                              "redo every image, or give another --out")
    assert not (out / "labels.json").exists() and not (out / "0.png.png").exists()
    assert first_output_file(out, str(images)) == "2019/trip/beach.jpg.png"
    assert first_output_file(out, str(images), most=2) is None  # a large folder is not walked whole
    (out / "2019" / "trip" / "beach.jpg.png").rename(out / "2019" / "trip" / "beach.png")
    (out / "stats").mkdir()
    (out / "stats" / "x.jpg.png").write_bytes(b"not walked")
    # no output's name (an image's name and an output's suffix): a new folder; and an input
    # folder inside --out, its images' names are no outputs either
    inside = out / "photos"
    images.rename(inside)
    Image.fromarray(noise(24, 24, seed=9)).save(inside / "holiday.jpg.png", "PNG")  # named as a mask is
    assert segment(config(inside, out, small), progress=False)["written"] == 4
    assert (out / "0.png.png").is_file() and (out / "holiday.jpg.png.png").is_file()


def test_an_output_name_taken_by_a_folder_skips_that_image_and_a_stats_file_stops_the_run_first(tmp_path, small):
    """A folder at one image's mask (or overlay) name failed the whole run at its first
    write (IsADirectoryError), without --stats it even counted as done; a file named
    stats failed the run after every image, so the next run redid them all."""
    images, out = three_images(tmp_path)
    (out / "1.png.png").mkdir(parents=True)
    (out / "2.png.overlay.jpg").mkdir()
    first = segment(config(images, out, small), progress=False)
    assert (first["images"], first["written"], first["skipped"]) == (3, 2, 1)  # the overlay not asked for
    assert first["skipped_by_reason"] == {"name taken": 1}
    assert [json.loads(line)["reason"] for line in (out / "skipped.jsonl").read_text().splitlines()] == [
        "name taken: the output '1.png.png' is a folder; move or rename it"]
    second = segment(config(images, out, small, overlay=True, overwrite=True), progress=False)
    assert (second["images"], second["written"], second["skipped"]) == (3, 1, 2)
    assert (out / "1.png.png").is_dir() and (out / "2.png.overlay.jpg").is_dir()
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "stats").write_text("a file of the user's")
    with pytest.raises(ConfigError) as err:
        segment(config(images, tmp_path / "o2", small, stats=True), progress=False)
    assert str(err.value) == (f"{str(tmp_path / 'o2' / 'stats')!r} is not a folder, and --stats keeps its table "
                              "in a folder of that name: move that file away, or drop --stats")
    assert sorted(p.name for p in (tmp_path / "o2").iterdir()) == [RUN_LOCK, "skipped.jsonl", "stats"]
    assert segment(config(images, tmp_path / "o2", small), progress=False)["written"] == 3  # without --stats
    (tmp_path / "o2" / "stats").unlink()
    (tmp_path / "o2" / "stats").mkdir()
    for name in ("sales.parquet", "2019"):  # the user's: a reader of stats/ as one table would take them
        (tmp_path / "o2" / "stats" / name).mkdir()
    (tmp_path / "o2" / "stats" / "_SUCCESS").write_text("")  # marked, as readers skip it
    with pytest.raises(ConfigError) as err:
        segment(config(images, tmp_path / "o2", small, stats=True, overwrite=True), progress=False)
    assert str(err.value) == (f"{str(tmp_path / 'o2' / 'stats')!r} holds 2 entries that are not --stats parts "
                              "('2019' and more): pandas.read_parquet of the folder would read them as rows of "
                              "the table; move them out of the folder, or give another --out")
    assert sorted(p.name for p in (tmp_path / "o2" / "stats").iterdir()) == ["2019", "_SUCCESS", "sales.parquet"]
    (tmp_path / "o2" / "stats" / "2019").rmdir()
    with pytest.raises(ConfigError) as err:
        segment(config(images, tmp_path / "o2", small, stats=True), progress=False)
    assert str(err.value) == (f"{str(tmp_path / 'o2' / 'stats')!r} holds 1 entry that is not a --stats part "
                              "('sales.parquet'): pandas.read_parquet of the folder would read it as rows of the "
                              "table; move it out of the folder, or give another --out")
    shutil.rmtree(tmp_path / "o2" / "stats")
    (tmp_path / "o2" / "stats").symlink_to(tmp_path / "elsewhere")  # a run with nothing to do reads no link
    assert segment(config(images, tmp_path / "o2", small), progress=False)["already_done"] == 3


def test_output_inside_the_input_is_not_read_back(tmp_path, small):
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    (images / "IMG_0001.HEIC").write_bytes(b"ftypheic")
    out = images / "masks"
    segment(config(images, out, small), progress=False)
    second = segment(config(images, out, small, overwrite=True), progress=False)
    assert second["images"] == 1 and second["written"] == 1
    assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK, "a.png.png", "labels.json", "skipped.jsonl"]
    assert second["passed_over"] == {".heic": 1}  # the run's own skipped.jsonl is not counted
    Image.fromarray(noise(20, 30)).save(images / ".hidden.png")
    (images / ".cache").mkdir()
    Image.fromarray(noise(20, 30)).save(images / ".cache" / "b.png")
    hidden = segment(config(images, out, small), progress=False)
    assert hidden["images"] == 1 and hidden["passed_over"] == {".heic": 1, "(hidden)": 2}
    (images / ".hidden.png").unlink()
    shutil.rmtree(images / ".cache")
    # a second output folder in the input (another model's, say): the first is another
    # run's output, by its labels.json, skipped and named, not segmented as photographs
    other = segment(config(images, images / "masks2", small), progress=False)
    assert (other["images"], other["written"], other["skipped_by_reason"]) == (2, 1, {"masks": 1})
    assert not (images / "masks2" / "masks").exists()
    (images / "data").mkdir()  # a dataset's own labels.json beside its images: read
    (images / "data" / "labels.json").write_text('{"categories": ["cat"]}')
    Image.fromarray(noise(20, 20)).save(images / "data" / "b.png")
    assert segment(config(images, images / "masks2", small), progress=False)["written"] == 1


def test_an_output_folder_that_holds_the_input_writes_nothing_into_it(tmp_path, small):
    """``--out`` the input folder's parent: the outputs of ``photos/photos/b.png`` went to
    ``photos/b.png.png``, inside the input, and the next run segmented that mask as a
    photograph (``b.png.png.png``). Such an image is skipped, named; the others written."""
    out = tmp_path / "out"
    images = out / "photos"
    (images / "photos" / "deeper").mkdir(parents=True)
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    Image.fromarray(noise(20, 30, seed=1)).save(images / "photos" / "b.png")
    Image.fromarray(noise(20, 30, seed=2)).save(images / "photos" / "deeper" / "c.png")
    Image.fromarray(noise(20, 30, seed=3)).save(images / "photosb.png")  # not under photos/: written
    before = sorted(p.relative_to(images) for p in images.rglob("*"))
    for run in range(2):
        summary = segment(config(images, out, small), progress=False)
        assert (summary["written"], summary["already_done"], summary["skipped"]) == ((2, 0, 2), (0, 2, 2))[run]
        assert sorted(p.relative_to(images) for p in images.rglob("*")) == before, "nothing written in the input"
    assert sorted(p.name for p in out.glob("*.png")) == ["a.png.png", "photosb.png.png"]
    reasons = {json.loads(line)["path"]: json.loads(line)["reason"] for line in open(out / "skipped.jsonl")}
    assert reasons == {str(images / "photos" / name): (
        f"name taken: its output 'photos/{name}.png' would be inside the input folder {str(images)!r} (the "
        "output folder holds it), where the next run would read it as an image; give an --out outside the "
        "input folder") for name in ("b.png", "deeper/c.png")}


def test_single_file_input(tmp_path, weights, reference):
    Image.fromarray(noise(50, 20, seed=4)).save(tmp_path / "one.webp")
    summary = segment(config(tmp_path / "one.webp", tmp_path / "o", weights, num_workers=0,
                             num_consumers=1), progress=False)
    assert summary["written"] == 1
    mask = np.asarray(Image.open(tmp_path / "o" / "one.webp.png"))
    assert mask.shape == (50, 20) and np.array_equal(mask, reference(tmp_path / "one.webp")[0])


def test_segment_images_in_memory(tmp_path, weights, reference):
    pics = [noise(SIZE, SIZE, seed=1), Image.fromarray(noise(30, 90, seed=2)),
            noise(44, 30, channels=1, seed=9, dtype=np.uint16)]
    masks = segment_images(pics, weights=str(weights), size=SIZE, batch_size=2, device="cpu")
    assert [m.shape for m in masks] == [(SIZE, SIZE), (30, 90), (44, 30)]
    Image.fromarray(pics[0]).save(tmp_path / "p.png")
    assert np.array_equal(masks[0], reference(tmp_path / "p.png")[0])
    with pytest.raises(ConfigError, match="image 0: unsupported array"):
        segment_images([np.zeros((4, 4, 3))], weights=str(weights), size=SIZE, device="cpu")


def test_segment_images_takes_file_paths_as_segment_reads_them(tmp_path, weights, reference):
    """Before: a path was taken for an array (``unsupported array: dtype <U9``), and a folder's
    path given as ``images`` was read a character at a time."""
    pic = noise(30, 50, seed=4)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the mask is of the upright picture, as segment() writes it
    Image.fromarray(pic).save(tmp_path / "turned.jpg", exif=exif)
    Image.fromarray(pic).save(tmp_path / "p.png")
    masks = segment_images([tmp_path / "turned.jpg", str(tmp_path / "p.png"), pic, os.fsencode(tmp_path / "p.png")],
                           weights=str(weights), size=SIZE, device="cpu")
    assert [m.shape for m in masks] == [(50, 30), (30, 50), (30, 50), (30, 50)]
    assert np.array_equal(masks[3], masks[1])  # bytes are a path too (they were taken for an array)
    assert np.array_equal(masks[0], reference(tmp_path / "turned.jpg")[0])
    assert np.array_equal(masks[1], reference(tmp_path / "p.png")[0]) and np.array_equal(masks[1], masks[2])
    for one in (str(tmp_path), tmp_path / "p.png"):
        with pytest.raises(ConfigError, match=r"is one path, not a list of pictures: pass \[path\] for one image "
                                              r"file, or call segment\(SegmentConfig\(images=..., out=...\)\) for a folder"):
            segment_images(one, weights=str(weights), size=SIZE, device="cpu")
    with pytest.raises(TypeError):  # what the message once told to call
        segment(images=str(tmp_path), out=str(tmp_path / "o"))
    (tmp_path / "notes.jpg").write_text("hello")
    with pytest.raises(ConfigError, match=rf"^image 1 \({tmp_path / 'notes.jpg'}\): not an image"):
        segment_images([pic, tmp_path / "notes.jpg"], weights=str(weights), size=SIZE, device="cpu")
    with pytest.raises(ConfigError, match=rf"^image 0 \({tmp_path / 'gone.jpg'}\): "):
        segment_images([tmp_path / "gone.jpg"], weights=str(weights), size=SIZE, device="cpu")


def test_an_encoded_image_a_file_object_or_none_is_named_as_no_picture(tmp_path, weights):
    """An uploaded JPEG's bytes were taken for a path: a message holding the whole file,
    ending 'embedded null byte'; a BytesIO or None was 'unsupported array: dtype object'."""
    buf = io.BytesIO()
    Image.fromarray(noise(20, 30)).save(buf, "JPEG")
    data = buf.getvalue()
    with pytest.raises(ConfigError) as err:
        segment_images([noise(20, 30), data], weights=str(weights), size=SIZE, device="cpu")
    assert str(err.value) == (f"image 1: {len(data)} bytes that are no file's path (bytes are taken as a path); "
                              "for an encoded image held in memory pass PIL.Image.open(io.BytesIO(data))")
    with pytest.raises(ConfigError, match=r"^image 0: a BytesIO is not a picture \(an open file: pass "
                                          r"PIL.Image.open\(it\)\); pass a PIL image, a uint8 or uint16 array, or an "
                                          r"image file's path$"):
        segment_images([io.BytesIO(data)], weights=str(weights), size=SIZE, device="cpu")
    with pytest.raises(ConfigError, match=r"^image 0: a NoneType is not a picture; pass a PIL image"):
        segment_images([None], weights=str(weights), size=SIZE, device="cpu")
    [mask] = segment_images([Image.open(io.BytesIO(data))], weights=str(weights), size=SIZE, device="cpu")
    assert mask.shape == (20, 30)


@pytest.mark.parametrize("picture, size", [(np.zeros((0, 40, 3), np.uint8), "40x0"),
                                           (np.zeros((30, 0), np.uint16), "0x30"),
                                           (Image.new("RGB", (0, 7)), "0x7")])
def test_an_empty_picture_in_memory_is_named_not_a_crash(weights, picture, size):
    """A picture of no pixels (an array with a 0 side) stopped the call with a bare
    ZeroDivisionError from the resize."""
    good = noise(20, 30)
    with pytest.raises(ConfigError, match=rf"^image 1: empty picture: {size} pixels; pass one of at least 1x1$"):
        segment_images([good, picture], weights=str(weights), size=SIZE, device="cpu")


def test_config_errors(tmp_path, weights, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    Image.fromarray(noise(8, 8)).save(tmp_path / "a.png")
    with pytest.raises(ConfigError, match="--random-weights"):
        segment(SegmentConfig(images=str(tmp_path), out=str(tmp_path / "o"), size=SIZE,
                              device="cpu"), progress=False)
    with pytest.raises(ConfigError, match="size=8"):
        segment(config(tmp_path, tmp_path / "o", weights, size=8))
    with pytest.raises(ConfigError, match="dtype='half'"):
        segment(config(tmp_path, tmp_path / "o", weights, dtype="half"))
    with pytest.raises(ConfigError, match="num_workers=-2"):
        segment(config(tmp_path, tmp_path / "o", weights, num_workers=-2))
    with pytest.raises(ConfigError, match="decode_ahead=0: must be at least 1"):
        segment(config(tmp_path, tmp_path / "o", weights, decode_ahead=0))
    with pytest.raises(ConfigError, match="is the input folder"):
        segment(config(tmp_path, tmp_path, weights))
    assert not (tmp_path / "skipped.jsonl").exists()
    with pytest.raises(ConfigError, match="needs images"):
        segment(SegmentConfig(out=str(tmp_path / "o")))
    # the CLI's user gave no --out: the message names the option to add
    with pytest.raises(ConfigError, match=r"needs an output folder: give --out DIR \(out= in SegmentConfig\)"):
        segment(SegmentConfig(images=str(tmp_path), random_weights=True))


def test_weights_that_fail_stop_the_decoders_started_before_them(tmp_path, monkeypatch, no_leaks):
    """The decoders start before the model is built (they decode while it loads): weights
    that are missing or do not fit stop the run with the reason and leave no process and
    no output behind."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    image_tree(tmp_path / "images")
    torch.save({"classifier.4.weight": torch.zeros(3, 8, 1, 1)}, tmp_path / "wrong.pt")
    base = dict(images=str(tmp_path / "images"), out=str(tmp_path / "o"), size=SIZE, batch_size=2,
                num_workers=2, num_consumers=1, device="cpu")
    with pytest.raises(ConfigError, match="--random-weights"):
        segment(SegmentConfig(**base), progress=False)
    with pytest.raises(ConfigError, match="do not fit deeplabv3_resnet50 with 3 classes"):
        segment(SegmentConfig(**base, weights=str(tmp_path / "wrong.pt")), progress=False)
    # the --out this run made goes with it (it held a lock and an empty skipped.jsonl)
    assert not (tmp_path / "o").exists()
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="do not fit deeplabv3_resnet50 with 3 classes"):
        segment(SegmentConfig(**base, weights=str(tmp_path / "wrong.pt")), progress=False)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [RUN_LOCK, "notes.txt", "skipped.jsonl"]
    (tmp_path / "o" / "notes.txt").unlink()
    with pytest.raises(ConfigError, match="do not fit deeplabv3_resnet50 with 3 classes"):
        segment(SegmentConfig(**base, weights=str(tmp_path / "wrong.pt")), progress=False)
    assert (tmp_path / "o").is_dir()  # a folder the run did not make stays, emptied of nothing
    # the parents it made for a nested --out go too; those that were there, or hold more, stay
    (tmp_path / "a" / "kept").mkdir(parents=True)
    for nested in ("a/b/c/o", "a/kept/d/o"):
        with pytest.raises(ConfigError, match="do not fit deeplabv3_resnet50 with 3 classes"):
            segment(SegmentConfig(**{**base, "out": str(tmp_path / nested)},
                                  weights=str(tmp_path / "wrong.pt")), progress=False)
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "a").rglob("*")) == ["a/kept"]


@pytest.mark.parametrize("workers, ahead, expected", [(2, 7, 7), (1, 4, 4), (0, 7, None)])
def test_each_decoder_decodes_decode_ahead_chunks_ahead(tmp_path, workers, ahead, expected):
    """A worker that may hold only DataLoader's default two chunks waits, idle, while a
    slow chunk holds back its batch; ``decode_ahead`` is what it may hold (none without
    workers: DataLoader refuses a prefetch in the main process). With workers, chunks
    are taken as they finish."""
    from embedingest.jobs.segment.run import _decoders
    from embedingest.sources.image_decode import Preprocessing

    cfg = SegmentConfig(images=str(tmp_path), out=str(tmp_path / "o"), decode_ahead=ahead)
    headers, _, loader = _decoders(cfg, torch.device("cpu"), [("a.png", str(tmp_path / "a.png"))],
                                   Preprocessing(), workers)
    assert loader.prefetch_factor == expected and loader.num_workers == workers
    assert loader.in_order == (workers == 0)
    assert SegmentConfig().decode_ahead == 4


def test_chunks_taken_as_they_finish_make_the_masks_of_decoding_in_order(tmp_path, small, monkeypatch,
                                                                          no_leaks):
    """With workers, a slow image holds back only its own batch: later chunks are joined
    first, and every mask is the one decoding in this process, in order, makes; bad images
    are reported as ever, and a resumed run makes the missing masks the same again."""
    from embedingest.sources import images as images_module
    from embedingest.sources.shape_batches import ShapeBatchSampler

    images = tmp_path / "images"
    (images / "bad").mkdir(parents=True)
    for i in range(18):
        w, h = [(60, 40), (40, 60), (50, 50)][i % 3]
        Image.fromarray(noise(h, w, seed=i)).save(images / f"{i:02}.{'png' if i % 2 else 'jpg'}")
    bad = bad_files(images / "bad")
    plain = segment(config(images, tmp_path / "plain", small, num_workers=0), progress=False)
    places, prepare_file, place_of = [], images_module.prepare_file, ShapeBatchSampler.chunk_batch

    def slow_first(rel_path, path, *args):
        if rel_path == "00.jpg":
            time.sleep(1.5)
        return prepare_file(rel_path, path, *args)

    def chunk_batch(self, first):
        place = place_of(self, first)
        places.append((place.batch, place.part))
        return place

    monkeypatch.setattr(images_module, "prepare_file", slow_first)
    monkeypatch.setattr(ShapeBatchSampler, "chunk_batch", chunk_batch)
    out = tmp_path / "workers"
    ran = segment(config(images, out, small, num_workers=2), progress=False)
    assert ran["decoders"] == 2 and places != sorted(places), "a later chunk was joined first"
    assert (ran["written"], ran["skipped"]) == (plain["written"], plain["skipped"]) == (18, len(bad))
    rels = sorted(p.name for p in images.glob("*.*"))
    for rel in rels:
        assert np.array_equal(mask_of(out, rel), mask_of(tmp_path / "plain", rel)), rel

    def reported(folder):
        return sorted((os.path.relpath(e["path"], images), e["reason"])
                      for e in map(json.loads, (folder / "skipped.jsonl").read_text().splitlines()))

    assert reported(out) == reported(tmp_path / "plain") and len(reported(out)) == len(bad)
    for rel in rels[::3]:
        output_paths(out, rel)["mask"].unlink()
    again = segment(config(images, out, small, num_workers=2), progress=False)
    assert again["written"] == len(rels[::3]) and again["already_done"] == 18 - len(rels[::3])
    for rel in rels:
        assert np.array_equal(mask_of(out, rel), mask_of(tmp_path / "plain", rel)), rel


def test_preset_holds_the_defaults():
    preset = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "segment.toml")
    assert load_config(SegmentConfig, preset) == SegmentConfig()


def test_an_image_whose_outputs_names_are_too_long_is_skipped_and_the_rest_written(tmp_path, small):
    """Linux allows 255 bytes a name: an image named with 251 (legal) made a mask name of
    259 and a temporary name longer still, and the whole run stopped with ENAMETOOLONG,
    for good (every re-run met it again). Now that image is reported and the others go on;
    a 245-byte name's mask fits (its temporary name is shortened), its overlay does not."""
    images = tmp_path / "in"
    images.mkdir()
    longest, long_ = "a" * 251 + ".png", "b" * 241 + ".jpg"
    for name in ("ok.png", longest, long_):
        Image.fromarray(noise(24, 40)).save(images / name)
    args = [str(images), "--weights", str(small), "--arch", SMALL, "--size", str(SIZE), "--device", "cpu",
            "--num-workers", "0", "--num-consumers", "1", "--json"]
    plain = CliRunner().invoke(segment_command, [*args, "--out", str(tmp_path / "plain")])
    assert plain.exit_code == 3, plain.output
    summary = json.loads(plain.output)
    assert summary["written"] == 2 and summary["skipped_by_reason"] == {"name too long": 1}
    assert sorted(os.listdir(tmp_path / "plain")) == sorted([RUN_LOCK, "labels.json", "skipped.jsonl", "ok.png.png",
                                                             long_ + ".png"])
    assert Image.open(tmp_path / "plain" / (long_ + ".png")).size == (40, 24)
    entry = json.loads((tmp_path / "plain" / "skipped.jsonl").read_text())
    assert entry["path"] == str(images / longest) and entry["stage"] == "write"
    assert entry["reason"] == (f"name too long: its output {longest + '.png'!r} would be 259 bytes, over the 255 a "
                               "file name may have; rename the input")
    overlays = CliRunner().invoke(segment_command, [*args, "--out", str(tmp_path / "overlays"), "--overlay"])
    assert overlays.exit_code == 3, overlays.output
    assert json.loads(overlays.output)["written"] == 1  # the 245-byte name's overlay would take 257
    again = CliRunner().invoke(segment_command, [*args, "--out", str(tmp_path / "plain")])
    assert again.exit_code == 3 and json.loads(again.output)["written"] == 0, again.output


def test_folders_and_images_named_in_another_encoding_get_masks_stats_and_resume(tmp_path, small):
    """Names in Latin-1 (``\\xe9``; Python holds the byte as a surrogate): the stats
    table's ``source`` could not be written (Arrow takes only UTF-8 text), and a folder so
    named could not be read back by Arrow for the resume. ``source`` is the name as
    ``name_as_text`` writes it (``p\\xe9.png``), each image has one row, and the
    re-run finds every image done."""
    def named(raw: bytes) -> str:
        return os.fsdecode(os.fsencode(tmp_path) + raw)

    images, out = named(b"/in\xe9"), named(b"/out\xe9")
    os.mkdir(images)
    for raw in (b"p\xe9.png", b"q.png", b"back\\slash.png"):
        Image.fromarray(noise(24, 40)).save(os.path.join(images, os.fsdecode(raw)))
    cfg = config(images, out, small, stats=True)
    first = segment(cfg, progress=False)
    assert first["written"] == 3 and first["skipped"] == 0 and first["stats_rows"] == 3
    assert os.path.exists(os.path.join(out, os.fsdecode(b"p\xe9.png.png")))

    def rows() -> int:
        return sum(pq.read_metadata(open(part, "rb")).num_rows for part in part_files(out))

    names = {"p\\xe9.png", "q.png", "back\\\\slash.png"}
    assert set(row_counts(out)) == names and rows() == 3
    again = segment(cfg, progress=False)
    assert again["written"] == 0 and again["already_done"] == 3, again
    redo = segment(dataclasses.replace(cfg, overwrite=True), progress=False)
    assert redo["written"] == 3 and set(row_counts(out)) == names and rows() == 3


def test_a_second_run_into_the_same_folder_is_refused_while_the_first_runs(tmp_path, small):
    """Two runs at once into one --out did every image twice, and --stats gave each image
    two rows (the README says one). The second now stops at once, naming the first."""
    import subprocess
    import sys

    images = tmp_path / "in"
    images.mkdir()
    Image.fromarray(noise(24, 40)).save(images / "a.png")
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from embedingest.index.lock import RunLock\n"
        "with RunLock(sys.argv[1], job='segment run', writers=False):\n"
        "    print('held', flush=True); time.sleep(60)\n"), str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        args = [str(images), "--out", str(out), "--weights", str(small), "--arch", SMALL, "--size", str(SIZE),
                "--device", "cpu", "--num-workers", "0", "--num-consumers", "1", "--stats"]
        busy = CliRunner().invoke(segment_command, args)
        assert busy.exit_code == 1 and busy.output == (
            f"Error: another segment run (pid {holder.pid}) is writing {out}; wait for it to end, or stop it "
            "and run again (every mask written so far is kept)\n"), busy.output
        assert sorted(os.listdir(out)) == [RUN_LOCK]
    finally:
        holder.kill()
        holder.wait()
    done = CliRunner().invoke(segment_command, [*args, "--json"])
    assert done.exit_code == 0 and json.loads(done.output)["stats_rows"] == 1, done.output


def test_cli(tmp_path, small):
    images = tmp_path / "in"
    images.mkdir()
    Image.fromarray(noise(24, 40)).save(images / "a.jpg")
    args = [str(images), "--out", str(tmp_path / "o"), "--weights", str(small), "--arch", SMALL,
            "--size", str(SIZE), "--device", "cpu", "--num-workers", "0", "--num-consumers", "1"]
    result = CliRunner().invoke(segment_command, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["written"] == 1
    assert Image.open(tmp_path / "o" / "a.jpg.png").size == (40, 24)
    (images / "b.png").write_bytes(b"")
    result = CliRunner().invoke(segment_command, args)
    assert result.exit_code == 3, result.output
    assert "1 already done" in result.output and "empty file: 1" in result.output
    failed = CliRunner().invoke(segment_command, [str(images), "--out", str(tmp_path / "o"),
                                                  "--size", "8"])
    assert failed.exit_code == 2 and "size=8" in failed.output  # refused before any work


def test_cli_options_match_the_config_fields():
    from embedingest.cli import main

    assert main.commands["segment"] is segment_command
    options = {p.name for p in segment_command.params} - {"config_path", "as_json", "timeline", "trace"}
    assert options == {f.name for f in dataclasses.fields(SegmentConfig)}


@pytest.mark.needs_cuda
def test_segment_on_cuda_matches_cpu(tree, tmp_path, weights, no_leaks):
    images, sizes, bad = tree
    gpu = segment(config(images, tmp_path / "gpu", weights, device="cuda", dtype="fp32",
                         save_logits=True), progress=False)
    cpu = segment(config(images, tmp_path / "cpu", weights, num_workers=0), progress=False)
    assert gpu["written"] == cpu["written"] == len(sizes) and gpu["skipped"] == len(bad)
    assert gpu["engine"]["pinned"] and gpu["engine"]["gpu_idle_source"] in ("nvml", "cuda-events")
    assert 0.0 <= gpu["engine"]["gpu_idle_fraction"] <= 1.0
    for rel, (w, h) in sizes.items():
        a = np.asarray(Image.open(output_paths(tmp_path / "gpu", rel)["mask"]))
        b = np.asarray(Image.open(output_paths(tmp_path / "cpu", rel)["mask"]))
        assert a.shape == (h, w) and (a == b).mean() > 0.99, rel
    fp16 = segment(config(images, tmp_path / "fp16", weights, device="cuda"), progress=False)
    assert fp16["dtype"] == "float16" and fp16["written"] == len(sizes)
    from embedingest.stages import fused_argmax

    compiled = fused_argmax._compiles[(torch.device("cuda", torch.cuda.current_device()), torch.float16, NUM_CLASSES)]
    assert compiled.done.wait(120) and compiled.ok, "the masks' kernel, compiled in the job's thread"


@pytest.mark.needs_cuda
def test_without_a_c_compiler_for_triton_the_masks_take_the_two_steps(tree, tmp_path, weights):
    """Triton builds its launcher with the system's C compiler; on a machine without one
    (``CC`` pointing nowhere, an empty Triton cache) the command still ends 0, says once
    why, and writes the masks a machine with the kernel writes."""
    import subprocess
    import sys

    images, sizes, bad = tree
    args = [sys.executable, "-m", "embedingest", "segment", str(images), "--weights", str(weights),
            "--size", str(SIZE), "--batch-size", "3", "--device", "cuda", "--json"]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"), "CC": str(tmp_path / "no-cc")}
    run = subprocess.run([*args, "--out", str(tmp_path / "two-steps")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 3, run.stderr[-3000:]  # the tree's bad files are reported
    assert json.loads(run.stdout)["written"] == len(sizes)
    assert run.stderr.count("the one-pass masks kernel did not compile") == 1, run.stderr[-3000:]
    kernel = subprocess.run([*args, "--out", str(tmp_path / "kernel")], capture_output=True, text=True,
                            timeout=600)
    assert kernel.returncode == 3 and "did not compile" not in kernel.stderr, kernel.stderr[-3000:]
    for rel in sizes:
        a = np.asarray(Image.open(output_paths(tmp_path / "two-steps", rel)["mask"]))
        b = np.asarray(Image.open(output_paths(tmp_path / "kernel", rel)["mask"]))
        assert np.array_equal(a, b), rel


def test_list_inputs_reads_each_output_folder_once(tmp_path, monkeypatch):
    """Done images come from the output folders' listings, whatever form the input path takes."""
    images, out = tmp_path / "images", tmp_path / "out"
    for rel in ["a.png", "sub/b.jpg", "sub/deeper/c.webp"]:
        (images / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(noise(8, 8, seed=0)).save(images / rel)
    (out / "sub").mkdir(parents=True)
    (out / "sub" / "b.jpg.png").write_bytes(b"mask")
    (out / "a.png.png").write_bytes(b"mask")  # a's logits are missing below
    listed = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: listed.append(p) or real(p))
    monkeypatch.chdir(images)
    for root in (str(images), str(images) + "/", ".", "sub/.."):
        todo, done = list_inputs(SegmentConfig(images=root, out=str(out)), SkipReport())
        assert done == 2 and [rel for rel, _ in todo] == ["sub/deeper/c.webp"], root
        assert os.path.samefile(todo[0][1], images / "sub/deeper/c.webp")
        todo, done = list_inputs(SegmentConfig(images=root, out=str(out), save_logits=True), SkipReport())
        assert done == 0 and len(todo) == 3
    outputs = [p for p in listed if os.fspath(p).startswith(str(out))]  # (the input walk scans too)
    assert len(outputs) == 8 * 3  # out, out/sub, out/sub/deeper: once per call


def test_an_image_linked_from_outside_the_input_folder_is_listed_only_when_asked(tmp_path):
    images, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    images.mkdir()
    elsewhere.mkdir()
    Image.fromarray(noise(8, 8, seed=0)).save(images / "own.png")
    Image.fromarray(noise(8, 8, seed=1)).save(elsewhere / "private.png")
    (images / "planted.png").symlink_to(elsewhere / "private.png")
    report = SkipReport()
    todo, done = list_inputs(SegmentConfig(images=str(images), out=str(tmp_path / "out")), report)
    assert [rel for rel, _ in todo] == ["own.png"] and done == 0
    assert [(e["path"], e["reason"]) for e in report.entries] == [(
        str(images / "planted.png"),
        f"symbolic link out of the input folder: to {os.path.realpath(elsewhere / 'private.png')}, "
        "not read (--follow-outside-links reads it)")]
    todo, _ = list_inputs(SegmentConfig(images=str(images), out=str(tmp_path / "out"),
                                        follow_outside_links=True), SkipReport())
    assert [rel for rel, _ in todo] == ["own.png", "planted.png"]


def test_an_image_swapped_for_a_link_out_of_the_folder_after_the_listing_is_not_read(tmp_path, small,
                                                                                        monkeypatch):
    """The race the listing cannot see: a picture listed, then swapped for a link to one
    outside the input folder before its decoder reads it, is skipped with the listing's
    reason; no mask or overlay of it is written."""
    import embedingest.jobs.segment as job

    images, elsewhere, out = tmp_path / "images", tmp_path / "elsewhere", tmp_path / "out"
    images.mkdir()
    elsewhere.mkdir()
    Image.fromarray(noise(20, 30, seed=0)).save(images / "own.png")
    Image.fromarray(noise(20, 30, seed=1)).save(images / "victim.png")
    Image.fromarray(noise(20, 30, seed=2)).save(elsewhere / "private.png")
    listing = job.list_inputs

    def then_swapped(*args, **kwargs):
        listed = listing(*args, **kwargs)
        (images / "victim.png").unlink()
        (images / "victim.png").symlink_to(elsewhere / "private.png")
        return listed

    monkeypatch.setattr(job, "list_inputs", then_swapped)
    summary = segment(config(images, out, small, overlay=True, num_workers=2), progress=False)
    assert (summary["written"], summary["skipped"]) == (1, 1)
    assert summary["skipped_by_reason"] == {"symbolic link out of the input folder": 1}
    assert output_paths(out, "own.png")["overlay"].exists()
    assert not any(p.exists() for p in output_paths(out, "victim.png").values())


def stats_rows(out) -> list[dict]:
    return pads.dataset(out / "stats").to_table().to_pylist()


def test_stats_rows_are_the_masks_shares_and_resume_exactly_once(tmp_path, small):
    """--stats: a row per image, its shares the class counts of the written mask; rows lost
    with a part (a run killed before its writers committed) make their images redone,
    and every image ends with exactly one row; --overwrite replaces the rows."""
    images, out = tmp_path / "images", tmp_path / "out"
    sizes = photo_set(images) | {"noise.png": (33, 21)}
    Image.fromarray(noise(21, 33, seed=3)).save(images / "noise.png")
    (images / "bad.png").write_bytes(b"")
    first = segment(config(images, out, small, stats=True, num_consumers=2), progress=False)
    assert first["written"] == first["stats_rows"] == len(sizes)
    rows = {r["source"]: r for r in stats_rows(out)}
    assert set(rows) == set(sizes)
    categories = json.loads((out / "labels.json").read_text())["categories"]
    for rel, (w, h) in sizes.items():
        mask = mask_of(out, rel)
        counts = np.bincount(mask.ravel(), minlength=len(categories)) / mask.size
        row = rows[rel]
        assert (row["width"], row["height"]) == (w, h)
        assert np.allclose([row[c] for c in categories], counts, atol=1e-7), rel
    # a killed run: a part's rows never committed, their masks on disk
    parts = sorted((out / "stats").glob("part-*.parquet"))
    lost = set(pq.read_table(parts[0]).column("source").to_pylist())
    parts[0].unlink()
    stale = out / "stats" / f".{parts[0].name}.tmp-99999"  # what a writer killed mid-commit leaves
    stale.write_bytes(b"PAR1 half")
    mine = [out / ".mine.tmp-2", out / ".draft.tmp-3.txt", out / "stats" / ".notes.tmp-7"]  # the user's own
    for path in mine:
        path.write_text("precious")
    again = segment(config(images, out, small, stats=True), progress=False)
    assert not stale.exists()
    assert [p.read_text() for p in mine] == ["precious"] * 3
    assert again["written"] == len(lost) and again["already_done"] == len(sizes) - len(lost)
    sources = [r["source"] for r in stats_rows(out)]
    assert sorted(sources) == sorted(sizes), "each image exactly once"
    nothing = segment(config(images, out, small, stats=True), progress=False)
    assert nothing["written"] == 0 and nothing["already_done"] == len(sizes)
    redo = segment(config(images, out, small, stats=True, overwrite=True), progress=False)
    assert redo["written"] == len(sizes)
    assert sorted(r["source"] for r in stats_rows(out)) == sorted(sizes), "replaced, not added"
    plain = segment(config(images, tmp_path / "plain", small), progress=False)
    assert "stats_rows" not in plain and not (tmp_path / "plain" / "stats").exists()


def test_labels_json_refuses_to_mix_kinds_of_masks(tmp_path, small):
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    Image.fromarray(noise(30, 20)).save(images / "b.png")
    segment(config(images, tmp_path / "out", small), progress=False)
    labels = json.loads((tmp_path / "out" / "labels.json").read_text())
    assert labels["arch"] == SMALL and labels["categories"] == [f"class_{i}" for i in range(NUM_CLASSES)]
    assert labels["palette"][:2] == [[0, 0, 0], [128, 0, 0]] and len(labels["palette"]) == NUM_CLASSES
    assert labels["masks"]["resize"].startswith("the logits scaled bilinearly")
    output_paths(tmp_path / "out", "b.png")["mask"].unlink()
    with pytest.raises(ConfigError, match="other settings.*preprocessing"):
        segment(config(images, tmp_path / "out", small, resize="fit"), progress=False)
    redo = segment(config(images, tmp_path / "out", small, resize="fit", overwrite=True), progress=False)
    assert redo["written"] == 2
    assert json.loads((tmp_path / "out" / "labels.json").read_text())["preprocessing"]["resize"] == "fit"


def test_max_pixels_skips_images_over_the_option_under_pillows_limit(tmp_path, small):
    """An image over --max-pixels but far under Pillow's own guard (89 MP): skipped by the
    option, with the reason naming it; the smaller image is segmented."""
    from PIL import Image as PILImage

    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(60, 50, seed=1)).save(images / "big.png")    # 3000 pixels
    Image.fromarray(noise(20, 30, seed=2)).save(images / "small.png")  # 600 pixels
    assert 3000 < PILImage.MAX_IMAGE_PIXELS
    summary = segment(config(images, tmp_path / "out", small, max_pixels=2000), progress=False)
    assert summary["written"] == 1 and summary["skipped"] == 1
    [entry] = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert entry["path"].endswith("big.png")
    assert entry["reason"].startswith("too large: 50x60 = 3000 pixels is over max_pixels=2000")
    assert summary["skipped_by_reason"] == {"too large": 1}
    again = segment(config(images, tmp_path / "out", small, max_pixels=0), progress=False)
    assert again["written"] == 1 and again["already_done"] == 1 and again["skipped"] == 0


def test_upsample_max_pixels_switches_to_the_model_size_argmax(tmp_path, weights):
    """Over --upsample-max-pixels the mask is the model-size argmax scaled nearest (what
    labels.json says), under it torchvision's pipeline."""
    images = tmp_path / "photos"
    sizes = photo_set(images, [("coffee.png", (120, 80), "png"), ("chelsea.png", (45, 30), "png")])
    out = tmp_path / "out"
    segment(config(images, out, weights, upsample_max_pixels=2000), progress=False)
    expected = torchvision_masks(reference_model(weights), "deeplabv3_resnet50", *(images / r for r in sizes))
    big, small_one = list(sizes)
    assert np.array_equal(mask_of(out, small_one), expected[1])
    assert mask_of(out, big).shape == (80, 120) and not np.array_equal(mask_of(out, big), expected[0])
    assert (mask_of(out, big) == expected[0]).mean() > 0.8  # the same mask, blockier edges
    assert "over 2000 pixels" in json.loads((out / "labels.json").read_text())["masks"]["resize"]


def test_num_classes_and_timeline_through_the_cli(tmp_path, small):
    images = tmp_path / "in"
    images.mkdir()
    for i in range(4):
        Image.fromarray(noise(24 + i, 40, seed=i)).save(images / f"a{i}.jpg")
    args = [str(images), "--out", str(tmp_path / "o"), "--weights", str(small), "--arch", SMALL,
            "--size", str(SIZE), "--device", "cpu", "--num-workers", "0", "--num-consumers", "1",
            "--batch-size", "1", "--json"]
    wrong = CliRunner().invoke(segment_command, [*args, "--num-classes", "7"])
    assert wrong.exit_code == 1 and f"num_classes=7 but the weights from file {small} have {NUM_CLASSES}" in wrong.output
    timeline = tmp_path / "t.png"
    ok = CliRunner().invoke(segment_command, [*args, "--num-classes", str(NUM_CLASSES), "--timeline",
                                              str(timeline), "--overlay", "--overlay-alpha", "1"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["num_classes"] == NUM_CLASSES
    with Image.open(timeline) as im:
        assert im.format == "PNG" and im.width > 200 and im.height > 100
    # --overlay-alpha 1: every classified pixel shows its class colour alone
    mask = mask_of(tmp_path / "o", "a0.jpg")
    overlay = np.asarray(Image.open(output_paths(tmp_path / "o", "a0.jpg")["overlay"])).astype(int)
    palette = np.array(json.loads((tmp_path / "o" / "labels.json").read_text())["palette"])
    shown = mask != 0
    assert shown.mean() > 0.5
    assert np.abs(overlay[shown] - palette[mask[shown]]).mean() < 8
    random = CliRunner().invoke(segment_command, [str(images), "--out", str(tmp_path / "r"),
                                                  "--random-weights", "--arch", SMALL, "--num-classes", "3",
                                                  "--size", str(SIZE), "--device", "cpu",
                                                  "--num-workers", "0", "--num-consumers", "1", "--json"])
    assert random.exit_code == 0, random.output
    assert json.loads(random.output)["num_classes"] == 3
    assert json.loads((tmp_path / "r" / "labels.json").read_text())["categories"] == ["class_0", "class_1", "class_2"]
    # a report file inside --out replaced a mask, or labels.json, for good (the next run: "already done")
    before = {p: p.read_bytes() for p in (tmp_path / "o").rglob("*") if p.is_file()}
    for option, inside in (("--timeline", tmp_path / "o" / "a0.jpg.png"), ("--trace", tmp_path / "o" / "labels.json"),
                           ("--trace", tmp_path / "o" / "sub" / ".." / "t.json")):
        refused = CliRunner().invoke(segment_command, [*args, "--num-classes", str(NUM_CLASSES), option, str(inside)])
        assert refused.exit_code == 1 and refused.output == (
            f"Error: {option} {str(inside)!r} is inside the output folder {str(tmp_path / 'o')!r}, whose files the "
            "run writes and reads back; write it elsewhere (beside the folder)\n"), refused.output
    assert {p: p.read_bytes() for p in (tmp_path / "o").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("resize", ["short", "fit"])
def test_the_masks_kernel_compiles_while_the_model_loads_where_masks_are_scaled(tmp_path, small, monkeypatch, resize):
    """Scaled masks (``--resize short``) have their one-pass kernel compiled in a thread
    from the start (for the scores' dtype and the weights' classes), in the job and in
    ``segment_images``; letterboxed ones (``fit``) take the argmax at model size and start
    no compile."""
    from embedingest.jobs.segment import run as segment_run

    asked = []
    monkeypatch.setattr(segment_run.fused_argmax, "compile_ahead", lambda *a: asked.append(a) or False)
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    summary = segment(config(images, tmp_path / "out", small, resize=resize), progress=False)
    assert summary["written"] == 1
    want = [(torch.device("cpu"), torch.float32, NUM_CLASSES)] if resize == "short" else []
    assert asked == want
    asked.clear()
    [mask] = segment_images([noise(20, 30)], config(images, tmp_path / "out", small, resize=resize))
    assert mask.shape == (20, 30) and asked == want, "segment_images() too"


def test_each_forward_is_marked_for_the_profiler(tmp_path, small, monkeypatch):
    """Each batch's forward is an NVTX range "segment forward" of the "compute" kind."""
    import contextlib

    from embedingest.jobs.segment import run

    marks = []
    monkeypatch.setattr(run, "annotate", lambda name, kind: marks.append((name, kind)) or contextlib.nullcontext())
    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):  # one shape: a batch of 3, then one of 1
        Image.fromarray(noise(20, 30, seed=i)).save(images / f"{i}.png")
    assert segment(config(images, tmp_path / "out", small), progress=False)["written"] == 4
    assert marks == [("segment forward", "compute")] * 2


def _folder_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_stats_folder_that_is_a_link_stops_the_run_and_nothing_there_is_touched(tmp_path, small):
    """OUT/stats a link to a folder of the user's (here: holding the parts a run wrote):
    a run that would add rows, and one with --overwrite that would delete them, stop naming
    the link before writing any mask; the other folder keeps exactly its files."""
    images, out, victim = tmp_path / "images", tmp_path / "out", tmp_path / "victim"
    images.mkdir()
    Image.fromarray(noise(20, 30, seed=1)).save(images / "a.png")
    segment(config(images, out, small, stats=True), progress=False)
    (out / "stats").rename(victim)
    (out / "stats").symlink_to(victim)
    before = _folder_bytes(victim)
    Image.fromarray(noise(24, 30, seed=2)).save(images / "b.png")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=r"stats' \(the --stats folder\) is a symbolic link; .*remove the link"):
            segment(config(images, out, small, stats=True, overwrite=overwrite), progress=False)
        assert _folder_bytes(victim) == before and not output_paths(out, "b.png")["mask"].exists()
    (out / "stats").unlink()
    again = segment(config(images, out, small, stats=True), progress=False)
    assert again["written"] == 2 and sorted(r["source"] for r in stats_rows(out)) == ["a.png", "b.png"]
    assert _folder_bytes(victim) == before


def test_every_image_redone_for_any_reason_ends_with_exactly_one_row(tmp_path, small):
    """An image is redone when an output asked for is missing (an overlay), its mask was
    deleted or is a link, or it has two rows (a folder written before this rule, or rows
    a killed run committed for images that a later run redid): its rows are dropped
    first, so each image has exactly one row after every run; a run without --stats that
    redoes an image drops its row too (a row always describes the mask on disk), and the
    next --stats run redoes that image."""
    images, out = tmp_path / "images", tmp_path / "out"
    images.mkdir()
    for i, rel in enumerate(["a.png", "b.png", "c.png"]):
        Image.fromarray(noise(20 + i, 30, seed=i)).save(images / rel)
    names = ["a.png", "b.png", "c.png"]

    def sources():
        return sorted(r["source"] for r in stats_rows(out))

    segment(config(images, out, small, stats=True), progress=False)
    with_overlay = segment(config(images, out, small, stats=True, overlay=True), progress=False)
    assert with_overlay["written"] == 3 and sources() == names
    output_paths(out, "b.png")["mask"].unlink()
    assert segment(config(images, out, small, stats=True), progress=False)["written"] == 1
    assert sources() == names
    mask = output_paths(out, "c.png")["mask"]
    mask.unlink()
    mask.symlink_to(tmp_path / "elsewhere.png")
    assert segment(config(images, out, small, stats=True), progress=False)["written"] == 1
    assert sources() == names and not mask.is_symlink()
    [part, *_] = part_files(out)
    twice = set(pq.read_table(part).column("source").to_pylist())
    (out / "stats" / "part-0-0-0.parquet").write_bytes(part.read_bytes())  # their rows twice
    healed = segment(config(images, out, small, stats=True), progress=False)
    assert healed["written"] == len(twice) and sources() == names
    output_paths(out, "a.png")["mask"].unlink()
    assert segment(config(images, out, small), progress=False)["written"] == 1
    assert sources() == ["b.png", "c.png"], "redone without --stats: its row is gone, not stale"
    assert segment(config(images, out, small, stats=True), progress=False)["written"] == 1
    assert sources() == names


def test_a_pipe_at_the_skip_report_or_the_labels_is_never_waited_for(tmp_path, small):
    """OUT/skipped.jsonl a named pipe: the run finishes and writes its report there;
    OUT/labels.json one: the run stops at once naming it (before, both waited for a
    writer for ever)."""
    from fault_helpers import unblock_later

    images, out = tmp_path / "images", tmp_path / "out"
    images.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    out.mkdir()
    os.mkfifo(out / "skipped.jsonl")
    unblock_later(out / "skipped.jsonl", 30)
    start = time.monotonic()
    assert segment(config(images, out, small), progress=False)["written"] == 1
    assert (out / "skipped.jsonl").is_file() and time.monotonic() - start < 30
    (out / "labels.json").unlink()
    os.mkfifo(out / "labels.json")
    unblock_later(out / "labels.json", 30)
    output_paths(out, "a.png")["mask"].unlink()
    with pytest.raises(ConfigError, match=r"labels.json is a named pipe \(FIFO\), not a regular file; remove it"):
        segment(config(images, out, small), progress=False)
    assert time.monotonic() - start < 30


def test_settings_are_checked_with_nothing_to_do_and_before_anything_is_deleted(tmp_path, small):
    """A run with every image done still reads the weights and checks labels.json: another
    arch or preprocessing, or a weights file it cannot read, is refused (before: exit 0,
    "3 already done"). A refused --overwrite --stats deletes no row (before: every row was
    dropped before the weights were read)."""
    images, out = three_images(tmp_path)
    segment(config(images, out, small, stats=True), progress=False)
    labels = (out / "labels.json").read_bytes()
    (tmp_path / "garbage.pth").write_bytes(os.urandom(1000))
    refusals = [(small, dict(resize="fit"), "preprocessing"), (small, dict(arch="lraspp_mobilenet_v3_large"), "arch"),
                (tmp_path / "garbage.pth", dict(arch=SMALL), "garbage.pth"),
                (tmp_path / "missing.pth", dict(arch=SMALL), "missing.pth")]
    for overwrite in (False, True):
        for weights, change, named in refusals:
            if overwrite and weights == small:
                continue  # --overwrite takes other settings: that is what it is for
            with pytest.raises(ConfigError, match=named):
                segment(config(images, out, weights, stats=True, overwrite=overwrite, **change), progress=False)
            assert (out / "labels.json").read_bytes() == labels
            assert sorted(r["source"] for r in stats_rows(out)) == ["0.png", "1.png", "2.png"]
    same = segment(config(images, out, small, stats=True), progress=False)
    assert (same["already_done"], same["written"]) == (3, 0)


def test_masks_of_other_weights_never_join_a_folder(tmp_path, small):
    """The same weights file moved or copied resumes the folder (labels.json notes the new
    path); another weights file, even at the same path, or random weights, is refused
    unless --overwrite (before: accepted, labels.json rewritten to claim the new
    weights for every mask). --random-weights are seeded: a resumed run makes the masks
    a whole run makes."""
    images, out = tmp_path / "images", tmp_path / "out"
    images.mkdir()
    for i in range(2):
        Image.fromarray(noise(20 + i, 30, seed=i)).save(images / f"{i}.png")
    moved = tmp_path / "moved_small.pth"
    moved.write_bytes(small.read_bytes())
    segment(config(images, out, small), progress=False)
    output_paths(out, "1.png")["mask"].unlink()
    assert segment(config(images, out, moved), progress=False)["written"] == 1
    assert json.loads((out / "labels.json").read_text())["weights"] == f"file {moved}"
    state = torch.load(small, weights_only=True)
    state["classifier.4.bias"] += 1  # other weights, at the path that resumed the folder
    torch.save(state, moved)
    for other in (dict(weights=moved), dict(weights=None, random_weights=True)):
        with pytest.raises(ConfigError, match=r"holds masks made with other settings \(weights.*differ.*--overwrite"):
            segment(dataclasses.replace(config(images, out, small), **other), progress=False)
    rand = dict(weights=None, random_weights=True)
    whole = segment(dataclasses.replace(config(images, tmp_path / "whole", small), **rand), progress=False)
    segment(dataclasses.replace(config(images, out, small, overwrite=True), **rand), progress=False)
    output_paths(out, "1.png")["mask"].unlink()
    assert segment(dataclasses.replace(config(images, out, small), **rand), progress=False)["written"] == 1
    assert whole["written"] == 2
    for rel in ("0.png", "1.png"):
        assert np.array_equal(mask_of(out, rel), mask_of(tmp_path / "whole", rel)), rel


def test_a_stats_part_cut_short_costs_its_rows_never_the_run(tmp_path, small):
    """A part cut short (a disk that lost its tail): every run stopped with Arrow's
    traceback, --overwrite included. Now its images are redone and their rows written
    again, each image once, the damaged part deleted; --overwrite runs too."""
    images, out = tmp_path / "images", tmp_path / "out"
    images.mkdir()
    for i in range(4):
        Image.fromarray(noise(20 + i, 30, seed=i)).save(images / f"{i}.png")
    segment(config(images, out, small, stats=True, num_consumers=2), progress=False)
    parts = part_files(out)
    lost = set(pq.read_table(parts[0]).column("source").to_pylist())
    parts[0].write_bytes(parts[0].read_bytes()[:100])
    again = segment(config(images, out, small, stats=True), progress=False)
    assert again["written"] == len(lost) and not parts[0].exists()
    assert sorted(r["source"] for r in stats_rows(out)) == [f"{i}.png" for i in range(4)]
    part_files(out)[0].write_bytes(b"PAR1")
    redo = segment(config(images, out, small, stats=True, overwrite=True), progress=False)
    assert redo["written"] == 4 and sorted(r["source"] for r in stats_rows(out)) == [f"{i}.png" for i in range(4)]


def test_images_whose_outputs_would_take_a_name_in_use_are_skipped_and_the_rest_written(tmp_path, small):
    """An image ``a.jpg`` (mask ``a.jpg.png``) beside an input folder ``a.jpg.png/``, and
    input folders named ``labels.json``, ``skipped.jsonl`` or ``stats``: before, every run
    failed (``[Errno 21] Is a directory``, naming a file descriptor) or put masks into the
    statistics folder, which then did not read as a table. Now each such image is skipped
    with the reason and the others are written; the folder reads as one table."""
    import pandas as pd

    images, out = tmp_path / "images", tmp_path / "out"
    rels = ["a.jpg", "a.jpg.png/b.jpg", "labels.json/c.jpg", "skipped.jsonl/d.jpg", "stats/e.jpg",
            "sub/f.jpg", "sub/f.jpg.overlay.jpg/g.jpg", "ok.jpg"]
    for i, rel in enumerate(rels):
        (images / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(noise(20, 30, seed=i)).save(images / rel)
    summary = segment(config(images, out, small, stats=True), progress=False)
    written = ["a.jpg.png/b.jpg", "sub/f.jpg.overlay.jpg/g.jpg", "ok.jpg"]
    assert (summary["written"], summary["skipped"], summary["exit_code"]) == (3, 5, 3)
    entries = {os.path.relpath(e["path"], images): e["reason"] for e in
               map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
    assert entries == {
        "a.jpg": "name taken: its output 'a.jpg.png' would be the folder that the outputs of "
                 "'a.jpg.png/b.jpg' go in; rename one of them",
        "sub/f.jpg": "name taken: its output 'sub/f.jpg.overlay.jpg' would be the folder that the outputs of "
                     "'sub/f.jpg.overlay.jpg/g.jpg' go in; rename one of them",
        **{f"{top}/{name}": f"name taken: its outputs would go in the folder '{top}' of the output, the name "
                            f"of segment's own {what}; rename or move the input folder '{top}'"
           for top, name, what in (("labels.json", "c.jpg", "labels.json"), ("skipped.jsonl", "d.jpg", "skip report"),
                                   ("stats", "e.jpg", "--stats table folder"))}}
    assert all(mask_of(out, rel).shape == (20, 30) for rel in written)
    assert (out / "labels.json").is_file() and (out / "skipped.jsonl").is_file()
    assert sorted(pd.read_parquet(out / "stats")["source"]) == sorted(written)
    again = segment(config(images, out, small, stats=True), progress=False)
    assert (again["already_done"], again["written"], again["skipped"]) == (3, 0, 5)


def test_overwrite_makes_the_statistics_this_run_s_alone(tmp_path, small):
    """--overwrite with another model (other classes) after an input left: before, the old
    parts stayed, with the gone image's row and other class columns, and
    ``pandas.read_parquet`` dropped the differing columns without a word. Now every old
    part is deleted: the table holds this run's rows and columns only."""
    import pandas as pd

    images, out = three_images(tmp_path)
    segment(config(images, out, small, stats=True), progress=False)
    (images / "2.png").unlink()
    other = dataclasses.replace(config(images, out, small, stats=True, overwrite=True, num_classes=3),
                                weights=None, random_weights=True, arch="lraspp_mobilenet_v3_large")
    assert segment(other, progress=False)["written"] == 2
    table = pd.read_parquet(out / "stats")
    assert sorted(table["source"]) == ["0.png", "1.png"]
    assert list(table.columns) == ["source", "width", "height", "class_0", "class_1", "class_2"]


def test_an_out_that_is_a_link_to_nowhere_is_named(tmp_path, small):
    """Before: '[Errno 17] File exists', naming nothing."""
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError) as err:
        segment(config(images, tmp_path / "out", small), progress=False)
    assert str(err.value) == (f"out='{tmp_path / 'out'}' is a symbolic link to '{tmp_path / 'gone'}', which does "
                              "not exist; create that folder, or give another --out")


def test_an_out_that_is_a_file_or_a_list_of_images_is_named(tmp_path, small):
    """The library's out= naming a file stopped with a bare FileExistsError; images= a
    list was 'must be text or none'."""
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(ConfigError) as err:
        segment(config(images, tmp_path / "afile", small), progress=False)
    assert str(err.value) == (f"out='{tmp_path / 'afile'}': '{tmp_path / 'afile'}' is a file, not a folder; give an "
                              "--out folder (it is made where missing)")
    assert (tmp_path / "afile").read_text() == "mine"
    with pytest.raises(ConfigError) as err:
        segment(dataclasses.replace(config(images, tmp_path / "o", small), images=[str(images / "a.png")]),
                progress=False)
    assert str(err.value) == (f"images={[str(images / 'a.png')]!r}: a list; images is one folder or file (a list of "
                              "pictures or paths goes to segment_images(...), which returns their masks)")
    assert not (tmp_path / "o").exists()


def test_fp16_on_the_cpu_is_refused_before_anything_is_written(tmp_path, small):
    """PyTorch's fp16 convolutions on the CPU fall back to a plain loop: a photograph took
    minutes, and Ctrl-C waited for the convolution under way. The run, the library call
    and each CPU process of --devices are refused at once; bf16 runs."""
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(40, 60)).save(images / "a.png")
    message = "dtype='fp16' on the CPU: PyTorch has no fast fp16 convolutions there"
    for kw in (dict(dtype="fp16"), dict(dtype="fp16", device="auto", devices="cpu,cpu")):
        with pytest.raises(ConfigError, match=f"^{message}.*use --dtype fp32 .* or bf16, and fp16 on a GPU$"):
            segment(config(images, tmp_path / "out", small, **kw), progress=False)
        assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=f"^{message}"):
        segment_images([noise(20, 30)], weights=str(small), arch=SMALL, size=SIZE, dtype="fp16", device="cpu")
    r = CliRunner().invoke(segment_command, [str(images), "--out", str(tmp_path / "out"), "--weights", str(small),
                                             "--arch", SMALL, "--size", str(SIZE), "--dtype", "fp16", "--device", "cpu"])
    assert r.exit_code == 1 and r.output.startswith(f"Error: {message}") and r.output.count("\n") == 1, r.output
    bf16 = segment(config(images, tmp_path / "bf16", small, dtype="bf16"), progress=False)
    assert bf16["dtype"] == "bfloat16" and bf16["written"] == 1


def test_an_out_that_cannot_be_made_is_one_error_naming_it(tmp_path, small):
    """An --out below a file, or in /proc, gave `[Errno 20] Not a directory: ...` (a bare
    OSError's text, saying nothing of --out)."""
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    out = images / "a.png" / "masks"
    with pytest.raises(ConfigError) as err:
        segment(config(images, out, small), progress=False)
    assert str(err.value) == (f"cannot make the output folder {str(out)!r}: Not a directory; give an --out where "
                              "folders can be made")
    if os.path.isdir("/proc/self"):
        with pytest.raises(ConfigError, match="^cannot make the output folder '/proc/self/masks': "):
            segment(config(images, "/proc/self/masks", small), progress=False)
