"""Generated images and weights files shared by the segmentation tests."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

NUM_CLASSES = 5
SIZE = 64
SMALL = "deeplabv3_mobilenet_v3_large"  # the same pipeline as ResNet-50 at a fraction of the CPU time


def random_weights_file(path: Path, arch: str = "deeplabv3_resnet50", num_classes: int = NUM_CLASSES,
                        aux_loss: bool = True, wrap: str | None = None) -> Path:
    """Save a randomly initialised torchvision segmentation model (with its aux head where
    it has one, as training checkpoints have) and return the path. ``wrap``: "model" or
    "state_dict" to save a training checkpoint dict, "module" to pickle the whole module."""
    from torchvision.models import get_model

    torch.manual_seed(0)
    model = get_model(arch, weights=None, weights_backbone=None, num_classes=num_classes,
                      aux_loss=aux_loss and not arch.startswith("lraspp"))
    if wrap == "module":
        obj = model
    elif wrap is not None:
        obj = {wrap: {f"module.{k}": v for k, v in model.state_dict().items()}, "epoch": 3}
    else:
        obj = model.state_dict()
    torch.save(obj, path)
    return path


def reference_model(weights: Path, num_classes: int = NUM_CLASSES, arch: str = "deeplabv3_resnet50"):
    """torchvision's model loaded the plain way (aux head and all), to compare against."""
    from torchvision.models import get_model

    model = get_model(arch, weights=None, weights_backbone=None, num_classes=num_classes,
                      aux_loss=not arch.startswith("lraspp"))
    model.load_state_dict(torch.load(weights, weights_only=True))
    return model.eval()


def noise(height: int, width: int, channels: int = 3, seed: int = 0, dtype=np.uint8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    top = np.iinfo(dtype).max
    shape = (height, width) if channels == 1 else (height, width, channels)
    return rng.integers(0, top, shape, dtype=dtype, endpoint=True)


def exif_rotated_jpeg(path: Path, width: int = 48, height: int = 24, orientation: int = 6) -> Path:
    """A JPEG stored ``width`` x ``height``, left half red and right half blue, with an
    EXIF orientation tag: displayed (orientation 6) it is ``height`` x ``width``."""
    a = np.zeros((height, width, 3), np.uint8)
    a[:, : width // 2] = (255, 0, 0)
    a[:, width // 2:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(a).save(path, "JPEG", exif=exif.tobytes(), quality=95)
    return path


def image_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Write good images of every supported kind under ``root``; return rel path -> the
    (width, height) their masks must have."""
    (root / "sub" / "deeper").mkdir(parents=True)
    sizes = {}

    def save(rel, im, **kw):
        im.save(root / rel, **kw)
        sizes[rel] = im.size

    save("rgb.png", Image.fromarray(noise(SIZE, SIZE, seed=1)))
    save("wide.jpg", Image.fromarray(noise(30, 90, seed=2)), quality=90)
    save("sub/tall.webp", Image.fromarray(noise(100, 40, seed=3)))
    save("sub/photo.bmp", Image.fromarray(noise(50, 70, seed=4)))
    # orientation 8: shown turned, 33 x 65 (Pillow 11.2+ reports a TIFF's size upright)
    Image.fromarray(noise(33, 65, seed=5)).save(root / "sub/scan.tif", tiffinfo={0x0112: 8})
    sizes["sub/scan.tif"] = (33, 65)
    save("sub/deeper/gray.png", Image.fromarray(noise(40, 40, channels=1, seed=6)))
    save("sub/deeper/palette.png", Image.fromarray(noise(20, 50, seed=7)).quantize(16))
    save("sub/deeper/alpha.png", Image.fromarray(noise(36, 36, channels=4, seed=8)))
    save("sub/deeper/depth16.png", Image.fromarray(noise(44, 30, channels=1, seed=9, dtype=np.uint16)))
    exif_rotated_jpeg(root / "sub" / "rotated.jpg", 48, 24)
    sizes["sub/rotated.jpg"] = (24, 48)
    return sizes


def bad_files(root: Path) -> dict[str, str]:
    """Write unusable files with image names; return rel path -> the expected reason kind."""
    good = io.BytesIO()
    Image.fromarray(noise(64, 64, seed=10)).save(good, "JPEG")
    png = io.BytesIO()
    Image.fromarray(noise(64, 64, seed=11)).save(png, "PNG")
    (root / "empty.png").write_bytes(b"")
    (root / "notes.jpg").write_text("this is a text file with an image name\n")
    (root / "cut.jpg").write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    (root / "cut.png").write_bytes(png.getvalue()[: len(png.getvalue()) // 2])
    (root / "garbage.webp").write_bytes(b"RIFF\x10\x00\x00\x00WEBPVP8 " + bytes(range(200)))
    return {"empty.png": "empty file", "notes.jpg": "not an image", "cut.jpg": "corrupt or truncated",
            "cut.png": "corrupt or truncated", "garbage.webp": "corrupt or truncated"}


PHOTO_SET = [  # (photo, (width, height), format): aspect ratios 1:1 to 3.2:1 and back
    ("astronaut.png", (72, 72), "png"), ("chelsea.png", (90, 60), "jpg"),
    ("chelsea.png", (45, 30), "png"), ("coffee.png", (120, 80), "png"),
    ("rocket.jpg", (60, 90), "jpg"), ("rocket.jpg", (160, 50), "png"),
    ("coffee.png", (50, 75), "jpg"), ("astronaut.png", (31, 97), "png"),
    ("coffee.png", (330, 220), "jpg"),  # over 16 x 64^2 pixels: resized in the worker
]


def photo_set(root: Path, specs=PHOTO_SET) -> dict[str, tuple[int, int]]:
    """Real photographs (benchmarks/photos) resized to ``specs``: four of them (3:2 at
    four sizes) have one model input shape and make one batch. Returns rel -> (w, h)."""
    photos = Path(__file__).parent.parent / "benchmarks" / "photos"
    root.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for i, (name, (w, h), fmt) in enumerate(specs):
        rel = f"p{i}_{w}x{h}.{fmt}"
        Image.open(photos / name).convert("RGB").resize((w, h), Image.Resampling.LANCZOS).save(
            root / rel, quality=90)
        sizes[rel] = (w, h)
    return sizes


def image_tensor(path) -> torch.Tensor:
    """An RGB image file as torchvision's own decoder reads it (uint8 [3, H, W]); Pillow's
    decode through ``pil_to_tensor`` where torchvision no longer decodes images."""
    import warnings

    try:
        from torchvision.io import ImageReadMode, read_image
    except ImportError:
        from torchvision.transforms.functional import pil_to_tensor

        return pil_to_tensor(Image.open(path).convert("RGB"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return read_image(str(path), ImageReadMode.RGB)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Random weights of the :data:`SMALL` DeepLabV3, saved to a file (import the fixture)."""
    return random_weights_file(tmp_path_factory.mktemp("w") / "small.pth", arch=SMALL)


def small_config(images, out, weights, **kw):
    """A CPU ``SegmentConfig`` of the :data:`SMALL` model at :data:`SIZE`, batches of 3."""
    from embedingest import SegmentConfig

    return SegmentConfig(**{**dict(images=str(images), out=str(out), weights=str(weights), size=SIZE,
                                   batch_size=3, device="cpu", arch=SMALL), **kw})


def refused_either_way(run, want: str) -> None:
    """``run(overwrite)`` refuses with ``want`` (a ConfigError), with ``--overwrite`` or without."""
    from embedingest.errors import ConfigError

    for overwrite in (False, True):
        with pytest.raises(ConfigError) as err:
            run(overwrite)
        assert str(err.value) == want
