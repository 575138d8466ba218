"""DeepLabV3 from torchvision: loading weights without ever downloading, and the forward pass.

The model is always built empty (``weights=None, weights_backbone=None``), so nothing
is fetched, then filled from, in order: a ``weights`` file; torchvision's
COCO_WITH_VOC_LABELS_V1 checkpoint if it is already in the torch hub cache;
random weights when asked for (to test a pipeline). Otherwise the error says where to
put the file. The auxiliary classifier is only a training aid: its keys are dropped
and the model is built without it, which saves its compute on every batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn
from torchvision.models import segmentation as tvseg

from ..errors import ConfigError

log = logging.getLogger("embedingest")

# name -> (builder, the torchvision weights whose checkpoint, transforms and
# categories apply when no other weights are given)
ARCHITECTURES = {
    "deeplabv3_resnet50": (tvseg.deeplabv3_resnet50,
                           tvseg.DeepLabV3_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1),
    "deeplabv3_resnet101": (tvseg.deeplabv3_resnet101,
                            tvseg.DeepLabV3_ResNet101_Weights.COCO_WITH_VOC_LABELS_V1),
    "deeplabv3_mobilenet_v3_large": (tvseg.deeplabv3_mobilenet_v3_large,
                                     tvseg.DeepLabV3_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1),
}

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Masks are uint8 class indices.
MAX_CLASSES = 256

_HEAD_KEY = "classifier.4.weight"   # the last conv of DeepLabHead: [num_classes, 256, 1, 1]


@dataclass
class SegmentationModel:
    """A loaded model and what is known about its classes and input."""

    model: nn.Module
    arch: str
    num_classes: int
    categories: list[str]
    source: str              # where the weights came from, for logs and summaries
    mean: tuple[float, ...]
    std: tuple[float, ...]
    default_size: int        # the weights' preset input size (520 for DeepLabV3)


def _weights_enum(arch: str):
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise ConfigError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}") from None


def hub_checkpoint_path(arch: str = "deeplabv3_resnet50") -> Path:
    """Where torchvision keeps the pretrained checkpoint of ``arch`` once downloaded."""
    url = _weights_enum(arch)[1].url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a state dict from a file holding one, a training checkpoint with a "model"
    or "state_dict" entry, or a whole pickled module.

    The file is read with ``weights_only=True`` first; only a pickled module needs full
    unpickling, which runs code from the file, so that is logged.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"weights file {str(path)!r} does not exist; pass the path of a "
                          "DeepLabV3 state dict or checkpoint")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as safe_exc:
        log.warning("weights file %s is not a plain state dict (%s); loading it with full "
                    "unpickling: only do this with files you trust", path, safe_exc)
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise ConfigError(f"cannot read weights file {str(path)!r}: {exc}") from exc
    for key in ("model", "state_dict"):
        if isinstance(obj, Mapping) and key in obj and not isinstance(obj[key], torch.Tensor):
            obj = obj[key]
            break
    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"weights file {str(path)!r} holds a {type(obj).__name__}, not a state "
                          "dict, a checkpoint with a 'model' or 'state_dict' entry, or a module")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def load_segmentation_model(arch: str = "deeplabv3_resnet50", weights: str | None = None,
                            num_classes: int | None = None,
                            random_weights: bool = False) -> SegmentationModel:
    """Build ``arch`` and fill it as described in the module docstring; returns it in eval mode."""
    builder, preset = _weights_enum(arch)
    if num_classes is not None and not 1 <= num_classes <= MAX_CLASSES:
        raise ConfigError(f"num_classes={num_classes} is out of range; masks are uint8, so "
                          f"1..{MAX_CLASSES}")
    categories = list(preset.meta["categories"])
    cached = hub_checkpoint_path(arch)
    if weights is not None:
        state, source = read_state_dict(weights), f"file {weights}"
    elif cached.is_file():
        state, source = read_state_dict(cached), f"hub cache {cached}"
    elif random_weights:
        state, source = None, "random"
    else:
        raise ConfigError(
            f"no weights for {arch}: pass --weights FILE (a state dict or checkpoint), or put "
            f"torchvision's {cached.name} (from {preset.url}) at {cached}, or pass "
            "--random-weights to test the pipeline (masks are then meaningless); nothing is "
            "ever downloaded")
    if state is not None:
        state = {k: v for k, v in state.items() if not k.startswith("aux_classifier.")}
        if _HEAD_KEY not in state:
            raise ConfigError(f"weights from {source} have no {_HEAD_KEY!r}: not a torchvision "
                              f"{arch} state dict (first keys: {', '.join(list(state)[:5])})")
        found = state[_HEAD_KEY].shape[0]
        if num_classes is not None and num_classes != found:
            raise ConfigError(f"num_classes={num_classes} but the weights from {source} have "
                              f"{found} classes; drop --num-classes or pass {found}")
        num_classes = found
    num_classes = num_classes or len(categories)
    if num_classes > MAX_CLASSES:
        raise ConfigError(f"the weights from {source} have {num_classes} classes; masks are "
                          f"uint8, so at most {MAX_CLASSES}")
    model = builder(weights=None, weights_backbone=None, num_classes=num_classes, aux_loss=False)
    if state is not None:
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:
            raise ConfigError(f"weights from {source} do not fit {arch} with {num_classes} "
                              f"classes (is --arch right?): {exc}") from exc
    else:
        log.warning("using random weights for %s: masks are meaningless", arch)
    if num_classes != len(categories):
        categories = [f"class_{i}" for i in range(num_classes)]
    transforms = preset.transforms()
    return SegmentationModel(model.eval(), arch, num_classes, categories, source,
                             tuple(transforms.mean), tuple(transforms.std),
                             int(transforms.resize_size[0]))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """fp32/fp16/bf16, or "auto": fp16 on CUDA (tensor cores), fp32 elsewhere (CPU fp16
    convolutions are tens of times slower than fp32)."""
    if name == "auto":
        name = "fp16" if device.type == "cuda" else "fp32"
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"dtype={name!r} is not one of auto, {', '.join(DTYPES)}") from None


class Segmenter:
    """The forward pass on one device: uint8 pictures in, logits or uint8 masks out.

    The model is cast to ``dtype`` (no autocast: DeepLabV3 is convolutions and batch
    norm, which run fine in half precision, and a cast model skips autocast's per-op
    casts); on CUDA weights and inputs are channels-last, the layout cuDNN's tensor-core
    kernels want.
    """

    def __init__(self, loaded: SegmentationModel, device: str | torch.device = "cpu",
                 dtype: str = "auto"):
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.num_classes = loaded.num_classes
        self.memory_format = (torch.channels_last if self.device.type == "cuda"
                              else torch.contiguous_format)
        self.model = loaded.model.to(self.device, self.dtype,
                                     memory_format=self.memory_format).eval()
        shape = (1, 3, 1, 1)
        self.scale = (255.0 * torch.tensor(loaded.std, device=self.device)).view(shape)
        self.shift = (255.0 * torch.tensor(loaded.mean, device=self.device)).view(shape)

    def preprocess(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] on the device -> normalised [B, 3, H, W] in the model dtype."""
        x = pixels.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float()
        x = (x - self.shift) / self.scale
        return x.to(self.dtype).contiguous(memory_format=self.memory_format)

    @torch.inference_mode()
    def logits(self, pixels: torch.Tensor) -> torch.Tensor:
        """Per-class scores [B, C, H, W] at input size, in the model dtype."""
        return self.model(self.preprocess(pixels))["out"]

    @staticmethod
    def masks(logits: torch.Tensor) -> torch.Tensor:
        """Argmax over classes where the logits are (the GPU): uint8 [B, H, W], a C-th of the bytes."""
        return logits.argmax(dim=1).to(torch.uint8)
