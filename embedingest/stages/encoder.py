"""TextEncoder: a local model folder turned into a function from token ids to sentence embeddings.

The sentence-transformers files (modules.json, the Pooling config, sentence_bert_config.json)
are read (:mod:`~embedingest.stages.model_folder`) instead of going through
``SentenceTransformer``: the model stays a plain
``AutoModel`` whose forward the pipeline calls on device tensors it batched itself, and
sentence-transformers stays a test-only dependency (the tests check that both agree).

Decisions:

* A plain Hugging Face folder (config.json, no modules.json) gets mean pooling and is
  L2-normalised: the index searches by inner product, which is only cosine similarity on
  unit vectors.
* ``dtype="fp16"`` on the CPU is refused rather than mapped: half precision there is slow and
  loses accuracy, and silently running something else than asked would hide that.
  ``"bf16"`` is allowed on the CPU; ``"fp32"`` is the default.
* The transformer runs in the chosen dtype, pooling and normalisation in fp32.
* Models are only read from local folders (``local_files_only=True``); nothing is downloaded.
  A Hugging Face id ("org/name") is the snapshot folder the local Hugging Face cache holds
  for it (:mod:`embedingest.stages.hub`); the bundled model's own id is the bundled folder.
* Prompts (``config_sentence_transformers.json``: ``prompts``, ``default_prompt_name``) are
  text put before each input, as sentence-transformers does: queries get the "query"
  prompt, documents the first of "document", "passage", "corpus" (:class:`Prompts`).
  Chunks get the document prompt's tokens after their leading special tokens
  (:class:`~embedingest.stages.prompts.PromptedBatches`), so their spans stay the source's.
* ``info()["name"]`` identifies the weights, not where they lie: the bundled model's hub name,
  the name a converted copy records in ``embedingest_source.json`` (benchmarks/carry_model.py
  writes it), else the folder's name. An index built with the fp16 copy on a GPU machine is
  thus searched with the bundled model elsewhere.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..sources.text import lone_surrogate
from . import bert
from .device import precision, resolve_device, resolve_dtype
from .model_folder import ModelLayout, read_layout, resolve_model
from .prompts import Prompts
from .light_tokenizer import LightTokenizer
from .tokenizer import open_tokenizer

# Tokenizers that set no limit report this huge number as their model_max_length.
_NO_LIMIT = 10**6
# _without_cudnn_attention's count of threads inside it, and the flag it found.
_cudnn_off_lock = threading.Lock()
_cudnn_off_depth = 0
_cudnn_was_on = True


def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """Pool token states [B, T, D] into float32 [B, D * len(modes)] as sentence-transformers does.

    Sums accumulate in fp32 whatever the dtype of ``hidden``; every mode works on the whole
    batch at once (first and last real tokens are found from the mask, so either padding
    side works).
    """
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    first = mask.int().argmax(dim=1)
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[rows, first].float())
        elif mode == "lasttoken":
            last = mask.shape[1] - 1 - mask.flip(1).int().argmax(dim=1)
            out.append(hidden[rows, last].float())
        elif mode == "max":
            masked = hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf"))
            out.append(masked.amax(dim=1).float())
        elif mode == "weightedmean":
            positions = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=torch.float32)
            weights = mask.float() * (positions - first.unsqueeze(1).float())
            sums = (hidden.float() * weights.unsqueeze(-1)).sum(dim=1)
            out.append(sums / weights.sum(dim=1, keepdim=True).clamp(min=1e-9))
        else:
            sums = (hidden * mask.unsqueeze(-1).to(hidden.dtype)).sum(dim=1, dtype=torch.float32)
            counts = mask.sum(dim=1, keepdim=True, dtype=torch.float32).clamp(min=1e-9)
            out.append(sums / (counts if mode == "mean" else counts.sqrt()))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def attention_kernels(device: torch.device, new_shape: bool):
    """The attention kernels a forward may use: for a batch shape the encoder meets for
    the first time on a GPU, those allowed now but cuDNN's; otherwise torch's own choice.

    cuDNN's attention, torch's first choice on recent GPUs and the fastest there once
    running, first builds an execution plan for each input shape, on the host, while the
    GPU waits. A run meets many shapes only once (in build-index the last, short batch of
    each loader worker; in a search service most numbers of queries), and for those the
    plan costs more than the batch. The memory-efficient kernel takes the same mask and
    needs no plan, so a shape's first batch runs with it and only a shape that comes back
    pays for cuDNN's plan (and, with CUDA graphs, is captured).
    """
    if device.type != "cuda" or not new_shape:
        return contextlib.nullcontext()
    return _without_cudnn_attention()


@contextlib.contextmanager
def _without_cudnn_attention():
    """torch's cuDNN-attention flag off while any thread is inside, as it was once the last
    one leaves. The flag is process-wide: ``sdpa_kernel`` saves and restores it per
    context, so two threads whose contexts overlap could leave it off for good, and it
    sets the other kernels' flags too, overriding a caller's own choice."""
    global _cudnn_off_depth, _cudnn_was_on
    with _cudnn_off_lock:
        if _cudnn_off_depth == 0:
            _cudnn_was_on = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _cudnn_off_depth += 1
    try:
        yield
    finally:
        with _cudnn_off_lock:
            _cudnn_off_depth -= 1
            if _cudnn_off_depth == 0:
                torch.backends.cuda.enable_cudnn_sdp(_cudnn_was_on)


class TextEncoder:
    """A transformer, its tokenizer and its pooling, loaded from one local folder."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, layout: ModelLayout, model_dir: Path,
                 name: str, device: torch.device, dtype: str, max_seq_length: int,
                 cuda_graphs: bool = True):
        self._model = model
        self._tokenizer = tokenizer
        self._layout = layout
        self._model_dir = model_dir
        self._name = name
        self._device = device
        self._dtype = dtype
        self._max_seq_length = max_seq_length
        self._prepared_mask = False
        self._graphs = None
        self._runtime = None
        self._shapes_seen: set[tuple[int, ...]] = set()  # batch shapes run before (attention_kernels)
        self._prompts = Prompts.read(model_dir)
        probe = self.tokenize(["dim", "a longer text, so the batch has padding"])
        reference = self.forward(probe["input_ids"], probe["attention_mask"])
        self._dim = int(reference.shape[-1])
        self._prepared_mask = self._prepared_mask_agrees(probe, reference)
        if cuda_graphs and device.type == "cuda":
            from .cuda_graphs import GraphedFunction

            self._graphs = GraphedFunction(self._embed, device)

    @classmethod
    def load(cls, model: str | Path | None = None, device: str | torch.device = "cpu",
             dtype: str = "fp32", max_seq_length: int | None = None,
             cuda_graphs: bool = True) -> TextEncoder:
        """Load a local sentence-transformers or Hugging Face folder, or a Hugging Face id
        from the local cache (see :func:`resolve_model`); None is the bundled model.

        ``max_seq_length`` overrides the folder's own limit (sentence_bert_config.json, else
        the tokenizer's and the model's). ``cuda_graphs`` replays the forward from CUDA
        graphs on a GPU (see :mod:`embedingest.stages.cuda_graphs`).
        """
        return cls.from_facts(ModelFacts.read(model, device, dtype, max_seq_length), cuda_graphs)

    @classmethod
    def from_facts(cls, facts: ModelFacts, cuda_graphs: bool = True) -> TextEncoder:
        """Load the weights of the model ``facts`` describe (its tokenizer is theirs)."""
        transformer = _load_model(facts.layout.transformer_dir, resolve_dtype(facts.dtype, facts.device),
                                  facts.device)
        transformer.eval().requires_grad_(False)
        return cls(transformer, facts.tokenizer, facts.layout, facts.model_dir, facts.name,
                   facts.device, facts.dtype, facts.max_seq_length, cuda_graphs)

    def release(self) -> None:
        """Drop the CUDA graphs and hand the allocator's cached GPU memory back, so other
        processes can use it; the encoder still works (graphs are captured again)."""
        if self._graphs is not None:
            self._graphs.release()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def max_seq_length(self) -> int:
        return self._max_seq_length

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer; its model_max_length is set to ``max_seq_length``."""
        return self._tokenizer

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def model_dir(self) -> Path:
        return self._model_dir

    @property
    def transformer_dir(self) -> Path:
        """The folder of the transformer's config and weights (the model folder, or its
        sentence-transformers module folder)."""
        return self._layout.transformer_dir

    @property
    def pooling(self) -> str:
        """The pooling mode, or several joined by '+' when their outputs are concatenated."""
        return "+".join(self._layout.pooling)

    @property
    def normalize(self) -> bool:
        return self._layout.normalize

    @property
    def prompts(self) -> Prompts:
        """The prompts the model folder declares."""
        return self._prompts

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> str:
        return self._dtype

    def info(self) -> dict[str, Any]:
        """What the index manifest records, so queries are encoded the way the index was."""
        return _info(self._model_dir, self._name, self._model.config, self._dim, self._layout,
                     self._max_seq_length, self._dtype)

    def tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention mask on the CPU, truncated, padded to the longest text;
        for a GPU rounded up to 16 tokens (few distinct shapes: kernels are chosen and
        CUDA graphs captured once), on the CPU not (padding there is only wasted work)."""
        multiple = 16 if self._max_seq_length % 16 == 0 and self._device.type == "cuda" else None
        batch = self._tokenizer(list(texts), padding=True, truncation=True, pad_to_multiple_of=multiple,
                                max_length=self._max_seq_length, return_tensors="pt")
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Sentence embeddings, float32 [B, dim], on the encoder's device.

        On CUDA the call only enqueues work: it never waits for the GPU. A batch shape's
        first batch runs eagerly without cuDNN's attention (:func:`attention_kernels`);
        from its second on, with ``cuda_graphs``, the shape is replayed from a captured graph.
        """
        if self._runtime is not None:
            return self._runtime(input_ids, attention_mask)
        shape = tuple(input_ids.shape)
        new_shape = shape not in self._shapes_seen
        self._shapes_seen.add(shape)
        with torch.inference_mode(), attention_kernels(self._device, new_shape):
            input_ids = input_ids.to(self._device, non_blocking=True)
            attention_mask = attention_mask.to(self._device, non_blocking=True)
            if self._graphs is not None and len(input_ids) and not new_shape:
                if not self._graphs.captured and self._graphs.disabled_reason is None:
                    # the widest batch first, so the memory of all shapes stays bounded
                    widest = torch.ones(len(input_ids), self._max_seq_length, dtype=input_ids.dtype,
                                        device=self._device)
                    self._graphs.prime(widest, widest)
                return self._graphs(input_ids, attention_mask)
            return self._embed(input_ids, attention_mask)

    def use_runtime(self, runtime) -> None:
        """Run :meth:`forward` through ``runtime(input_ids, attention_mask)`` (CPU tensors in,
        the same vectors out, its ``name`` said by :attr:`runtime`, e.g.
        :class:`~embedingest.stages.onnx_forward.OnnxForward`); None: torch again."""
        self._runtime = runtime

    @property
    def runtime(self) -> str:
        """What runs :meth:`forward`: "torch", or the name of the runtime in use."""
        return "torch" if self._runtime is None else self._runtime.name

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The torch forward as a plain function of tensors on the encoder's device (no
        inference mode, no CUDA graphs, no runtime): what an exporter traces, and the
        reference a runtime is checked against."""
        return self._embed(input_ids, attention_mask)

    def _embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask[:, None, None, :].bool() if self._prepared_mask else attention_mask
        hidden = self._model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        embeddings = pool(hidden, attention_mask, self._layout.pooling)
        return F.normalize(embeddings, p=2, dim=-1) if self._layout.normalize else embeddings

    def _prepared_mask_agrees(self, probe: dict, reference: torch.Tensor) -> bool:
        """Whether the model takes our own 4-D boolean mask and gives the same output.

        Given a 2-D padding mask, transformers' SDPA path asks the GPU whether the mask
        has any padding (``mask.all()``), which makes every forward wait for the GPU to
        finish the batches queued before it. A prepared mask skips that question. Models
        whose attention does not take it (eager attention wants an additive float mask)
        keep the 2-D mask: the check runs the probe batch both ways.
        """
        if getattr(self._model.config, "_attn_implementation", None) != "sdpa":
            return False
        self._prepared_mask = True
        try:
            prepared = self.forward(probe["input_ids"], probe["attention_mask"])
        except (RuntimeError, ValueError, TypeError, IndexError):
            return False
        finally:
            self._prepared_mask = False
        tol = 1e-5 if self._dtype == "fp32" else 2e-3
        return prepared.shape == reference.shape and bool(torch.allclose(prepared, reference, atol=tol))

    @property
    def uses_cuda_graphs(self) -> bool:
        """True while batches run from captured CUDA graphs (False on CPU or after a
        capture failed; then the forward runs eagerly)."""
        return self._graphs is not None and self._graphs.disabled_reason is None

    def encode(self, texts: Sequence[str], batch_size: int = 64, prompt: str = "") -> np.ndarray:
        """Embed texts, float32 [len(texts), dim], in their order.

        ``prompt`` goes before each text, as sentence-transformers' ``encode(prompt=...)``
        does (``self.prompts.for_role("query")`` is the folder's query prompt). Texts are
        batched longest first, so each batch pads to about its own length.
        """
        if isinstance(texts, str):
            raise TypeError("encode() takes a list of strings, got one str; pass [text]")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.check_prompt(prompt)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] is a {type(text).__name__}, not a str; encode() takes a list of strings")
            problem = lone_surrogate(text, "not Unicode text (a byte that is not UTF-8, decoded with "
                                           "'surrogateescape', becomes one); pass UTF-8 text")
            if problem:
                raise ConfigError(f"texts[{i}] holds {problem}")
        texts = [prompt + text for text in texts]
        out = np.empty((len(texts), self._dim), dtype=np.float32)
        order = np.argsort([-len(text) for text in texts], kind="stable")
        for start in range(0, len(texts), batch_size):
            rows = order[start:start + batch_size]
            batch = self.tokenize([texts[i] for i in rows])
            out[rows] = self.forward(batch["input_ids"], batch["attention_mask"]).cpu().numpy()
        return out


    def check_prompt(self, prompt: str) -> None:
        """Refuse a prompt this model's pooling would leave out (``include_prompt: false``,
        e.g. INSTRUCTOR): embedingest pools over every token."""
        _check_prompt(self._layout, self._model_dir, prompt)


