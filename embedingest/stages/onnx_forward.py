"""The encoder's forward (transformer, pooling, normalisation) as an ONNX graph run by ONNX
Runtime: the same vectors as torch, and one short query encoded faster on a CPU (fused
attention and layer norms, and its own matrix products for these few-row inputs, where
eager torch runs op by op).

The graph is exported from the loaded encoder at first use (``torch.onnx.export``'s
tracing exporter, which needs the ``onnx`` package; the dynamo one would need onnxscript
too) into ``<cache>/onnx/``, named by the sha256 of the weight
files, the pooling and the normalisation, so one file serves every index built with the
same weights and a changed model never meets a stale graph. It is written to a temporary
name and ``os.replace``d; nothing is downloaded. Before it is used, a loaded graph must
give the torch encoder's vectors for a probe of queries (:data:`TOLERANCE`); a cached
file that does not (damaged, or from another exporter) is exported again once.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..outfiles import atomic_write_bytes, ensure_folder

FORMAT = 1  # of the exported graph: bump when the export changes for the same weights
TOLERANCE = 1e-4  # largest difference to torch's vector, per component
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
PROBE = ["a", "what is the capital of France?", "Ünïcödé, emoji 🙂 and digits 12345",
         "a longer question about the weather in the mountains next week, and whether "
         "the roads over the pass will be open for cars without chains"]
_BLOCK = 1 << 22


def weights_sha256(folder: Path) -> str:
    """sha256 over the weight files of a transformer folder (names and bytes, in name order)."""
    files = sorted(p for p in Path(folder).iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise ConfigError(f"no weight file ({', '.join(WEIGHT_SUFFIXES)}) in {str(folder)!r} to "
                          "key an exported graph by")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            while block := fh.read(_BLOCK):
                digest.update(block)
    return digest.hexdigest()


def graph_path(encoder: Any, cache_dir: Path) -> Path:
    """Where the graph of ``encoder``'s weights and pooling is kept under ``cache_dir``."""
    sha = weights_sha256(encoder.transformer_dir)
    norm = "norm" if encoder.normalize else "raw"
    return Path(cache_dir) / "onnx" / f"{sha}-{encoder.pooling}-{norm}-{encoder.dtype}-f{FORMAT}.onnx"


class _Embed(torch.nn.Module):
    """The encoder's forward as a module, for the exporter to trace."""

    def __init__(self, encoder: Any):
        super().__init__()
        self.model = encoder.model  # registered, so the exporter stores its weights
        self._embed = encoder.embed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self._embed(input_ids, attention_mask)


def export(encoder: Any, path: Path) -> None:
    """Write ``encoder``'s forward as an ONNX graph at ``path`` (batch and sequence length
    dynamic), through a temporary name."""
    try:
        import onnx  # noqa: F401  (torch's exporter needs it)
    except ImportError as exc:
        raise ConfigError(f"exporting the query encoder to ONNX needs the onnx package ({exc}); "
                          "install it with pip install 'embedingest[serve]'") from exc
    probe = encoder.tokenize(PROBE[-2:])  # two rows of different lengths: a padded batch
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.inference_mode():
        # the tracer's notes on Python values it fixes; the probe check below catches any that matter
        warnings.simplefilter("ignore")
        torch.onnx.export(_Embed(encoder).eval(), (probe["input_ids"], probe["attention_mask"]), buffer,
                          dynamo=False, input_names=["input_ids", "attention_mask"],
                          output_names=["embeddings"], opset_version=17,
                          dynamic_axes={"input_ids": {0: "batch", 1: "tokens"},
                                        "attention_mask": {0: "batch", 1: "tokens"},
                                        "embeddings": {0: "batch"}})
    ensure_folder(path.parent.parent, path.parent)
    atomic_write_bytes(path, buffer.getvalue())


class OnnxForward:
    """An ONNX Runtime session of an exported graph, called as the encoder's forward:
    token ids and mask in, float32 vectors [B, dim] out (CPU tensors)."""

    name = "onnx"

    def __init__(self, path: Path, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # its own notes go to stderr otherwise
        self.path = path
        self._session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        (out,) = self._session.run(None, {"input_ids": input_ids.numpy().astype(np.int64, copy=False),
                                          "attention_mask": attention_mask.numpy().astype(np.int64, copy=False)})
        return torch.from_numpy(out)


def largest_difference(encoder: Any, forward: OnnxForward) -> float:
    """Largest per-component difference between ``forward`` and the torch encoder over the
    probe queries, one at a time and as one padded batch."""
    worst = 0.0
    for texts in [[t] for t in PROBE] + [PROBE]:
        batch = encoder.tokenize(texts)
        with torch.inference_mode():
            expected = encoder.embed(batch["input_ids"], batch["attention_mask"])
        got = forward(batch["input_ids"], batch["attention_mask"])
        worst = max(worst, float((got - expected).abs().max()))
    return worst


def load(encoder: Any, cache_dir: Path, threads: int) -> OnnxForward:
    """The ONNX forward of ``encoder``, from the cache or exported into it now; ConfigError
    when onnxruntime is missing or no graph gives the torch encoder's vectors."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"the ONNX query runtime needs onnxruntime ({exc}); install it with "
                          "pip install 'embedingest[serve]'") from exc
    if encoder.device.type != "cpu" or encoder.dtype != "fp32":
        raise ConfigError(f"the ONNX query runtime runs fp32 on the CPU; this encoder is "
                          f"{encoder.dtype} on {encoder.device}: use the torch runtime")
    path = graph_path(encoder, cache_dir)
    fresh = not path.is_file()
    if fresh:
        export(encoder, path)
    forward, problem = _checked(encoder, path, threads)
    if problem and not fresh:  # a damaged file, or one of another exporter: once more
        export(encoder, path)
        forward, problem = _checked(encoder, path, threads)
    if problem:
        raise ConfigError(problem)
    return forward


def _checked(encoder: Any, path: Path, threads: int) -> tuple[OnnxForward | None, str | None]:
    try:
        forward = OnnxForward(path, threads)
    except Exception as exc:  # onnxruntime raises its own types for a bad file
        return None, f"ONNX Runtime cannot load {path}: {exc}"
    worst = largest_difference(encoder, forward)
    if worst > TOLERANCE:
        return None, f"the graph at {path} differs from the torch encoder by {worst:.2g} (> {TOLERANCE})"
    return forward, None
