"""Model loading (every torchvision segmentation model, file formats, hub cache, never a
download), the preset's normalisation, the forward helper and the masks."""

from __future__ import annotations

import copy
import os
import re

import numpy as np
from PIL import Image
import pytest
import torch
import torch.nn.functional as F
from segment_fixtures import NUM_CLASSES, SIZE, noise, random_weights_file, reference_model
from torchvision.models import get_model_weights
from torchvision.models.segmentation import (DeepLabV3_MobileNet_V3_Large_Weights,
                                             DeepLabV3_ResNet50_Weights)

from embedingest.errors import ConfigError
from embedingest.sources.image_decode import ImageMeta
from embedingest.stages.device import resolve_dtype
from embedingest.stages.segmentation import (ARCHITECTURES, Segmenter, hub_checkpoint_path,
                                             load_segmentation_model, preset_preprocessing,
                                             upsampled_argmax)

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
    """uint8 [batch, 3, SIZE, SIZE] noise, as the decoders hand pictures over."""
    return torch.from_numpy(np.stack([noise(SIZE, SIZE, seed=seed + i) for i in range(batch)])).permute(0, 3, 1, 2)


def test_every_torchvision_segmentation_model_is_offered():
    from torchvision.models import list_models, segmentation

    assert set(ARCHITECTURES) == set(list_models(module=segmentation)) == {
        "fcn_resnet50", "fcn_resnet101", "deeplabv3_resnet50", "deeplabv3_resnet101",
        "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_arch_has_its_hub_file_and_preset(arch):
    """Where each architecture's checkpoint is looked for (the job test loads every one
    from a file and runs it)."""
    preset = get_model_weights(arch).DEFAULT
    assert hub_checkpoint_path(arch).name == preset.url.rsplit("/", 1)[-1]
    with pytest.raises(ConfigError, match=f"no weights for {arch}.*{hub_checkpoint_path(arch).name}"):
        load_segmentation_model(arch)


def test_lraspp_loads_with_its_own_head(tmp_path):
    path = random_weights_file(tmp_path / "w.pth", arch="lraspp_mobilenet_v3_large", num_classes=3)
    loaded = load_segmentation_model("lraspp_mobilenet_v3_large", weights=str(path))
    assert loaded.num_classes == 3 and loaded.preset == "LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1"
    prep = loaded.preprocessing()
    assert (prep.resize, prep.size, prep.mean, prep.std) == ("short", 520, (0.485, 0.456, 0.406),
                                                             (0.229, 0.224, 0.225))
    with pytest.raises(ConfigError, match="num_classes=4 but .* 3 classes"):
        load_segmentation_model("lraspp_mobilenet_v3_large", weights=str(path), num_classes=4)


def test_state_dict_file_with_aux_head(r50_weights):
    loaded = load_segmentation_model(weights=str(r50_weights))
    assert loaded.num_classes == NUM_CLASSES and loaded.source == f"file {r50_weights}"
    assert loaded.model.aux_classifier is None, "the training-only aux head is not built"
    assert loaded.categories == [f"class_{i}" for i in range(NUM_CLASSES)]
    assert loaded.default_size == 520 and loaded.mean == (0.485, 0.456, 0.406)


def test_weights_from_a_file_are_not_preceded_by_random_ones(r50_weights, monkeypatch):
    """The model is built on the meta device and given the file's tensors: no random
    initialisation runs on real memory (it was most of loading a model), and every
    tensor is the file's."""
    from torch import nn

    inits = []
    real_init = nn.init.kaiming_normal_
    monkeypatch.setattr(nn.init, "kaiming_normal_", lambda t, *a, **k: inits.append(t.is_meta) or real_init(t, *a, **k))
    loaded = load_segmentation_model(weights=str(r50_weights))
    assert inits and all(inits), "random weights were drawn for a model filled from a file"
    saved = {k: v for k, v in torch.load(r50_weights).items() if not k.startswith("aux_classifier.")}
    state = loaded.model.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    assert not any(t.is_meta for t in (*loaded.model.parameters(), *loaded.model.buffers()))


def test_a_tensor_the_weights_do_not_hold_is_built_the_usual_way(r50_weights, monkeypatch):
    """A buffer outside the state dict (none of torchvision's models has one) would stay
    on the meta device: the model is then built with its own initialisation and loaded."""
    from embedingest.stages import segmentation

    real_built = segmentation._built

    def with_extra(arch, num_classes):
        model = real_built(arch, num_classes)
        model.register_buffer("extra", torch.arange(3.0), persistent=False)
        return model

    monkeypatch.setattr(segmentation, "_built", with_extra)
    loaded = load_segmentation_model(weights=str(r50_weights))
    assert torch.equal(loaded.model.extra, torch.arange(3.0))
    saved = torch.load(r50_weights)
    assert torch.equal(loaded.model.classifier[4].weight, saved["classifier.4.weight"])


@pytest.fixture(scope="module")
def small_state(tmp_path_factory):
    plain = random_weights_file(tmp_path_factory.mktemp("w") / "plain.pth", arch=SMALL, num_classes=3)
    return load_segmentation_model(SMALL, weights=str(plain)).model.state_dict()


@pytest.mark.parametrize("wrap", ["model", "state_dict", "module"])
def test_checkpoint_formats(tmp_path, wrap, small_state):
    path = random_weights_file(tmp_path / "w.pth", arch=SMALL, num_classes=3, wrap=wrap)
    if wrap == "module":  # only full unpickling reads it: refused unless the file is trusted
        with pytest.raises(ConfigError, match=r"runs code from the file: save its state_dict\(\) instead, "
                                              r"or pass --trust-weights-file"):
            load_segmentation_model(SMALL, weights=str(path))
    loaded = load_segmentation_model(SMALL, weights=str(path), trust_weights_file=wrap == "module")
    assert loaded.num_classes == 3
    expect = small_state
    got = loaded.model.state_dict()
    assert got.keys() == expect.keys() and all(torch.equal(got[k], expect[k]) for k in got)


class _Planted:
    """What a hostile weights file holds: unpickling it runs ``Path.touch`` on a marker."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def test_a_weights_file_that_would_run_code_is_refused_and_runs_none(tmp_path):
    """Before, a file torch's safe loader refused was unpickled anyway after a warning:
    ``--weights downloaded.pth`` ran whatever the file held."""
    marker, path = tmp_path / "ran", tmp_path / "hostile.pth"
    torch.save({"model": _Planted(str(marker))}, path)
    with pytest.raises(ConfigError, match="is not a plain state dict or checkpoint"):
        load_segmentation_model(SMALL, weights=str(path))
    assert not marker.exists()


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
    with pytest.raises(ConfigError, match="classifier.4.weight.*not a torchvision segmentation"):
        load_segmentation_model(weights=str(tmp_path / "other.pth"))
    small = random_weights_file(tmp_path / "small.pth", arch=SMALL)
    with pytest.raises(ConfigError) as err:
        load_segmentation_model("deeplabv3_resnet50", weights=str(small))
    # the counts and a few keys of each kind, not every name (21 KB of them before)
    assert re.fullmatch(r"weights from file \S+small.pth do not fit deeplabv3_resnet50 with 5 classes \(is --arch "
                        r"right\?\): \d+ keys missing \(([\w.]+, ){3}\.\.\.\); \d+ keys unexpected "
                        r"\(([\w.]+, ){3}\.\.\.\)(; \d+ keys of another shape \(.*\))?", str(err.value))
    assert len(str(err.value)) < 1000


def test_weights_that_are_no_torch_file_or_no_file_are_named_so(tmp_path):
    """Before: an empty file got '(EOFError)', text '(101)', garbage or a file cut short
    torch's message, each with the advice to trust the file (which could not help); a
    pipe or /dev/null 'does not exist'."""
    small = random_weights_file(tmp_path / "small.pth", arch=SMALL).read_bytes()
    advice = "; pass a torchvision segmentation state dict or checkpoint saved with torch.save"
    for name, data, why in (("empty.pth", b"", "it is empty"),
                            ("text.pth", b"hello\n", "it begins as neither of the formats torch.save writes"),
                            ("garbage.pth", bytes(range(256)) * 4, "it begins as neither of the formats torch.save writes"),
                            ("cut.pth", small[:len(small) // 2], "cut short or damaged: ")):
        (tmp_path / name).write_bytes(data)
        for trust in (False, True):
            with pytest.raises(ConfigError) as err:
                load_segmentation_model(SMALL, weights=str(tmp_path / name), trust_weights_file=trust)
            message = str(err.value)
            assert message.startswith(f"weights file '{tmp_path / name}' is not a readable PyTorch weights file "
                                      f"({why}") and message.endswith(advice) and "trust" not in message
    os.mkfifo(tmp_path / "pipe.pth")
    for path, kind in ((tmp_path / "pipe.pth", "a named pipe (FIFO)"), ("/dev/null", "a character device")):
        with pytest.raises(ConfigError) as err:
            load_segmentation_model(SMALL, weights=str(path))
        assert str(err.value) == (f"weights file '{path}' is not a regular file ({kind}); pass the path of a "
                                  "torchvision segmentation state dict or checkpoint")


def test_preprocess_is_torchvisions_normalisation_to_the_bit(r50_weights):
    seg = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cpu", "fp32")
    x = pixels()
    ref = DeepLabV3_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1.transforms(resize_size=None)
    assert torch.equal(seg.preprocess(x), torch.stack([ref(img) for img in x]))


@pytest.mark.parametrize("sizes", [[(90, 60), (45, 30), (120, 80)], [(60, 90)], [(33, 100), (66, 200)]])
def test_model_input_is_the_presets_resize_to_the_bit(tmp_path, sizes):
    """Pictures of several sizes with one model input shape, resized where the model runs:
    each exactly torchvision's ``Resize`` of the preset on the picture alone."""
    from segment_fixtures import image_tensor
    from torchvision.transforms import functional as TF

    from embedingest.sources.image_decode import short_side_size

    seg = Segmenter(load_segmentation_model(SMALL, random_weights=True), "cpu", "fp32")
    pictures = []
    for i, (w, h) in enumerate(sizes):
        Image.fromarray(noise(h, w, seed=i)).save(tmp_path / f"{i}.png")
        pictures.append(image_tensor(tmp_path / f"{i}.png"))
    w, h = short_side_size(*sizes[0], SIZE)
    got = seg.model_input([p.permute(1, 2, 0)[None].contiguous() for p in pictures], (h, w))
    expect = torch.stack([TF.resize(p, [SIZE], antialias=True) for p in pictures])
    assert got.dtype == torch.uint8 and got.shape == expect.shape and torch.equal(got, expect)
    stacked = torch.stack([p.permute(1, 2, 0) for p in pictures]) if len({p.shape for p in pictures}) == 1 else None
    if stacked is not None:  # a part of several pictures of one size: the same
        assert torch.equal(seg.model_input([stacked], (h, w)), expect)


def test_padding_would_change_the_masks(r50_weights):
    """Why batches hold one exact shape instead of padding images to a shared canvas: even a
    pad that normalises to zero changes the scores inside the image (ASPP's image pooling
    averages the whole input, convolutions near the edge see the pad, the 8x upsampling
    grid moves)."""
    seg = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cpu", "fp32")
    x = pixels(1)
    alone = seg.logits(x)
    mean = torch.tensor([round(255 * m) for m in (0.485, 0.456, 0.406)], dtype=torch.uint8)
    padded = torch.cat([x, mean.view(1, 3, 1, 1).expand(1, 3, SIZE, 16)], dim=3)
    inside = seg.logits(padded)[..., :SIZE]
    assert (alone - inside).abs().max() > 0.05 * alone.abs().max()
    assert not torch.equal(seg.masks(alone), seg.masks(inside))


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


def test_image_masks_upsample_the_logits_to_each_image(r50_weights):
    """Masks at each image's size are torchvision's: logits scaled bilinearly, then argmax;
    over the limit, the model-size argmax of the image part (the sink scales it up)."""
    seg = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cpu", "fp32")
    logits = seg.logits(pixels(3))
    metas = [ImageMeta("a", "", 150, 100, SIZE, SIZE), ImageMeta("b", "", 30, 20, SIZE, SIZE),
             ImageMeta("c", "", 150, 100, SIZE, SIZE)]
    masks, out = seg.image_masks(logits, metas, full_max_pixels=None)
    for i, m in enumerate(metas):
        up = F.interpolate(logits[i:i + 1], size=(m.height, m.width), mode="bilinear", align_corners=False)
        assert out[i].full_mask and torch.equal(masks[i], up.argmax(1)[0].to(torch.uint8)), m.rel_path
    masks, out = seg.image_masks(logits, metas, full_max_pixels=20 * 30)
    assert [m.full_mask for m in out] == [False, True, False]
    assert masks[0].shape == (SIZE, SIZE) and torch.equal(masks[0], seg.masks(logits)[0])
    nearest_wrong = F.interpolate(seg.masks(logits)[1:2, None].float(), size=(20, 30))[0, 0]
    assert not torch.equal(masks[1].float(), nearest_wrong), "the test tells the two apart"


@pytest.mark.needs_cuda
def test_image_masks_never_wait_for_the_gpu(r50_weights):
    """The host must run ahead of the GPU: sizes interleaved in a batch (rows 0 and 2 of one
    size) were gathered with a list index, whose copy from pageable memory waits for the
    stream, so the host waited for every batch's forward. CUDA's sync debug mode raises
    on any call that synchronizes."""
    from embedingest.stages import fused_argmax

    seg = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cuda", "fp16")
    logits = seg.logits(pixels(4).cuda())
    metas = [ImageMeta("a", "", 150, 100, SIZE, SIZE), ImageMeta("b", "", 30, 20, SIZE, SIZE),
             ImageMeta("c", "", 150, 100, SIZE, SIZE), ImageMeta("d", "", 150, 100, SIZE, SIZE)]
    # The masks' kernel first, outside the block: its compile (once a process) waits for
    # its test run, which the block refuses, and a failed compile stays failed for the
    # process (a later test's job found its masks made in two steps).
    if fused_argmax.handles(logits, (150, 100)):  # Triton there
        fused_argmax.usable(logits, (150, 100))
        state = fused_argmax._compiles[fused_argmax._key(logits.device, logits.dtype, logits.shape[1])]
        assert state.done.wait(120) and state.ok
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        masks, _ = seg.image_masks(logits, metas, full_max_pixels=None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, m in enumerate(metas):
        up = F.interpolate(logits[i:i + 1], size=(m.height, m.width), mode="bilinear", align_corners=False)
        assert torch.equal(masks[i], up.argmax(1)[0].to(torch.uint8)), m.rel_path


def test_upsampled_argmax_in_parts_is_the_same_mask():
    """Scaling a few classes at a time (big images) keeps the mask, ties included."""
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 9, 11).round(decimals=1)  # rounded: many exact ties
    whole = upsampled_argmax(logits, (23, 31))
    for budget in (1, 23 * 31 * 4 * 2 * 3):
        assert torch.equal(upsampled_argmax(logits, (23, 31), budget=budget), whole)


def _confident_agreement(half: torch.Tensor, ref: torch.Tensor) -> dict:
    """Compare half-precision logits with fp32 ones: ``delta`` is the largest difference;
    where the fp32 margin between the top two classes exceeds 2 * delta the argmax
    cannot change, so there the masks must be equal, not nearly."""
    half, ref = half.float().cpu(), ref.float().cpu()
    delta = (half - ref).abs().max().item()
    top2 = ref.topk(2, dim=1).values
    sure = (top2[:, 0] - top2[:, 1]) > 2 * delta
    mask, ref_mask = half.argmax(1), ref.argmax(1)
    constant = torch.full_like(ref_mask, int(ref_mask.flatten().mode().values))
    other = ref_mask.roll(1, dims=0)  # the masks of other images of the batch
    return {"delta": delta, "range": ref.abs().max().item(), "sure": sure.float().mean().item(),
            "equal_where_sure": torch.equal(mask[sure], ref_mask[sure]),
            "agree": (mask == ref_mask).float().mean().item(),
            "constant": (constant == ref_mask).float().mean().item(),
            "other_images": (other == ref_mask).float().mean().item()}


def check_half_precision(got: dict) -> None:
    """What half-precision masks must meet, and why no wrong mask meets it.

    ``delta`` within 5% of the fp32 logits' range: bf16 keeps 8 significant bits, fp16
    11, so each rounding is within 0.4%; over the network it measured 1.3% (bf16, CPU).
    Skipping the normalisation moves the logits by 70% of that range (0..255 input) or
    more (the ResNet-50 with random weights here: 143 for a range of 1.9).
    Agreement: a constant mask and the masks of other images agree 0.92-0.96 with the
    reference (``constant``, ``other_images``, computed here); half precision must close
    at least half of the rest of the way to 1, and be equal wherever the argmax cannot
    move (the share of such pixels must be most of the image, or that says nothing).
    """
    assert got["delta"] < 0.05 * got["range"], got
    assert got["sure"] > 0.5 and got["equal_where_sure"], got
    baseline = max(got["constant"], got["other_images"])
    assert got["agree"] > baseline + (1 - baseline) / 2, got


def test_bf16_on_cpu(r50_weights):
    loaded = load_segmentation_model(weights=str(r50_weights))
    x = pixels(3)
    ref = Segmenter(copy.deepcopy(loaded), "cpu", "fp32").logits(x)
    seg = Segmenter(loaded, "cpu", "bf16")
    logits = seg.logits(x)
    assert logits.dtype == torch.bfloat16 and seg.masks(logits).shape == (3, SIZE, SIZE)
    got = _confident_agreement(logits, ref)
    check_half_precision(got)
    assert got["constant"] < 0.97 and got["other_images"] < 0.97, got
    # the check catches a cast that skips the normalisation, even half of it
    with torch.inference_mode():
        wrong = seg.model((x.float() / 255).to(torch.bfloat16))["out"]
    with pytest.raises(AssertionError):
        check_half_precision(_confident_agreement(wrong, ref))


def test_resolve_dtype():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        resolve_dtype("fp8", torch.device("cpu"))


@pytest.mark.needs_cuda
def test_cuda_model_input_is_the_cpu_resize_within_rounding():
    """On the GPU torchvision's resize runs CUDA's kernel: the same formula, other float
    rounding, so a pixel may land on the other side of .5 (1 of 255) and no further."""
    seg_cpu = Segmenter(load_segmentation_model(SMALL, random_weights=True), "cpu", "fp32")
    seg_gpu = Segmenter(load_segmentation_model(SMALL, random_weights=True), "cuda", "fp32")
    parts = [torch.from_numpy(noise(h, w, seed=h)[None]) for w, h in [(900, 600), (450, 300), (120, 80)]]
    cpu = seg_cpu.model_input(parts, (520, 780)).int()
    gpu = seg_gpu.model_input([p.pin_memory() for p in parts], (520, 780)).cpu().int()
    assert cpu.shape == gpu.shape == (3, 3, 520, 780)
    assert (cpu - gpu).abs().max() <= 1 and (cpu != gpu).float().mean() < 0.01


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
    got = _confident_agreement(logits, cpu.logits(x))
    print(dtype, got)
    check_half_precision(got)
    if dtype == "fp32":  # TF32 convolutions aside, the same numbers
        assert got["agree"] > 0.99, got


@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_cuda_once_runs_without_cudnn_and_agrees(r50_weights, dtype, monkeypatch):
    """A shape run only once skips cuDNN (its per-shape set-up costs more than it saves on
    one small batch) and gives the CPU's masks as closely as the cuDNN path does."""
    seg = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cuda", dtype)
    x = pixels(2).cuda()
    enabled = []
    convolution = torch.nn.functional.conv2d

    def spy(*args, **kwargs):
        enabled.append(torch.backends.cudnn.enabled)
        return convolution(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "conv2d", spy)
    once = seg.logits(x, once=True)
    assert enabled and not any(enabled), "no convolution of a once-only shape on cuDNN"
    enabled.clear()
    usual = seg.logits(x)
    assert enabled and all(enabled) and torch.backends.cudnn.enabled
    cpu = Segmenter(load_segmentation_model(weights=str(r50_weights)), "cpu", "fp32").logits(x.cpu())
    got, ref = _confident_agreement(once, cpu), _confident_agreement(usual, cpu)
    print(dtype, got, ref)
    assert got["agree"] >= ref["agree"] - 0.01, (got, ref)
    check_half_precision(got)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_preset_preprocessing_is_the_loaded_models(arch):
    """The decoders start with the preset's preprocessing before the model is built: it
    must be the one the built model gives, and the weights' own transforms()."""
    loaded = load_segmentation_model(arch, None, None, random_weights=True)
    for resize, size in (("short", None), ("fit", 320)):
        assert preset_preprocessing(arch, resize, size) == loaded.preprocessing(resize, size)
    transforms = get_model_weights(arch).DEFAULT.transforms()
    prep = preset_preprocessing(arch)
    assert (prep.size, prep.mean, prep.std) == (transforms.resize_size[0], tuple(transforms.mean),
                                                tuple(transforms.std))


def test_weights_are_known_by_their_file_s_sha256_and_random_ones_are_always_the_same(tmp_path):
    """The loaded model carries the sha256 of the file's bytes (what labels.json records);
    --random-weights are seeded: two loads give the same tensors (unseeded, a resumed run
    or a second device process made masks of another model), and the global RNG is left
    as it was."""
    import hashlib

    from embedingest.stages.segmentation import load_segmentation_model

    path = random_weights_file(tmp_path / "w.pth", arch="lraspp_mobilenet_v3_large")
    loaded = load_segmentation_model("lraspp_mobilenet_v3_large", str(path))
    assert loaded.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    one = load_segmentation_model("lraspp_mobilenet_v3_large", random_weights=True)
    assert torch.equal(torch.rand(3), expected_next)
    two = load_segmentation_model("lraspp_mobilenet_v3_large", random_weights=True)
    assert one.sha256 is None and one.source == "random"
    for (name, a), b in zip(one.model.state_dict().items(), two.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
