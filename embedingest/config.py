"""Settings as dataclasses, presets as TOML.

Every job takes one dataclass; every CLI option maps one-to-one onto a field of it
(``--num-consumers`` is ``num_consumers``), and ``--config preset.toml`` fills the same
fields from a file, with options given on the command line winning.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import tomllib
import typing
from collections.abc import Mapping
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
MAX_SEGMENT_SIZE = 8192

# Larger than any camera photo (a 100 MP medium-format frame fits), small enough that
# one DataLoader worker never holds more than ~450 MB of decoded RGB.
DEFAULT_MAX_PIXELS = 150_000_000


FOLLOW_OUTSIDE_LINKS = (
    "Read what symbolic links in the input folder point to outside it; off: such links are "
    "skipped and reported, so a link planted in a corpus cannot pull other files of this "
    "machine into the output.")


# Results per query when neither the search nor the index (build-index --search-k) says:
# the CLI's search, serve and open_index alike.
DEFAULT_SEARCH_K = 10
CHUNK_TOKENS = 256  # build-index's chunk size and overlap where neither the run nor the index says
FACTORY = "Flat"  # and its faiss factory and metric
METRIC = "ip"
OVERLAP = 32
TEXT_FIELD = "text"  # and the record fields it reads texts and ids from
ID_FIELD = "id"

_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "text"}


def check_types(config: Any) -> None:
    """Refuse a field whose value is not of its declared type (int, float, bool or str,
    or None where the type allows it). A TOML preset or a library call can give any
    value: ``overwrite = "false"`` is a true string, ``batch_size = "big"`` failed deep in
    the run, ``chunk_tokens = 1e400`` (infinity) passed."""
    hints = typing.get_type_hints(type(config))
    for field in dataclasses.fields(config):
        hint = hints.get(field.name)
        allowed = typing.get_args(hint) or (hint,)
        kinds = [kind for kind in allowed if kind is not type(None)]
        optional = len(kinds) < len(allowed)
        value = getattr(config, field.name)
        if not all(kind in _KINDS for kind in kinds) or (value is None and optional):
            continue  # a type not checked here (Any), or None where it may be
        if not any(_is(value, kind) for kind in kinds):
            raise ConfigError(f"{field.name}={value!r}: must be {' or '.join(_KINDS[k] for k in kinds)}"
                              f"{' or none' if optional else ''}")
        plain = _plain_number(value)
        if plain is not value:  # numpy's int64(8) as 8: the checks and the JSON after take it so
            object.__setattr__(config, field.name, plain)


def _plain_number(value: Any) -> Any:
    """``value`` as Python's own int or float when it is another kind of number (numpy's)."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):  # a bool is an int to Python, not to a setting
        return kind is bool
    if kind is int:
        return isinstance(value, numbers.Integral)  # numpy's integers too
    if kind is float:
        return isinstance(value, numbers.Real) and math.isfinite(value)
    if kind is str:
        return isinstance(value, (str, os.PathLike))  # a path given as a Path
    return isinstance(value, kind)


def setting(default: Any, doc: str, **cli: Any) -> Any:
    """A config field and its documentation: ``doc`` is the help of the CLI option generated
    from the field (:func:`embedingest.cli.common.config_options`), so what a field means is
    written once, where the field is. ``cli`` holds hints for that option: ``choices`` (a
    fixed set of values), ``path`` ("dir", "file"; ``exists=True`` to insist it exists),
    ``metavar``, ``range`` ((min, max), None for no bound), ``flags`` (its option names
    when not the kebab-case field name) and ``shown`` (the default in words, where the
    field's is None or a placeholder)."""
    return dataclasses.field(default=default, metadata={"doc": doc, **cli})


@dataclass
class EngineConfig:
    """How outputs leave the GPU and reach the sinks."""

    num_consumers: int = setting(
        4, "Consumer processes that run the sink; each builds its own sink (one FAISS shard each).")
    num_slots: int = setting(
        0, "Host buffer slots in the pinned pool; 0 is twice the consumers. Memory used is slots "
           "x the size of one batch's outputs, whatever the speed of the consumers.")
    shutdown_timeout: float = setting(
        5.0, "Seconds a consumer gets to finish and close its sink when the run is stopped early.")
    pin_memory: bool = setting(
        True, "Register the host pool with CUDA (page-locked); turn off only to measure the difference.")

    def slots(self) -> int:
        return self.num_slots or max(2, 2 * self.num_consumers)


