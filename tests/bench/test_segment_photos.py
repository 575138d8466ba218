"""The photo benchmark of the segment job, at a tiny size on the CPU (it runs on the GPU
for figures; here only that it runs and measures what it says)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from PIL import Image

from embedingest.bench.segment_photos import PhotoBenchConfig, make_photos, photo_specs


def test_photo_specs_cover_the_sizes_ratios_and_formats():
    cfg = PhotoBenchConfig(photos=400)
    specs = photo_specs(cfg)
    assert len(specs) == 400 and specs == photo_specs(cfg), "the same set every run"
    longs = [max(w, h) for _, w, h, _, _ in specs]
    assert min(longs) >= 240 and max(longs) == 1600
    ratios = {round(max(w, h) / min(w, h), 2) for _, w, h, _, _ in specs}
    assert {1.0, 1.33, 1.5, 1.78} <= ratios and len(ratios) > 20  # camera ratios and odd crops
    assert any(w > h for _, w, h, _, _ in specs) and any(w < h for _, w, h, _, _ in specs)
    formats = [f for *_, f, _ in specs]
    assert 0.2 < formats.count("png") / len(formats) < 0.4
    assert len({s for s, *_ in specs}) == 4


def test_made_photographs_have_their_sizes(tmp_path):
    cfg = PhotoBenchConfig(photos=10, min_side=40, max_side=120)
    made = make_photos(cfg, tmp_path)
    assert made["images"] == 10 and made["jpeg"] + made["png"] == 10
    for (_, w, h, fmt, _), path in zip(photo_specs(cfg), sorted(tmp_path.rglob("*.*")), strict=True):
        with Image.open(path) as im:
            assert im.size == (w, h) and im.format == ("PNG" if fmt == "png" else "JPEG")


@pytest.mark.slow
def test_the_benchmark_runs_on_cpu_at_a_tiny_size(tmp_path, monkeypatch):
    from embedingest.cli import main
    from embedingest.stages import fused_argmax

    compiles = []
    monkeypatch.setattr(fused_argmax, "compile_ahead", lambda *args: compiles.append(args) or False)
    result = CliRunner().invoke(main, ["bench", "segmentation", "--photos", "12", "--photo-sides", "48,96",
                                       "--size", "32", "--arch", "lraspp_mobilenet_v3_large",
                                       "--device", "cpu", "--batch-size", "4",
                                       "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    # only the timed job starts the masks kernel's compile: one the warm-up started could
    # still run when the timed job forks its decoders, which then wait for it
    assert len(compiles) == 1
    assert "| segment job, end to end (the call) | 12 |" in result.output
    out = json.loads((tmp_path / "r.json").read_text())["result"]
    assert out["job"]["images"] == out["forward_alone"]["images"] == out["forward_alone_by_shape"]["images"] == 12
    assert 0 <= out["short_calls_before_last_full"] <= out["short_batches"]
    assert "| forward alone, the same batches by shape" in result.output
    assert sum(n * k for n, _, _, k in out["batch_shapes"]) == 12
    assert out["distinct_shapes"] == len({(h, w) for _, h, w, _ in out["batch_shapes"]}) > 1
    assert out["job_vs_forward"] == pytest.approx(out["job"]["images_per_s"] / out["forward_alone"]["images_per_s"])
    alone = out["forward_alone"]
    assert alone["warm_images_per_s"] == pytest.approx(12 / alone["warm_seconds"])
    assert alone["first_call_cost_s"] == pytest.approx(alone["seconds"] - alone["warm_seconds"], abs=2e-3)
    assert "| forward alone, the same batches again" in result.output
    masked = out["forward_and_masks_alone"]
    assert masked["images"] == 12 and masked["masks"] is True and alone["masks"] is False
    assert "| forward and masks alone (the job's batches in its order" in result.output
    assert out["job_vs_forward_and_masks"] == pytest.approx(out["job"]["images_per_s"] / masked["images_per_s"])


def test_the_warm_up_is_the_timed_job_with_masks_at_the_model_s_size(tmp_path):
    from embedingest.bench.segment_photos import warm_up_config
    from embedingest.jobs.segment import SegmentConfig

    job = SegmentConfig(images=str(tmp_path / "photos"), out=str(tmp_path / "masks"), batch_size=8,
                        num_consumers=3, dtype="fp16", resize="short", size=400)
    warm = warm_up_config(job, tmp_path / "warm", tmp_path / "warm-out")
    assert warm.upsample_max_pixels == 0 and job.upsample_max_pixels == 40_000_000
    assert (warm.images, warm.out) == (str(tmp_path / "warm"), str(tmp_path / "warm-out"))
    rest = {k: v for k, v in vars(job).items() if k not in ("images", "out", "upsample_max_pixels")}
    assert rest == {k: v for k, v in vars(warm).items() if k in rest}


def test_the_calls_recorded_replay_the_jobs_masks(monkeypatch):
    """_Calls keeps each batch's image sizes, and the replay with ``masks`` computes
    each batch's masks at those sizes, as the job did."""
    import torch

    from embedingest.bench import segment_photos
    from embedingest.sources.image_decode import ImageMeta
    from embedingest.stages.segmentation import Segmenter, load_segmentation_model

    loaded = load_segmentation_model("lraspp_mobilenet_v3_large", None, None, random_weights=True)
    segmenter = Segmenter(loaded, "cpu", "fp32")
    metas = [ImageMeta("a", "a", 50, 40, 32, 26), ImageMeta("b", "b", 100, 80, 32, 26)]
    with segment_photos._Calls() as calls:
        logits = segmenter.logits(torch.zeros((2, 3, 26, 32), dtype=torch.uint8), once=True)
        masks, _ = segmenter.image_masks(logits, metas, 4000)
    assert calls == [[2, 26, 32, True, ([[50, 40, 32, 26], [100, 80, 32, 26]], 4000)]]
    assert [tuple(m.shape) for m in masks] == [(40, 50), (26, 32)]  # the second is over 4000 pixels
    seen = []
    real = Segmenter.image_masks

    def spy(self, logits, metas, full_max):
        seen.append(([(m.width, m.height, m.content_width, m.content_height) for m in metas], full_max))
        return real(self, logits, metas, full_max)

    monkeypatch.setattr(Segmenter, "image_masks", spy)
    cfg = segment_photos.PhotoBenchConfig(arch="lraspp_mobilenet_v3_large", size=32, batch_size=2, dtype="fp32")
    out = segment_photos._forward_alone(cfg, "cpu", calls, masks=True)
    assert out["images"] == 2 and out["masks"] is True
    assert seen == [([(50, 40, 32, 26), (100, 80, 32, 26)], 4000)] * 2  # the timed run and the warm one
    seen.clear()
    assert segment_photos._forward_alone(cfg, "cpu", calls)["masks"] is False and seen == []


def test_the_jobs_weights_are_a_file_of_random_ones_drawn_from_the_seed(tmp_path):
    """The job loads its weights from a file, as a user's: the same tensors, the same for
    the same seed, other ones for another."""
    import torch

    from embedingest.bench.segment_photos import random_weights_file
    from embedingest.stages.segmentation import load_segmentation_model

    cfg = PhotoBenchConfig(arch="lraspp_mobilenet_v3_large")
    a = torch.load(random_weights_file(cfg, tmp_path / "a.pth"))
    b = torch.load(random_weights_file(cfg, tmp_path / "b.pth"))
    c = torch.load(random_weights_file(PhotoBenchConfig(arch=cfg.arch, seed=1), tmp_path / "c.pth"))
    loaded = load_segmentation_model(cfg.arch, str(tmp_path / "a.pth")).model.state_dict()
    assert loaded.keys() == a.keys() and all(torch.equal(loaded[k], a[k]) for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["classifier.high_classifier.weight"], c["classifier.high_classifier.weight"])
