"""The segment job end to end on the real engine (CPU here, CUDA where there is one)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from segment_fixtures import NUM_CLASSES, SIZE, bad_files, image_tree, noise, random_weights_file, \
    reference_model

from embedingest.config import load_config
from embedingest.errors import ConfigError
from embedingest.jobs.segment import SegmentConfig, list_inputs, segment, segment_images
from embedingest.jobs.segment_cli import segment_command
from embedingest.report import SkipReport
from embedingest.sinks.masks import output_paths, restore_mask
from embedingest.sources.image_decode import prepare_file

SMALL = "deeplabv3_mobilenet_v3_large"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return random_weights_file(tmp_path_factory.mktemp("w") / "r50.pth")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A mobilenet DeepLabV3: the same pipeline at a fraction of the CPU time."""
    return random_weights_file(tmp_path_factory.mktemp("w") / "small.pth", arch=SMALL)


@pytest.fixture(scope="module")
def reference(weights):
    """Masks of files computed the plain way (torchvision's model, argmax, resize), each
    with the pixels whose top two classes are within float noise (batch size changes
    the last bits), where either class is right."""
    from embedingest.stages.segmentation import Segmenter, load_segmentation_model

    model = reference_model(weights)
    norm = Segmenter(load_segmentation_model(weights=str(weights)), "cpu", "fp32")

    def masks_of(*paths) -> list[tuple[np.ndarray, np.ndarray]]:
        prepared = [prepare_file("x", str(p), SIZE) for p in paths]
        pixels = torch.from_numpy(np.stack([p for p, _ in prepared]))
        with torch.inference_mode():
            top2 = model(norm.preprocess(pixels))["out"].topk(2, dim=1)
        labels = top2.indices[:, 0].to(torch.uint8).numpy()
        ties = ((top2.values[:, 0] - top2.values[:, 1]) < 1e-3).to(torch.uint8).numpy()
        return [(restore_mask(m, meta), restore_mask(t, meta).astype(bool))
                for m, t, (_, meta) in zip(labels, ties, prepared, strict=True)]

    return masks_of


def same_mask(mask: np.ndarray, expected: tuple[np.ndarray, np.ndarray]) -> bool:
    labels, ties = expected
    return mask.shape == labels.shape and bool(((mask == labels) | ties).all())


@pytest.fixture
def tree(tmp_path):
    images = tmp_path / "images"
    sizes = image_tree(images)
    bad = bad_files(images / "sub")
    return images, sizes, {f"sub/{rel}" for rel in bad}


def config(images, out, weights, **kw) -> SegmentConfig:
    base = dict(images=str(images), out=str(out), weights=str(weights), size=SIZE, batch_size=3,
                num_workers=2, num_consumers=2, device="cpu")
    if "small" in weights.name:
        base.update(arch=SMALL, num_workers=0, num_consumers=1)
    return SegmentConfig(**{**base, **kw})


def hidden_files(folder) -> list[str]:
    return [str(p) for p in folder.rglob(".*")]


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
        assert same_mask(mask, expected[rel]), f"{rel} differs from torchvision"
        assert Image.open(paths["overlay"]).size == (w, h)
        logits = np.load(paths["logits"])
        assert logits.dtype == np.float16 and logits.shape[0] == NUM_CLASSES
        if (w, h) == (SIZE, SIZE):
            # the GPU-side argmax is the argmax of the full logits (the fp16 copy may tie)
            picked = np.take_along_axis(logits, mask[None].astype(np.int64), 0)[0]
            assert np.array_equal(picked, logits.max(0))
    report = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert {os.path.relpath(e["path"], images) for e in report} == bad
    assert all(e["reason"] and e["stage"] == "read" for e in report)
    assert sum(summary["skip_reasons"].values()) == len(bad)
    assert not hidden_files(out), "temporary files left behind"


