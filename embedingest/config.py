"""Settings as dataclasses, presets as TOML.

Every job takes one dataclass; every CLI option maps one-to-one onto a field of it
(``--num-consumers`` is ``num_consumers``), and ``--config preset.toml`` fills the same
fields from a file, with options given on the command line winning.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")

# Model precisions a job accepts besides "auto" (fp16 on CUDA, fp32 on the CPU).
DTYPE_NAMES = ("fp32", "fp16", "bf16")

# Every torchvision segmentation model, by the name get_model knows it (the order of
# torchvision's list_models; a test checks the two agree).
SEGMENT_ARCHITECTURES = ("deeplabv3_mobilenet_v3_large", "deeplabv3_resnet101", "deeplabv3_resnet50",
                         "fcn_resnet101", "fcn_resnet50", "lraspp_mobilenet_v3_large")

# How a segment run fits images to the model: "short" (the weights' own preprocessing) or
# "fit" (letterboxed into a square).
RESIZE_MODES = ("short", "fit")

# Larger than any camera photo (a 100 MP medium-format frame fits), small enough that
# one DataLoader worker never holds more than ~450 MB of decoded RGB.
DEFAULT_MAX_PIXELS = 150_000_000


@dataclass
class EngineConfig:
    """How outputs leave the GPU and reach the sinks."""

    # Consumer processes that run the sink; each builds its own sink (one FAISS shard each).
    num_consumers: int = 4
    # Host buffer slots in the pinned pool; 0 means twice the consumers. Memory used is
    # slots x the size of one batch's outputs, whatever the speed of the consumers.
    num_slots: int = 0
    # Seconds a consumer gets to finish and close its sink when the run is stopped early.
    shutdown_timeout: float = 5.0
    # Register the host pool with CUDA (page-locked); turn off only to measure the difference.
    pin_memory: bool = True

    def slots(self) -> int:
        return self.num_slots or max(2, 2 * self.num_consumers)


@dataclass
class IndexConfig:
    """Settings of ``build-index``; each field is the CLI option of the same name."""

    # Output folder; default indexes/<corpus folder or file name>.
    out: str | None = None
    # Local sentence-transformers / Hugging Face model folder, or a Hugging Face id
    # ("org/name") found in the local Hugging Face cache (never downloaded); default the
    # bundled all-MiniLM-L6-v2.
    model: str | None = None
    # faiss index_factory string; "Flat" is exact search. IVF/PQ/HNSW are trained on a sample.
    index: str = "Flat"
    # Similarity: "ip" (inner product = cosine on the normalised vectors) or "l2".
    metric: str = "ip"
    # "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # Several devices, one process each: "all" (every GPU), "0,1" (GPU numbers), "cuda:0,cuda:1",
    # or "cpu,cpu" (CPU processes, for testing); "" is the one --device.
    devices: str = ""
    # Encoder precision: "auto" (fp16 on CUDA, fp32 on CPU), "fp32", "fp16" or "bf16".
    dtype: str = "auto"
    # Chunks per encoder batch (the slot size of the egress engine); 0 picks 1024 on a GPU
    # (fewer, larger batches: less per-batch work for the main process) and 256 on the CPU.
    batch_size: int = 0
    # On a GPU, replay the encoder from CUDA graphs (one per batch shape): the GPU no
    # longer waits for Python to launch each kernel. Off: plain eager forward.
    cuda_graphs: bool = True
    # Tokens per chunk, special tokens included (capped at the model's max length).
    chunk_tokens: int = 256
    # Tokens shared by consecutive chunks of one text.
    overlap: int = 32
    # Field holding the text in .jsonl/.json/.csv/.parquet records.
    text_field: str = "text"
    # Field holding the record id (optional; line or row numbers otherwise).
    id_field: str = "id"
    # Tokenizer worker processes; -1 picks from the CPU count.
    num_workers: int = -1
    # Consumer processes, each writing its own FAISS shard.
    num_consumers: int = 2
    # Host buffer slots of the egress engine; 0 = twice the consumers.
    num_slots: int = 0
    # Chunks sorted together by length (in batches) so batches pad little.
    sort_window: int = 16
    # Vectors per committed segment file (smaller: less redone after a crash).
    commit_every: int = 200_000
    # Vectors sampled to train IVF/PQ/HNSW factories.
    train_size: int = 50_000
    # Delete whatever index is in the output folder first.
    overwrite: bool = False
    # Text put before each chunk for the encoder (default: the model folder's document
    # prompt, from config_sentence_transformers.json); "" for none. Stored spans stay the source's.
    doc_prompt: str | None = None
    # Text put before each query (default: the model folder's query prompt); kept in the
    # manifest, so search, serve and open_index apply it.
    query_prompt: str | None = None
    # faiss search parameters kept with the index, used by search, serve and open_index
    # unless they give their own, e.g. "nprobe=16" (IVF) or "efSearch=128" (HNSW).
    search_params: str | None = None
    # Results per query kept with the index, used when a search gives no k.
    search_k: int | None = None

    def for_device(self, cuda: bool) -> IndexConfig:
        """This config with ``batch_size`` 0 (auto) made concrete for the device kind."""
        if self.batch_size:
            return self
        return dataclasses.replace(self, batch_size=1024 if cuda else 256)

    def validate(self) -> None:
        if self.batch_size < 0:
            raise ConfigError(f"batch-size={self.batch_size}: must be at least 1, or 0 (auto)")
        for name in ("chunk_tokens", "num_consumers", "sort_window", "commit_every",
                     "train_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')}={getattr(self, name)}: must be at least 1")
        if self.overlap < 0 or self.overlap >= self.chunk_tokens:
            raise ConfigError(f"overlap={self.overlap}: must be >= 0 and smaller than "
                              f"chunk-tokens ({self.chunk_tokens})")
        if self.metric not in ("ip", "l2"):
            raise ConfigError(f"metric={self.metric!r}: use 'ip' or 'l2'")
        if self.search_k is not None and self.search_k < 1:
            raise ConfigError(f"search-k={self.search_k}: must be at least 1")


@dataclass
class SegmentConfig:
    """Settings of a segment run; each field is the CLI option of the same name."""

    # Input folder (read recursively) or a single image file.
    images: str | None = None
    # Output folder: masks mirror the input tree; labels.json and skipped.jsonl go here too.
    out: str | None = None
    # Weights file: a state dict, a checkpoint with "model"/"state_dict", or a pickled
    # module. Default: torchvision's COCO_WITH_VOC_LABELS_V1 file if in the hub cache.
    weights: str | None = None
    # Model architecture: any torchvision segmentation model (fcn_resnet50, fcn_resnet101,
    # deeplabv3_resnet50, deeplabv3_resnet101, deeplabv3_mobilenet_v3_large,
    # lraspp_mobilenet_v3_large).
    arch: str = "deeplabv3_resnet50"
    # Classes of the weights; read from the weights file, so only a check when given.
    num_classes: int | None = None
    # Run with random weights when no weights are found (pipeline tests, benchmarks).
    random_weights: bool = False
    # "short": the weights' own preprocessing (short side to size, aspect kept, no pad;
    # images batched by shape); "fit": each image fitted into size x size and padded (one
    # shape for all).
    resize: str = "short"
    # The short side of the model input ("short"; 520 is the weights' preset), or the
    # side of the square ("fit").
    size: int = 520
    # Masks of images up to this many pixels are made at the image's size on the device
    # (the logits scaled bilinearly, then argmax: torchvision's pipeline); larger images
    # get the argmax at model size scaled up nearest-neighbour. Each host slot holds at
    # least this many bytes. With resize "fit" every mask is made at model size.
    upsample_max_pixels: int = 40_000_000
    # Images per forward pass.
    batch_size: int = 16
    # Model precision: auto (fp16 on CUDA, fp32 on CPU), fp32, fp16 or bf16.
    dtype: str = "auto"
    # "auto" (CUDA when available), "cuda", "cuda:N" or "cpu".
    device: str = "auto"
    # Several devices, one process each, the images split between them: "all" (every
    # GPU), "0,1" (GPU numbers), "cuda:0,cuda:1", or "cpu,cpu" (for testing); "" is the one device.
    devices: str = ""
    # DataLoader worker processes decoding images (0: decode in the main process; -1: the
    # usable cores but two, shared between device processes, and no more than the batches).
    num_workers: int = -1
    # Engine consumer processes writing masks (PNG encoding is their main cost).
    num_consumers: int = 4
    # Engine host slots; 0 means twice the consumers.
    num_slots: int = 0
    # Also write <image>.logits.npy: float16 [classes, h, w] scores at model resolution.
    # Each host slot then grows by batch_size x classes x size x size x 2 bytes.
    save_logits: bool = False
    # Also write <image>.overlay.jpg: the image with the classes blended in colour.
    overlay: bool = False
    # Weight of the class colour in overlays (0..1).
    overlay_alpha: float = 0.5
    # Also write stats/*.parquet: a row per image (source, width, height, the share of
    # its pixels of each class), resumable like the masks.
    stats: bool = False
    # Seconds between commits of each writer's rows (a killed run loses at most the rows
    # of this long; their images are redone on resume). Fewer seconds, more part files.
    stats_commit_seconds: float = 10.0
    # Redo images whose mask exists (otherwise they are skipped: resume).
    overwrite: bool = False
    # Images with more pixels are skipped with a reason (0: no limit).
    max_pixels: int = DEFAULT_MAX_PIXELS

    def validate(self) -> None:
        checks = [
            (self.size >= 32, f"size={self.size}: must be at least 32 (the models downsample 8x or more)"),
            (self.resize in RESIZE_MODES, f"resize={self.resize!r}: choose {' or '.join(RESIZE_MODES)}"),
            (self.upsample_max_pixels >= 0,
             f"upsample_max_pixels={self.upsample_max_pixels}: must be 0 (never) or more"),
            (self.batch_size >= 1, f"batch_size={self.batch_size}: must be at least 1"),
            (self.num_workers >= -1, f"num_workers={self.num_workers}: must be -1 (auto), 0 or more"),
            (self.num_consumers >= 1, f"num_consumers={self.num_consumers}: must be at least 1"),
            (self.num_slots >= 0, f"num_slots={self.num_slots}: must be 0 (auto) or more"),
            (self.max_pixels >= 0, f"max_pixels={self.max_pixels}: must be 0 (no limit) or more"),
            (self.stats_commit_seconds >= 0,
             f"stats_commit_seconds={self.stats_commit_seconds}: must be 0 or more"),
            (0.0 <= self.overlay_alpha <= 1.0, f"overlay_alpha={self.overlay_alpha}: must be in 0..1"),
            (self.dtype == "auto" or self.dtype in DTYPE_NAMES,
             f"dtype={self.dtype!r}: choose auto, {', '.join(DTYPE_NAMES)}"),
            (self.arch in SEGMENT_ARCHITECTURES,
             f"arch={self.arch!r}: choose one of {', '.join(SEGMENT_ARCHITECTURES)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Build ``cls`` from an optional TOML preset, then ``overrides`` (None values are ignored).

    Unknown keys are an error naming the key and the fields that exist, so a typo in a
    preset never passes silently.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as fh:
                values.update(tomllib.load(fh))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config preset {str(path)!r}: {exc}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}; "
            f"known settings are: {', '.join(sorted(names))}")
    return cls(**values)
