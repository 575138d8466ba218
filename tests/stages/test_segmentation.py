"""DeepLabV3 loading (file formats, hub cache, never a download) and the forward helper."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from segment_fixtures import NUM_CLASSES, SIZE, noise, random_weights_file, reference_model
from torchvision.models.segmentation import (DeepLabV3_MobileNet_V3_Large_Weights,
                                             DeepLabV3_ResNet50_Weights)

from embedingest.errors import ConfigError
from embedingest.stages.segmentation import (Segmenter, hub_checkpoint_path,
                                             load_segmentation_model, resolve_dtype)

SMALL = "deeplabv3_mobilenet_v3_large"   # same head and loading path, a quarter of the bytes


@pytest.fixture(scope="module")
def r50_weights(tmp_path_factory):
    return random_weights_file(tmp_path_factory.mktemp("w") / "r50.pth")


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch, tmp_path):
    """Point the hub cache at an empty folder and make any download fail the test."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def refuse(*args, **kwargs):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", refuse)


def pixels(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.stack([noise(SIZE, SIZE, seed=seed + i) for i in range(batch)]))


def test_state_dict_file_with_aux_head(r50_weights):
    loaded = load_segmentation_model(weights=str(r50_weights))
    assert loaded.num_classes == NUM_CLASSES and loaded.source == f"file {r50_weights}"
    assert loaded.model.aux_classifier is None, "the training-only aux head is not built"
    assert loaded.categories == [f"class_{i}" for i in range(NUM_CLASSES)]
    assert loaded.default_size == 520 and loaded.mean == (0.485, 0.456, 0.406)


@pytest.fixture(scope="module")
def small_state(tmp_path_factory):
    plain = random_weights_file(tmp_path_factory.mktemp("w") / "plain.pth", arch=SMALL, num_classes=3)
    return load_segmentation_model(SMALL, weights=str(plain)).model.state_dict()


@pytest.mark.parametrize("wrap", ["model", "state_dict", "module"])
def test_checkpoint_formats(tmp_path, wrap, small_state):
    path = random_weights_file(tmp_path / "w.pth", arch=SMALL, num_classes=3, wrap=wrap)
    loaded = load_segmentation_model(SMALL, weights=str(path))
    assert loaded.num_classes == 3
    expect = small_state
    got = loaded.model.state_dict()
    assert got.keys() == expect.keys() and all(torch.equal(got[k], expect[k]) for k in got)


def test_num_classes_is_checked_against_the_file(r50_weights):
    with pytest.raises(ConfigError, match=rf"num_classes=7 .* {NUM_CLASSES} classes"):
        load_segmentation_model(weights=str(r50_weights), num_classes=7)
    loaded = load_segmentation_model(weights=str(r50_weights), num_classes=NUM_CLASSES)
    assert loaded.num_classes == NUM_CLASSES


def test_hub_cache_file_is_used_without_download(tmp_path):
    path = hub_checkpoint_path(SMALL)
    url = DeepLabV3_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1.url
    assert path == tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[-1]
    path.parent.mkdir(parents=True)
    random_weights_file(path, arch=SMALL, num_classes=21)
    loaded = load_segmentation_model(SMALL)
    assert loaded.source.startswith("hub cache") and loaded.categories[15] == "person"


def test_no_weights_is_a_clear_error():
    with pytest.raises(ConfigError) as info:
        load_segmentation_model()
    message = str(info.value)
    assert "--weights" in message and "--random-weights" in message
    assert str(hub_checkpoint_path()) in message and "deeplabv3_resnet50_coco" in message


def test_random_weights_and_class_limits():
    loaded = load_segmentation_model(SMALL, random_weights=True, num_classes=10)
    assert loaded.source == "random" and loaded.num_classes == 10
    with pytest.raises(ConfigError, match="num_classes=300"):
        load_segmentation_model(SMALL, random_weights=True, num_classes=300)
    with pytest.raises(ConfigError, match="unknown arch 'unet'"):
        load_segmentation_model("unet", random_weights=True)


def test_bad_weights_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_segmentation_model(weights=str(tmp_path / "missing.pth"))
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(ConfigError, match="holds a list"):
        load_segmentation_model(weights=str(tmp_path / "list.pth"))
    torch.save({"backbone.conv1.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ConfigError, match="classifier.4.weight"):
        load_segmentation_model(weights=str(tmp_path / "other.pth"))
    small = random_weights_file(tmp_path / "small.pth", arch=SMALL)
    with pytest.raises(ConfigError, match="is --arch right"):
        load_segmentation_model("deeplabv3_resnet50", weights=str(small))


def test_preprocess_matches_torchvision_normalisation(r50_weights):
    seg = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cpu", "fp32")
    x = pixels()
    ref = DeepLabV3_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1.transforms()
    expect = torch.stack([ref.__class__(resize_size=None)(img.permute(2, 0, 1)) for img in x])
    torch.testing.assert_close(seg.preprocess(x), expect, atol=1e-5, rtol=1e-5)


def test_masks_are_the_argmax_of_the_reference_model(r50_weights):
    seg = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cpu", "auto")
    assert seg.dtype == torch.float32
    x = pixels(3)
    logits = seg.logits(x)
    assert logits.shape == (3, NUM_CLASSES, SIZE, SIZE)
    masks = seg.masks(logits)
    assert masks.dtype == torch.uint8 and torch.equal(masks, logits.argmax(1).to(torch.uint8))
    with torch.inference_mode():
        expect = reference_model(r50_weights)(seg.preprocess(x))["out"].argmax(1)
    assert torch.equal(masks, expect.to(torch.uint8))
    assert int(masks.max()) < NUM_CLASSES and len(masks.unique()) > 1


def test_bf16_on_cpu():
    seg = Segmenter(load_segmentation_model(SMALL, random_weights=True), "cpu", "bf16")
    logits = seg.logits(pixels(1))
    assert logits.dtype == torch.bfloat16 and seg.masks(logits).shape == (1, SIZE, SIZE)


def test_resolve_dtype():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_cuda_forward_channels_last(r50_weights, dtype):
    seg = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cuda", dtype)
    x = pixels(4)
    assert seg.preprocess(x.cuda()).is_contiguous(memory_format=torch.channels_last)
    logits = seg.logits(x.cuda())
    masks = seg.masks(logits)
    assert masks.is_cuda and masks.dtype == torch.uint8
    assert torch.equal(masks, logits.argmax(1).to(torch.uint8))
    cpu = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cpu", "fp32")
    agree = (masks.cpu() == cpu.masks(cpu.logits(x))).float().mean().item()
    assert agree > (0.99 if dtype == "fp32" else 0.9)
