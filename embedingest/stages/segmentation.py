"""torchvision's semantic segmentation models: loading weights without ever downloading,
the forward pass, and the masks.

Every model of ``torchvision.models.segmentation`` (FCN, DeepLabV3, LR-ASPP) is built
through ``torchvision.models.get_model`` empty (``weights=None, weights_backbone=None``),
so nothing is fetched, not even a backbone (on the meta device when weights will fill
it: no time goes into random ones), then filled from, in order: a ``weights``
file; the architecture's COCO_WITH_VOC_LABELS_V1 checkpoint if it is already in the
torch hub cache; random weights when asked for (to test a pipeline). Otherwise the error
says where to put the file. The auxiliary classifier is only a training aid: its keys
are dropped and the model is built without it, which saves its compute on every batch.
The weights' preset (``get_model_weights(arch).DEFAULT``) gives the categories and the
preprocessing (``transforms()``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from torch import nn
from torchvision import models as tvmodels
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

from ..config import SEGMENT_ARCHITECTURES
from ..errors import ConfigError
from ..sources.image_decode import ImageMeta, Preprocessing
from ..terminal import counted
from . import fused_argmax
from .device import resolve_dtype

log = logging.getLogger("embedingest")

# Every torchvision segmentation model, by the name get_model knows it.
ARCHITECTURES = SEGMENT_ARCHITECTURES

# Masks are uint8 class indices.
MAX_CLASSES = 256

# The last convolution of the head, [num_classes, channels, 1, 1]: FCN and DeepLabV3
# (FCNHead, DeepLabHead), LR-ASPP.
_HEAD_KEYS = ("classifier.4.weight", "classifier.high_classifier.weight")

# --random-weights are drawn from this seed: a resumed run, and every device process of
# one, builds the same model (unseeded, a resumed run mixed the masks of two).
RANDOM_WEIGHTS_SEED = 0

# Bytes of upsampled scores one mask may hold at once on the device; larger images
# are upsampled a few classes at a time (same result, see ``upsampled_argmax``).
UPSAMPLE_BUDGET = 1 << 29


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
    default_size: int        # the weights' preset resize (520 for every torchvision model)
    interpolation: str = "bilinear"
    antialias: bool = True
    preset: str = ""         # the torchvision weights whose meta and transforms apply
    sha256: str | None = None  # of the weights file; None: random weights (seeded, always the same)

    def preprocessing(self, resize: str = "short", size: int | None = None) -> Preprocessing:
        """The preset's preprocessing, in ``resize`` mode, at ``size`` (default the preset's)."""
        return Preprocessing(resize, size or self.default_size, self.mean, self.std,
                             self.interpolation, self.antialias)


def _weights_enum(arch: str):
    if arch not in ARCHITECTURES:
        raise ConfigError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    return tvmodels.get_model_weights(arch).DEFAULT


def preset_preprocessing(arch: str, resize: str = "short", size: int | None = None) -> Preprocessing:
    """The preprocessing of ``arch``'s weights' preset (what
    ``load_segmentation_model(arch).preprocessing(resize, size)`` gives), without building
    the model: the decoders start before it exists."""
    transforms = _weights_enum(arch).transforms()
    return Preprocessing(resize, size or int(transforms.resize_size[0]), tuple(transforms.mean),
                         tuple(transforms.std), transforms.interpolation.value, bool(transforms.antialias))


def hub_checkpoint_path(arch: str = "deeplabv3_resnet50") -> Path:
    """Where torchvision keeps the pretrained checkpoint of ``arch`` once downloaded."""
    url = _weights_enum(arch).url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def read_state_dict(path: str | os.PathLike, trust: bool = False) -> dict[str, torch.Tensor]:
    """Read a state dict from a file holding one, a training checkpoint with a "model"
    or "state_dict" entry, or (``trust``) a whole pickled module.

    The file is read with ``weights_only=True``, which runs no code from it. A pickled
    module needs full unpickling, which runs whatever code the file holds: it is read
    only when the caller says the file is trusted, and refused otherwise.
    """
    return read_weights(path, trust)[0]


def read_weights(path: str | os.PathLike, trust: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """:func:`read_state_dict`'s state dict, and the sha256 of the bytes it was read from:
    ``labels.json`` records it, so masks of two weights files never share a folder. The
    file is read once (opened without blocking: a pipe is refused, not waited for)."""
    from ..sources.files import NotRegularFile, open_regular

    path = Path(path)
    try:
        with open_regular(path) as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"weights file {str(path)!r} does not exist; pass the path of a "
                          "torchvision segmentation state dict or checkpoint") from None
    except NotRegularFile as exc:
        raise ConfigError(f"weights file {str(path)!r} is not a regular file ({exc.strerror}); pass the "
                          "path of a torchvision segmentation state dict or checkpoint") from None
    except OSError as exc:
        raise ConfigError(f"cannot read weights file {str(path)!r}: {exc.strerror or exc}") from exc
    # hashed beside the load (hashlib lets go of the GIL): the job's start waits for neither twice
    with ThreadPoolExecutor(1, thread_name_prefix="embedingest-weights-hash") as pool:
        digest = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        state = _state_dict(data, path, trust)
        return state, digest.result()


# How the two formats torch.save writes begin: a zip archive, or (before PyTorch 1.6) a
# pickle whose first object is torch's magic number.
_TORCH_STARTS = (b"PK\x03\x04", b"\x80\x02\x8a\x0a" + torch.serialization.MAGIC_NUMBER.to_bytes(10, "little"))


def _not_readable(path: Path, why: str) -> ConfigError:
    return ConfigError(f"weights file {str(path)!r} is not a readable PyTorch weights file ({why}); pass a "
                       "torchvision segmentation state dict or checkpoint saved with torch.save")


def _state_dict(data: bytes, path: Path, trust: bool) -> dict[str, torch.Tensor]:
    """The state dict in ``data``, the bytes of the weights file ``path``. Bytes that are
    no file torch.save writes, or one cut short or damaged, are named so; only a whole file
    the safe loader refuses (objects only unpickling makes) gets the advice of
    ``--trust-weights-file``."""
    if not data.startswith(_TORCH_STARTS):
        raise _not_readable(path, "it is empty" if not data else
                            "it begins as neither of the formats torch.save writes")
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as safe_exc:
        if not isinstance(safe_exc, pickle.UnpicklingError):  # not the safe loader's refusal
            first = str(safe_exc).splitlines()[0][:200] if str(safe_exc) else type(safe_exc).__name__
            raise _not_readable(path, f"cut short or damaged: {first}") from safe_exc
        if not trust:
            raise ConfigError(
                f"weights file {str(path)!r} is not a plain state dict or checkpoint "
                f"({str(safe_exc).splitlines()[0] if str(safe_exc) else type(safe_exc).__name__}); "
                "reading it means unpickling, which runs code from the file: save its "
                "state_dict() instead, or pass --trust-weights-file (trust_weights_file=True) "
                "for a file you trust") from safe_exc
        log.warning("weights file %s is not a plain state dict (%s); loading it with full "
                    "unpickling, as asked: only do this with files you trust", path, safe_exc)
        try:
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
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


def _head_classes(state: Mapping[str, torch.Tensor]) -> int | None:
    for key in _HEAD_KEYS:
        if key in state:
            return int(state[key].shape[0])
    return None


def _built(arch: str, num_classes: int) -> nn.Module:
    return tvmodels.get_model(arch, weights=None, weights_backbone=None, num_classes=num_classes,
                              aux_loss=False)


def _filled(arch: str, num_classes: int, state: Mapping[str, torch.Tensor], source: str) -> nn.Module:
    """``arch`` holding ``state``'s tensors. It is built on the meta device, so no time goes
    into random weights about to be replaced (most of building one), then given the
    state's tensors; should a tensor of the model be missing from a state that loads
    (none of torchvision's models has one), it is built again the usual way."""
    with torch.device("meta"):
        model = _built(arch, num_classes)
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as exc:
        raise ConfigError(f"weights from {source} do not fit {arch} with {num_classes} "
                          f"classes (is --arch right?): {_misfit(model.state_dict(), state)}") from exc
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        model = _built(arch, num_classes)
        model.load_state_dict(state)
    return model


def _misfit(expected: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], shown: int = 3) -> str:
    """How ``state`` differs from the model's ``expected`` tensors: counts and the first
    few keys of each kind (the full lists of another architecture run to thousands of names)."""
    kinds = {"missing": [k for k in expected if k not in state],
             "unexpected": [k for k in state if k not in expected],
             "of another shape": [k for k in expected if k in state and state[k].shape != expected[k].shape]}
    return "; ".join(f"{counted(len(keys), 'key')} {kind} ({', '.join(keys[:shown])}{', ...' if len(keys) > shown else ''})"
                     for kind, keys in kinds.items() if keys)


