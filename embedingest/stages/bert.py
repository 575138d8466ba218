"""BERT encoders (all-MiniLM, bge, e5, gte and the like) without importing transformers.

Importing transformers' model classes costs seconds before the first batch (its
generation utilities pull in scikit-learn, its import checks scan every installed
distribution), longer than tokenizing the first batches or loading the weights. The
encoder stack of ``BertModel`` is small, so for a folder whose config.json and
model.safetensors describe exactly that stack (:func:`supports`) this module builds it
from plain torch layers, with the same parameter names, the same operations in the same
order and the same attention kernel (``scaled_dot_product_attention``), and loads the
weights straight to the device. Any other architecture, option or weight file goes to
transformers (:func:`load` returns None). The tests compare both on the same weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS = "model.safetensors"

# transformers' activations of these names, as it computes them.
_ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))),
}
# Config values under which BertModel's encoder is the plain stack built here.
_PLAIN = {"is_decoder": False, "add_cross_attention": False, "chunk_size_feed_forward": 0}
_NEEDED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
           "intermediate_size", "max_position_embeddings", "type_vocab_size")


def read_config(folder: Path) -> dict | None:
    """config.json as a dict, None when it is missing or not a JSON object."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def supports(folder: Path, config: dict | None = None) -> bool:
    """Whether ``folder`` holds a plain BERT encoder this module builds exactly: model_type
    "bert", absolute positions, a known activation, none of the decoder options, and one
    model.safetensors file."""
    config = read_config(folder) if config is None else config
    if not config or config.get("model_type") != "bert":
        return False
    if config.get("position_embedding_type", "absolute") != "absolute":
        return False
    if config.get("hidden_act", "gelu") not in _ACTIVATIONS:
        return False
    if any(config.get(k, v) != v for k, v in _PLAIN.items()):
        return False
    if not all(isinstance(config.get(k), int) and config[k] > 0 for k in _NEEDED):
        return False
    if config["hidden_size"] % config["num_attention_heads"]:
        return False
    return (Path(folder) / WEIGHTS).is_file()


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class _Linear(nn.Module):
    """``nn.Linear``'s parameters and forward, made without initialising them: :func:`load`
    puts the weights in (torch's own layers initialise even on the meta device, which imports
    its compiler: seconds)."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.weight, self.bias = _empty(width_out, width_in), _empty(width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight, self.bias, self.eps = _empty(width), _empty(width), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class _Embedding(nn.Module):
    def __init__(self, rows: int, width: int, padding_idx: int | None = None):
        super().__init__()
        self.weight, self.padding_idx = _empty(rows, width), padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_size = heads, hidden // heads
        self.scaling = self.head_size ** -0.5
        self.query, self.key, self.value = (_Linear(hidden, hidden, ) for _ in range(3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_size)
        q = self.query(x).view(shape).transpose(1, 2)
        k = self.key(x).view(shape).transpose(1, 2)
        v = self.value(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling,
                                             is_causal=False)
        return out.transpose(1, 2).contiguous().reshape(*x.shape[:-1], -1).contiguous()


class _Residual(nn.Module):
    """Dense, then LayerNorm of the sum with the block's input (BertSelfOutput, BertOutput)."""

    def __init__(self, width_in: int, hidden: int, eps: float):
        super().__init__()
        self.dense = _Linear(width_in, hidden, )
        self.LayerNorm = _LayerNorm(hidden, eps=eps, )

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.self = _SelfAttention(hidden, heads)
        self.output = _Residual(hidden, hidden, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int, act):
        super().__init__()
        self.dense, self.act = _Linear(hidden, inner, ), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, c: dict, act):
        super().__init__()
        hidden, eps = c["hidden_size"], c.get("layer_norm_eps", 1e-12)
        self.attention = _Attention(hidden, c["num_attention_heads"], eps)
        self.intermediate = _Intermediate(hidden, c["intermediate_size"], act)
        self.output = _Residual(c["intermediate_size"], hidden, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attended = self.attention(x, mask)
        return self.output(self.intermediate(attended), attended)


class _Embeddings(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        hidden = c["hidden_size"]
        self.word_embeddings = _Embedding(c["vocab_size"], hidden, padding_idx=c.get("pad_token_id"))
        self.position_embeddings = _Embedding(c["max_position_embeddings"], hidden, )
        self.token_type_embeddings = _Embedding(c["type_vocab_size"], hidden, )
        self.LayerNorm = _LayerNorm(hidden, eps=c.get("layer_norm_eps", 1e-12), )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        types = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(types)
        return self.LayerNorm(x + self.position_embeddings(positions)[None])


class _Encoder(nn.Module):
    def __init__(self, c: dict, act):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(c, act) for _ in range(c["num_hidden_layers"]))


class BertEncoder(nn.Module):
    """BertModel's embeddings and encoder (no pooler: the pipeline pools itself), its
    parameters empty on the meta device until :func:`load` puts the weights in. Called as
    the encoder calls a transformers model: ``model(input_ids=, attention_mask=)`` with a 2-D
    padding mask or a prepared 4-D boolean one; ``.last_hidden_state`` of the result."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = SimpleNamespace(**{**config, "_attn_implementation": "sdpa"})
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config, _ACTIVATIONS[config.get("hidden_act", "gelu")])

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.word_embeddings.weight.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        mask = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None, None, :]
        mask = mask.bool()
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return SimpleNamespace(last_hidden_state=x)


def load(folder: Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> BertEncoder | None:
    """The encoder of ``folder`` in ``dtype`` on ``device``, or None when :func:`supports`
    refuses it or its weights do not name exactly the stack's parameters (then
    transformers loads it)."""
    from safetensors import safe_open

    config = read_config(folder)
    if not supports(folder, config):
        return None
    model = BertEncoder(config)
    wanted = set(model.state_dict())
    state = {}
    with safe_open(str(Path(folder) / WEIGHTS), framework="pt", device=str(device)) as f:
        names = list(f.keys())
        prefix = "bert." if not wanted & set(names) and any(n.startswith("bert.") for n in names) else ""
        for name in names:
            key = name[len(prefix):] if name.startswith(prefix) else None
            if key in wanted:
                state[key] = f.get_tensor(name).to(dtype)
    if set(state) != wanted:
        return None
    model.load_state_dict(state, assign=True)
    return model.eval().requires_grad_(False)