class ModelFacts:
    """What a job needs to know of a model before its weights are loaded: the folder, its
    layout, the tokenizer (as :class:`TextEncoder` uses it), the transformers config, the
    sequence limit, the prompts, and the output width the pooling gives (``dim``, None
    when the config does not say). build-index plans and starts its tokenizing workers
    from these while the weights load (:meth:`TextEncoder.from_facts`); the encoder's own
    ``info()`` is compared with these ``info()`` once it is loaded."""

    def __init__(self, model_dir: Path, name: str, layout: ModelLayout, tokenizer: Any, config: Any,
                 device: torch.device, dtype: str, max_seq_length: int):
        self.model_dir, self.name, self.layout = model_dir, name, layout
        self.tokenizer, self.config = tokenizer, config
        self.device, self.dtype, self.max_seq_length = device, dtype, max_seq_length
        self.prompts = Prompts.read(model_dir)

    @classmethod
    def read(cls, model: str | Path | None = None, device: str | torch.device = "cpu",
             dtype: str = "fp32", max_seq_length: int | None = None) -> ModelFacts:
        """The facts of ``model`` as :meth:`TextEncoder.load` takes it (the same checks)."""
        torch_device = resolve_device(device)
        dtype = precision(dtype, torch_device.type == "cuda")
        if dtype == "fp16" and torch_device.type == "cpu":
            raise ConfigError("dtype 'fp16' on the CPU is slow and loses accuracy; "
                              "use dtype='fp32' (or 'bf16') on the CPU, and fp16 on a CUDA device")
        resolve_dtype(dtype, torch_device)
        model_dir, name = resolve_model(model)
        layout = read_layout(model_dir)
        tokenizer = open_tokenizer(layout.transformer_dir, layout.do_lower_case)
        config = _read_config(layout.transformer_dir)
        seq_len = _resolve_max_seq_length(max_seq_length, layout, tokenizer, config)
        tokenizer.model_max_length = seq_len
        return cls(model_dir, name, layout, tokenizer, config, torch_device, dtype, seq_len)

    @property
    def dim(self) -> int | None:
        """The width of the vectors: the config's hidden size once per pooling mode (the
        encoder's output is its last hidden state, pooled); None when it states none."""
        hidden = getattr(self.config, "hidden_size", None)
        return hidden * len(self.layout.pooling) if isinstance(hidden, int) and hidden > 0 else None

    def info(self) -> dict[str, Any]:
        """:meth:`TextEncoder.info` as it will be, ``dim`` as :attr:`dim` expects it."""
        return _info(self.model_dir, self.name, self.config, self.dim, self.layout,
                     self.max_seq_length, self.dtype)

    def check_prompt(self, prompt: str) -> None:
        """As :meth:`TextEncoder.check_prompt`."""
        _check_prompt(self.layout, self.model_dir, prompt)