@dataclass
class IndexConfig:
    """Settings of ``build-index``; each field is the CLI option of the same name."""

    out: str | None = setting(
        None, "Output folder.", path="dir",
        shown="indexes/<the corpus folder's or file's name>")
    model: str | None = setting(
        None, "Local sentence-transformers / Hugging Face model folder, or a Hugging Face id "
              "(org/name) found in the local Hugging Face cache; nothing is downloaded.",
        metavar="FOLDER|ID", shown="the bundled all-MiniLM-L6-v2")
    index: str | None = setting(
        None, "faiss index_factory string: Flat is exact search; IVF, PQ and HNSW factories "
              "(e.g. IVF4096,PQ64 or HNSW32) are trained on a sample (--train-size). An update "
              "keeps the index's.",
        metavar="FACTORY", shown=f"{FACTORY}, or the index's when it updates one")
    metric: str | None = setting(
        None, "Similarity: ip (inner product: cosine on the normalised vectors) or l2 (for models "
              "trained for euclidean distance). An update keeps the index's.", choices=("ip", "l2"),
        shown=f"{METRIC}, or the index's when it updates one")
    device: str = setting("auto", "auto (CUDA when available), cpu, cuda or cuda:N.", metavar="DEVICE")
    devices: str = setting(
        "", "Several devices, one process each: all (every GPU), 0,1 (GPU numbers), cuda:0,cuda:1, "
            "or cpu,cpu (CPU processes, for testing); empty: the one --device.", metavar="LIST")
    dtype: str = setting(
        "auto", "Encoder precision; auto is fp16 on CUDA, fp32 on the CPU.",
        choices=("auto", *DTYPE_NAMES))
    batch_size: int = setting(
        0, "Chunks per encoder batch (the egress engine's slot size); 0 picks 1024 on a GPU "
           "(fewer, larger batches: less work per batch for the main process) and 256 on the CPU.")
    cuda_graphs: bool = setting(
        True, "On a GPU, replay the encoder from CUDA graphs (one per batch shape), so the GPU "
              "no longer waits for Python to launch each kernel; off: plain eager forward.")
    chunk_tokens: int | None = setting(
        None, "Tokens per chunk, special tokens included (capped at the model's maximum length). "
              "An index's chunks stay one size: an update takes the index's.",
        shown=f"{CHUNK_TOKENS}, or the index's when it updates one")
    overlap: int | None = setting(
        None, "Tokens shared by consecutive chunks of one text; an update takes the index's.",
        shown=f"{OVERLAP}, or the index's when it updates one")
    fast_tokenizer: bool = setting(
        True, "Take the chunks' token ids from nanotoken wherever it gives exactly the model's own "
              "tokenizer's (the same chunks, spans and vectors, for far less tokenizer time); off: "
              "the model's own tokenizer for every text.")
    split_files: bool = setting(
        True, "Read a large uncompressed JSON lines, Parquet or PDF file in parts, one per tokenizer "
              "worker (byte ranges cut at line starts; ranges of rows; ranges of pages), so one big file does not hold "
              "the GPU to one core's pace; off: one worker a file (its chunk numbers then follow "
              "the file's order, and an id repeated anywhere in it is caught, not only within a part).")
    text_field: str | None = setting(
        None, "Field holding the text in .jsonl, .json, .csv and .parquet records (and records "
              "given as dicts). An update takes the index's.", metavar="NAME",
        shown=f"{TEXT_FIELD}, or the index's when it updates one")
    id_field: str | None = setting(
        None, "Field holding the record id (optional; line or row numbers otherwise). An update "
              "takes the index's.", metavar="NAME", shown=f"{ID_FIELD}, or the index's when it updates one")
    num_workers: int = setting(-1, "Tokenizer worker processes; -1 picks from the CPU count.")
    num_consumers: int = setting(2, "Consumer processes, each writing its own FAISS shards.")
    num_slots: int = setting(0, "Host buffer slots of the egress engine; 0 is 8 per consumer on a GPU, "
                                "twice the consumers on the CPU.")
    sort_window: int = setting(
        16, "Batches of chunks sorted together by length, so batches pad little.")
    commit_every: int = setting(
        200_000, "Vectors per committed shard (fewer: less is redone after a crash, more shards).")
    train_size: int = setting(50_000, "Vectors sampled to train IVF, PQ and HNSW factories.")
    save_embeddings: bool = setting(
        False, "Keep every vector as float16 beside its shard, for reindex and export (2 bytes "
               "a dimension per chunk).")
    overwrite: bool = setting(False, "Delete whatever index is in the output folder first.")
    follow_outside_links: bool = setting(False, FOLLOW_OUTSIDE_LINKS)
    doc_prompt: str | None = setting(
        None, "Text put before each chunk for the encoder; '' for none. The stored text stays the "
              "source's.", metavar="TEXT",
        shown="the model folder's document prompt, from config_sentence_transformers.json")
    query_prompt: str | None = setting(
        None, "Text put before each query, kept in the manifest so search, serve and open_index "
              "apply it; '' for none.", metavar="TEXT", shown="the model folder's query prompt")
    search_params: str | None = setting(
        None, "faiss search parameters kept with the index, used by search, serve and open_index "
              "unless they give their own, e.g. nprobe=32 (IVF) or efSearch=128 (HNSW); '' for "
              "none.", metavar="PARAMS", shown="nprobe=16 (IVF, at most its lists), efSearch=64 (HNSW), none "
              "(others) for a new index; an update keeps the index's")
    search_k: int | None = setting(
        None, "Results per query kept with the index, used when a search gives no k.",
        shown=str(DEFAULT_SEARCH_K))

    def for_device(self, cuda: bool) -> IndexConfig:
        """This config with ``batch_size`` 0 (auto) made concrete for the device kind."""
        if self.batch_size:
            return self
        return dataclasses.replace(self, batch_size=1024 if cuda else 256)

    def factory(self, stored: str | None = None) -> str:
        """The faiss factory asked for: the one given, else ``stored`` (the index's), else Flat."""
        return self.index or stored or FACTORY

    def chunking(self, stored: Mapping | None = None) -> tuple[int, int]:
        """The chunk size and overlap asked for: those given, else ``stored`` (an index's
        ``{"tokens", "overlap"}``), else the defaults; the size is not yet capped at the model's."""
        stored = stored or {}
        return (self.chunk_tokens if self.chunk_tokens is not None else stored.get("tokens", CHUNK_TOKENS),
                self.overlap if self.overlap is not None else stored.get("overlap", OVERLAP))

    def record_fields(self, stored: Mapping | None = None) -> dict[str, str]:
        """The record fields asked for, ``{"text", "id"}``: those given, else ``stored`` (an
        index's), else the defaults."""
        stored = stored or {}
        return {"text": self.text_field if self.text_field is not None else stored.get("text", TEXT_FIELD),
                "id": self.id_field if self.id_field is not None else stored.get("id", ID_FIELD)}

    def validate(self) -> None:
        check_types(self)
        for name in ("text_field", "id_field"):
            if getattr(self, name) == "":
                raise ConfigError(f"{name.replace('_', '-')}='': give the name of a field of the records")
        if self.batch_size < 0:
            raise ConfigError(f"batch-size={self.batch_size}: must be at least 1, or 0 (auto)")
        for name in ("chunk_tokens", "num_consumers", "sort_window", "commit_every",
                     "train_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')}={getattr(self, name)}: must be at least 1")
        if self.overlap is not None and self.overlap < 0:
            raise ConfigError(f"overlap={self.overlap}: must be at least 0")
        if None not in (self.overlap, self.chunk_tokens) and self.overlap >= self.chunk_tokens:
            raise ConfigError(f"overlap={self.overlap}: must be smaller than chunk-tokens ({self.chunk_tokens})")
        if self.metric not in (None, "ip", "l2"):
            raise ConfigError(f"metric={self.metric!r}: use 'ip' or 'l2'")
        if self.search_k is not None and self.search_k < 1:
            raise ConfigError(f"search-k={self.search_k}: must be at least 1")
        if self.num_workers < -1:
            raise ConfigError(f"num-workers={self.num_workers}: must be -1 (auto), 0 or more")