def load_segmentation_model(arch: str = "deeplabv3_resnet50", weights: str | None = None,
                            num_classes: int | None = None,
                            random_weights: bool = False, trust_weights_file: bool = False,
                            seed: int = RANDOM_WEIGHTS_SEED) -> SegmentationModel:
    """Build ``arch`` and fill it as described in the module docstring; returns it in eval
    mode. ``trust_weights_file``: a ``weights`` file only full unpickling reads (a pickled
    module) is read (see :func:`read_state_dict`). ``seed``: what random weights are drawn
    from (the job always uses the default, so a resumed run builds the same model)."""
    preset = _weights_enum(arch)
    if num_classes is not None and not 1 <= num_classes <= MAX_CLASSES:
        raise ConfigError(f"num_classes={num_classes} is out of range; masks are uint8, so "
                          f"1..{MAX_CLASSES}")
    categories = list(preset.meta["categories"])
    cached = hub_checkpoint_path(arch)
    digest = None
    if weights is not None:
        (state, digest), source = read_weights(weights, trust_weights_file), f"file {weights}"
    elif cached.is_file():
        (state, digest), source = read_weights(cached), f"hub cache {cached}"
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
        found = _head_classes(state)
        if found is None:
            raise ConfigError(f"weights from {source} have none of {', '.join(map(repr, _HEAD_KEYS))}: "
                              f"not a torchvision segmentation state dict (first keys: "
                              f"{', '.join(list(state)[:5])})")
        if num_classes is not None and num_classes != found:
            raise ConfigError(f"num_classes={num_classes} but the weights from {source} have "
                              f"{found} classes; drop --num-classes or pass {found}")
        num_classes = found
    num_classes = num_classes or len(categories)
    if num_classes > MAX_CLASSES:
        raise ConfigError(f"the weights from {source} have {num_classes} classes; masks are "
                          f"uint8, so at most {MAX_CLASSES}")
    if state is not None:
        model = _filled(arch, num_classes, state, source)
    else:
        with torch.random.fork_rng(devices=[]):  # the same model in every run and process
            torch.manual_seed(seed)
            model = _built(arch, num_classes)
        log.warning("using random weights for %s: masks are meaningless", arch)
    if num_classes != len(categories):
        categories = [f"class_{i}" for i in range(num_classes)]
    transforms = preset.transforms()
    return SegmentationModel(model.eval(), arch, num_classes, categories, source,
                             tuple(transforms.mean), tuple(transforms.std),
                             int(transforms.resize_size[0]), transforms.interpolation.value,
                             bool(transforms.antialias), f"{type(preset).__name__}.{preset.name}", digest)