def _info(model_dir: Path, name: str, config: Any, dim: int | None, layout: ModelLayout,
          max_seq_length: int, dtype: str) -> dict[str, Any]:
    return {
        "path": str(model_dir),
        "name": name,
        "model_type": getattr(config, "model_type", None),
        "dim": dim,
        "pooling": "+".join(layout.pooling),
        "normalize": layout.normalize,
        "max_seq_length": max_seq_length,
        "dtype": dtype,
    }


def _check_prompt(layout: ModelLayout, model_dir: Path, prompt: str) -> None:
    if prompt and not layout.include_prompt:
        raise ConfigError(f"the Pooling of {model_dir} leaves the prompt's tokens out "
                          f"(include_prompt: false), which embedingest does not do; "
                          f"use no prompt (--doc-prompt '' --query-prompt '') or another model")


def import_model_code(model: str | Path | None = None) -> None:
    """Import the transformers code :meth:`TextEncoder.load` runs for ``model`` (its
    architecture's module included), without loading weights: a process that forks
    encoders does it once. A model folder that cannot be read is left for the load to
    report; one that :mod:`.bert` builds needs no transformers code."""
    try:
        layout = read_layout(resolve_model(model)[0])
    except ConfigError:
        return
    if bert.supports(layout.transformer_dir) and LightTokenizer.open(layout.transformer_dir) is not None:
        return
    from transformers import MODEL_MAPPING, AutoConfig, AutoModel, AutoTokenizer  # noqa: F401

    try:
        config = AutoConfig.from_pretrained(layout.transformer_dir, local_files_only=True)
        MODEL_MAPPING[type(config)]  # imports the architecture's module
    except (ConfigError, OSError, ValueError, KeyError):
        pass