def test_resume_skips_done_images_and_overwrite_redoes_them(tmp_path, small):
    images, out = tmp_path / "images", tmp_path / "out"
    (images / "sub").mkdir(parents=True)
    for i, rel in enumerate(["a.png", "b.jpg", "sub/c.webp"]):
        Image.fromarray(noise(20 + i, 30, seed=i)).save(images / rel)
    (images / "bad.png").write_bytes(b"")
    first = segment(config(images, out, small), progress=False)
    assert first["written"] == 3 and first["skipped"] == 1
    done = output_paths(out, "a.png")["mask"]
    os.utime(done, (1, 1))
    output_paths(out, "sub/c.webp")["mask"].unlink()
    again = segment(config(images, out, small), progress=False)
    assert again["already_done"] == 2 and again["written"] == 1
    assert again["skipped"] == 1, "bad files are retried and reported again"
    assert done.stat().st_mtime == 1
    redo = segment(config(images, out, small, overwrite=True), progress=False)
    assert redo["written"] == 3 and done.stat().st_mtime != 1
    (images / "bad.png").unlink()
    nothing = segment(config(images, out, small), progress=False)
    assert nothing["written"] == 0 and nothing["already_done"] == 3
    assert "engine" not in nothing, "nothing to do: no model is loaded"
    with_logits = segment(config(images, out, small, save_logits=True), progress=False)
    assert with_logits["written"] == 3, "an output asked for and missing makes the image redone"


def test_output_inside_the_input_is_not_read_back(tmp_path, small):
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(noise(20, 30)).save(images / "a.png")
    (images / "IMG_0001.HEIC").write_bytes(b"ftypheic")
    out = images / "masks"
    segment(config(images, out, small), progress=False)
    second = segment(config(images, out, small, overwrite=True), progress=False)
    assert second["images"] == 1 and second["written"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["a.png.png", "skipped.jsonl"]
    assert second["passed_over"] == {".heic": 1}  # the run's own skipped.jsonl is not counted


def test_single_file_input(tmp_path, weights, reference):
    Image.fromarray(noise(50, 20, seed=4)).save(tmp_path / "one.webp")
    summary = segment(config(tmp_path / "one.webp", tmp_path / "o", weights, num_workers=0,
                             num_consumers=1), progress=False)
    assert summary["written"] == 1
    mask = np.asarray(Image.open(tmp_path / "o" / "one.webp.png"))
    assert mask.shape == (50, 20) and same_mask(mask, reference(tmp_path / "one.webp")[0])


def test_segment_images_in_memory(tmp_path, weights, reference):
    pics = [noise(SIZE, SIZE, seed=1), Image.fromarray(noise(30, 90, seed=2)),
            noise(44, 30, channels=1, seed=9, dtype=np.uint16)]
    masks = segment_images(pics, weights=str(weights), size=SIZE, batch_size=2, device="cpu")
    assert [m.shape for m in masks] == [(SIZE, SIZE), (30, 90), (44, 30)]
    Image.fromarray(pics[0]).save(tmp_path / "p.png")
    assert same_mask(masks[0], reference(tmp_path / "p.png")[0])
    with pytest.raises(ConfigError, match="image 0: unsupported array"):
        segment_images([np.zeros((4, 4, 3))], weights=str(weights), size=SIZE, device="cpu")


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
    with pytest.raises(ConfigError, match="is the input folder"):
        segment(config(tmp_path, tmp_path, weights))
    assert not (tmp_path / "skipped.jsonl").exists()
    with pytest.raises(ConfigError, match="needs images"):
        segment(SegmentConfig(out=str(tmp_path / "o")))


def test_preset_holds_the_defaults():
    preset = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "segment.toml")
    assert load_config(SegmentConfig, preset) == SegmentConfig()


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
    assert failed.exit_code == 1 and "size=8" in failed.output


def test_cli_options_match_the_config_fields():
    from embedingest.cli import main

    assert main.commands["segment"] is segment_command
    options = {p.name for p in segment_command.params} - {"config_path", "as_json", "timeline"}
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
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: listed.append(p) or real(p))
    monkeypatch.chdir(images)
    for root in (str(images), str(images) + "/", ".", "sub/.."):
        todo, done = list_inputs(SegmentConfig(images=root, out=str(out)), SkipReport())
        assert done == 2 and [rel for rel, _ in todo] == ["sub/deeper/c.webp"], root
        assert os.path.samefile(todo[0][1], images / "sub/deeper/c.webp")
        todo, done = list_inputs(SegmentConfig(images=root, out=str(out), save_logits=True), SkipReport())
        assert done == 0 and len(todo) == 3
    assert len(listed) == 8 * 3  # out, out/sub, out/sub/deeper: once per call