class Segmenter:
    """The forward pass on one device: uint8 pictures in, logits or uint8 masks out.

    The model is cast to ``dtype`` (no autocast: these models are convolutions and batch
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
        self.mean = torch.as_tensor(loaded.mean, dtype=torch.float32, device=self.device).view(-1, 1, 1)
        self.std = torch.as_tensor(loaded.std, dtype=torch.float32, device=self.device).view(-1, 1, 1)
        self.interpolation = InterpolationMode(loaded.interpolation)
        self.antialias = loaded.antialias

    def model_input(self, parts: Sequence[torch.Tensor], size: tuple[int, int]) -> torch.Tensor:
        """uint8 [B, 3, h, w] on the device from pictures uint8 [n, H, W, 3] of any size:
        each part is copied over (``non_blocking`` from pinned memory) and resized to
        ``size`` (h, w) by torchvision's own ``resize`` with the preset's interpolation and
        antialiasing, on the tensor layout ``pil_to_tensor`` gives, so on the CPU the
        pixels are those of ``weights.transforms()`` to the bit; a part already of that
        size is used as it is."""
        out = []
        for pixels in parts:
            x = pixels.to(self.device, non_blocking=True).permute(0, 3, 1, 2)
            if tuple(x.shape[2:]) != tuple(size):
                x = TF.resize(x, list(size), interpolation=self.interpolation, antialias=self.antialias)
            out.append(x)
        return torch.cat(out) if len(out) > 1 else out[0]

    def preprocess(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [B, 3, H, W] -> normalised [B, 3, H, W] in the model dtype, on the device.

        The operations of torchvision's ``convert_image_dtype`` and ``normalize``, in their
        order and in float32 (``/ 255``, ``- mean``, ``/ std``), so the input is the
        preset's to the bit; the cast to the model dtype comes last."""
        x = pixels.to(self.device, non_blocking=True).to(torch.float32) / 255.0
        x = x.sub_(self.mean).div_(self.std)
        return x.to(self.dtype).contiguous(memory_format=self.memory_format)

    @torch.inference_mode()
    def logits(self, pixels: torch.Tensor, once: bool = False) -> torch.Tensor:
        """Per-class scores [B, C, H, W] at input size, in the model dtype.

        ``once``: this batch size at this input shape is run only this once (an image of
        an aspect ratio of its own, a shape's last, short batch), so it runs on PyTorch's
        own convolutions: cuDNN's set-up for a shape and batch size it has not seen costs
        far more host time than the convolutions it would save on one short batch (see
        benchmarks/new_shape_cost.py)."""
        if once and pixels.is_cuda:
            with torch.backends.cudnn.flags(enabled=False):
                return self.model(self.preprocess(pixels))["out"]
        return self.model(self.preprocess(pixels))["out"]

    @staticmethod
    def masks(logits: torch.Tensor) -> torch.Tensor:
        """Argmax over classes where the logits are (the GPU): uint8 [B, H, W], a C-th of the bytes."""
        return logits.argmax(dim=1).to(torch.uint8)

    @torch.inference_mode()
    def image_masks(self, logits: torch.Tensor, metas: Sequence[ImageMeta],
                    full_max_pixels: int | None) -> tuple[list[torch.Tensor], list[ImageMeta]]:
        """One uint8 mask per image, on the device, and the metas saying which size it has.

        An image of at most ``full_max_pixels`` pixels (None: any) gets torchvision's
        pipeline: its logits scaled to the image's size (bilinear, as the model scales
        its own output), then the argmax; the images of one size go in one call (or a
        few, to stay within ``UPSAMPLE_BUDGET`` bytes of scaled scores). Others
        get the argmax at model size, cropped to the image part (``full_mask`` False: the
        sink scales it up nearest-neighbour)."""
        masks: list[torch.Tensor | None] = [None] * len(metas)
        out = list(metas)
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, m in enumerate(metas):
            if full_max_pixels is None or m.width * m.height <= full_max_pixels:
                by_size.setdefault((m.height, m.width), []).append(i)
                out[i] = m._replace(full_mask=True)
            else:
                masks[i] = self.masks(logits[i:i + 1, :, :m.content_height, :m.content_width])[0]
        per_image = logits.shape[1] * logits.element_size()
        for (h, w), index in by_size.items():
            ch, cw = metas[index[0]].content_height, metas[index[0]].content_width
            step = max(1, UPSAMPLE_BUDGET // (per_image * h * w))
            # Rows of one size are taken as slices, one run of neighbours at a time: indexing
            # a CUDA tensor with a list copies the list from pageable memory, and such a copy
            # waits for the stream: the host would wait for every batch's forward.
            for run in _runs(index):
                for k in range(0, len(run), step):
                    a, b = run[k], run[min(k + step, len(run)) - 1] + 1
                    for i, mask in zip(range(a, b), upsampled_argmax(logits[a:b, :, :ch, :cw], (h, w)),
                                       strict=True):
                        masks[i] = mask
        return masks, out


def _runs(index: list[int]) -> list[list[int]]:
    """``index`` (ascending) cut into runs of consecutive numbers."""
    runs: list[list[int]] = []
    for i in index:
        if runs and runs[-1][-1] + 1 == i:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def upsampled_argmax(logits: torch.Tensor, size: tuple[int, int],
                     budget: int = UPSAMPLE_BUDGET) -> torch.Tensor:
    """uint8 [B, H, W]: the argmax of ``logits`` [B, C, h, w] scaled bilinearly to ``size``
    (H, W), ``align_corners=False`` as torchvision's models scale their output. Half-precision
    scores on CUDA (with Triton, once its kernel is compiled) go in one pass that never
    writes the scaled planes (:mod:`.fused_argmax`).

    When all C scaled planes would exceed ``budget`` bytes, the classes are scaled a few at
    a time and the best kept: each plane is scaled on its own either way, and a later
    class replaces the best only when strictly greater, so ties go to the lowest class as
    in ``argmax``: the same mask."""
    if fused_argmax.usable(logits, size):
        return fused_argmax.scaled_argmax(logits, size)
    b, c = logits.shape[:2]
    step = max(1, budget // max(1, b * size[0] * size[1] * logits.element_size()))
    if step >= c:
        up = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
        return up.argmax(dim=1).to(torch.uint8)
    best_value = best_index = None
    for c0 in range(0, c, step):
        up = F.interpolate(logits[:, c0:c0 + step], size=size, mode="bilinear", align_corners=False)
        value, index = up.max(dim=1)
        index += c0
        if best_value is None:
            best_value, best_index = value, index
        else:
            better = value > best_value
            best_value = torch.where(better, value, best_value)
            best_index = torch.where(better, index, best_index)
    return best_index.to(torch.uint8)