@dataclass
class SegmentConfig:
    """Settings of a segment run; each field is the CLI option of the same name."""

    images: str | None = setting(None, "Input folder (read recursively) or a single image file.",
                                 path="any", exists=True)
    out: str | None = setting(
        None, "Output folder: masks mirror the input tree; labels.json (what the mask values "
              "mean) and skipped.jsonl go here too.", path="dir")
    weights: str | None = setting(
        None, "Weights file: a state dict, a checkpoint with \"model\" or \"state_dict\", or a "
              "pickled module; nothing is downloaded.", path="file", exists=True,
        shown="torchvision's COCO_WITH_VOC_LABELS_V1 file, if it is in the torch hub cache")
    arch: str = setting(
        "deeplabv3_resnet50", "Model architecture, any torchvision segmentation model: "
                              + ", ".join(SEGMENT_ARCHITECTURES) + ".",
        choices=SEGMENT_ARCHITECTURES, metavar="NAME")
    num_classes: int | None = setting(
        None, "Classes of the weights; read from the weights file, so only a check when given.")
    random_weights: bool = setting(
        False, "Run with random weights when no weights are found (pipeline tests, benchmarks).")
    trust_weights_file: bool = setting(
        False, "Read a --weights file that only full unpickling reads (a whole pickled model): "
               "that runs code from the file, so only for a file you trust; off: such a file is "
               "refused (a state dict or a checkpoint holding one is read safely either way).")
    resize: str = setting(
        "short", "short: the weights' own preprocessing (short side to --size, aspect kept, no "
                 "pad; images batched by shape); fit: each image fitted into a --size square and "
                 "padded (one shape for all).", choices=RESIZE_MODES)
    size: int = setting(
        520, "The short side of the model input (short; 520 is the weights' preset), or the side "
             "of the square (fit).")
    upsample_max_pixels: int = setting(
        40_000_000, "Masks of images up to this many pixels are made at the image's size on the "
                    "device (the logits scaled bilinearly, then argmax: torchvision's pipeline); "
                    "larger images get the argmax at model size scaled up nearest-neighbour. Each "
                    "host slot holds at least this many bytes. With --resize fit every mask is "
                    "made at model size.")
    batch_size: int = setting(16, "Images per forward pass.")
    dtype: str = setting("auto", "Model precision; auto is fp16 on CUDA, fp32 on the CPU (fp16 is refused "
                                 "there: PyTorch has no fast fp16 convolutions on the CPU).",
                         choices=("auto", *DTYPE_NAMES))
    device: str = setting("auto", "auto (CUDA when available), cuda, cuda:N or cpu.", metavar="DEVICE")
    devices: str = setting(
        "", "Several devices, one process each, the images split between them: all (every GPU), "
            "0,1 (GPU numbers), cuda:0,cuda:1, or cpu,cpu (for testing); empty: the one --device.",
        metavar="LIST")
    num_workers: int = setting(
        -1, "DataLoader worker processes decoding images (0: decode in the main process; -1: the "
            "usable cores but two, shared between device processes, 1 to 32 each, and no more than the "
            "batches).")
    decode_ahead: int = setting(
        4, "Chunks of images each decoding worker decodes ahead of the GPU (a chunk is a quarter "
           "batch with --resize short, a batch with fit). Chunks are taken as they finish and a "
           "batch goes when its last chunk does, so one slow chunk (large PNGs) holds back its "
           "own batch only and the other workers go on; each chunk ahead, and each decoded chunk "
           "of a batch still waiting for another, holds its images in memory.")
    num_consumers: int = setting(
        4, "Engine consumer processes writing masks (PNG encoding is their main cost).")
    num_slots: int = setting(0, "Engine host slots; 0 is twice the consumers.")
    save_logits: bool = setting(
        False, "Also write <image>.logits.npy: float16 [classes, h, w] scores at model "
               "resolution. Each host slot then grows by batch size x classes x size x size x 2 bytes.")
    overlay: bool = setting(
        False, "Also write <image>.overlay.jpg: the image with the classes blended in colour.")
    overlay_alpha: float = setting(0.5, "Weight of the class colour in overlays (0..1).")
    stats: bool = setting(
        False, "Also write stats/*.parquet: a row per image (source, width, height, the share of "
               "its pixels of each class), resumable like the masks.")
    stats_commit_seconds: float = setting(
        10.0, "Seconds between commits of each writer's stats rows (a killed run loses at most "
              "the rows of this long; their images are redone on resume). Fewer seconds, more "
              "part files.")
    overwrite: bool = setting(False, "Redo images whose mask exists (otherwise they are skipped: resume).")
    follow_outside_links: bool = setting(False, FOLLOW_OUTSIDE_LINKS)
    max_pixels: int = setting(
        DEFAULT_MAX_PIXELS, "Images with more pixels are skipped with a reason (0: no limit).")

    def validate(self) -> None:
        if isinstance(self.images, (list, tuple)):
            raise ConfigError(f"images={self.images!r:.200}: a list; images is one folder or file (a list of "
                              "pictures or paths goes to segment_images(...), which returns their masks)")
        check_types(self)
        checks = [
            (self.size >= 32, f"size={self.size}: must be at least 32 (the models downsample 8x or more)"),
            (self.size <= MAX_SEGMENT_SIZE,
             f"size={self.size}: at most {MAX_SEGMENT_SIZE} (the model input's short side; the weights' "
             "preset is 520, and each host slot holds a batch of masks of up to 4 x size x size pixels)"),
            (self.resize in RESIZE_MODES, f"resize={self.resize!r}: choose {' or '.join(RESIZE_MODES)}"),
            (self.upsample_max_pixels >= 0,
             f"upsample_max_pixels={self.upsample_max_pixels}: must be 0 (never) or more"),
            (self.batch_size >= 1, f"batch_size={self.batch_size}: must be at least 1"),
            (self.num_workers >= -1, f"num_workers={self.num_workers}: must be -1 (auto), 0 or more"),
            (self.decode_ahead >= 1, f"decode_ahead={self.decode_ahead}: must be at least 1"),
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


@dataclass
class QueryConfig:
    """How ``search`` and ``serve`` query an index; None: the index's own setting."""

    device: str = setting("cpu", "Device of the query encoder: cpu, cuda or cuda:N.", metavar="DEVICE")
    params: str | None = setting(
        None, "faiss search parameters, e.g. nprobe=16; '' for none.", metavar="PARAMS",
        shown="the index's, from build-index --search-params")
    query_prompt: str | None = setting(
        None, "Text put before the query; '' for none.", metavar="TEXT",
        shown="the index's query prompt")
    cache_dir: str | None = setting(
        None, "Folder where the vectors of an index in object storage (s3://...) are kept once "
              "downloaded, and (serve) the query encoder's ONNX graph once exported.", path="dir",
        shown="~/.cache/embedingest")
    cache_size: float = setting(
        20.0, "Most GiB of vectors the cache keeps: past it, the least recently used files no "
              "open index uses are deleted (and downloaded again when needed); 0: no bound.",
        metavar="GIB", range=(0, None))


@dataclass
class SearchConfig(QueryConfig):
    """Settings of ``search``."""

    k: int | None = setting(
        None, "Results to show.", shown=f"the index's, from build-index --search-k, else {DEFAULT_SEARCH_K}",
        flags=("-k",), range=(1, None))


@dataclass
class ServeConfig(QueryConfig):
    """Settings of ``serve``."""

    host: str = setting(
        "127.0.0.1", "Address to listen on; any but 127.0.0.1 lets other machines query the index "
                     "and read its files.", metavar="ADDRESS")
    port: int = setting(8000, "Port to listen on; 0 takes a free one (the URL printed names it).", range=(0, 65535))
    max_query_chars: int = setting(2000, "Longer queries are refused (HTTP 422).", range=(1, None))
    max_k: int = setting(100, "Most results one request may ask for.", range=(1, None))
    query_runtime: str = setting(
        "auto", "What encodes the queries: onnx (ONNX Runtime on the encoder exported at first use "
                "into the cache folder; the same vectors as torch, faster on a CPU), torch, or auto "
                "(onnx on the CPU in fp32, else torch; torch with a warning when onnxruntime is "
                "missing or the graph fails).", choices=("auto", "torch", "onnx"))
    threads: int = setting(
        1, "Threads of the query encoder (torch's, and ONNX Runtime's); 0: torch's default (every core).",
        range=(0, None))


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Build ``cls`` from an optional TOML preset, then ``overrides`` (None values are ignored).

    Unknown keys are an error naming the key and the fields that exist, so a typo in a
    preset never passes silently.
    """
    values: dict[str, Any] = {}
    if path is not None:
        from .sources.files import open_regular

        try:
            with open_regular(path) as fh:  # a pipe is refused, not waited for
                values.update(tomllib.load(fh))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ConfigError(f"cannot read config preset {str(path)!r}: {exc}; give a TOML file "
                              f"(see configs/)") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}; "
            f"known settings are: {', '.join(sorted(names))}")
    config = cls(**values)
    check_types(config)
    return config