def _read_config(path: Path) -> Any:
    """The model's config: config.json as it is for a BERT that :mod:`.bert` builds
    (transformers is not imported for it), else transformers' ``AutoConfig``."""
    config = bert.read_config(path)
    if bert.supports(path, config):
        return SimpleNamespace(**config)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load a transformer from {path}: {exc}") from exc


def _load_model(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The transformer of ``path`` on ``device``: :mod:`.bert`'s own stack where it builds
    this model exactly, else transformers' ``AutoModel`` with SDPA attention."""
    own = bert.load(path, dtype, device)
    if own is not None:
        return own
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a library should not draw bars on the caller's terminal

    kwargs = {"local_files_only": True, "dtype": dtype}
    try:
        try:
            model = AutoModel.from_pretrained(path, attn_implementation="sdpa", **kwargs)
        except ValueError:
            # This architecture has no SDPA attention: let transformers pick its own.
            model = AutoModel.from_pretrained(path, **kwargs)
        return model.to(device)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot load a transformer from {path}: {exc}") from exc


def _resolve_max_seq_length(requested: int | None, layout: ModelLayout, tokenizer: Any, config: Any) -> int:
    positions = getattr(config, "max_position_embeddings", None)
    positions = positions if isinstance(positions, int) and positions > 0 else None
    if requested is not None:
        if requested < 1 or (positions is not None and requested > positions):
            raise ConfigError(f"max_seq_length {requested} is outside 1..{positions or 'unbounded'} "
                              f"for the model in {layout.transformer_dir}")
        return requested
    if layout.max_seq_length:
        return int(layout.max_seq_length)
    limits = [n for n in (tokenizer.model_max_length, positions) if n is not None and n < _NO_LIMIT]
    if not limits:
        raise ConfigError(f"neither the tokenizer nor the model in {layout.transformer_dir} states a "
                          f"maximum sequence length; pass max_seq_length")
    return min(limits)
