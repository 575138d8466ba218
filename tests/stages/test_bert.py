"""embedingest.stages.bert against transformers' BertModel on the same weights: the bundled
model and small random BERTs of every activation it takes, fp32 and bf16, padded batches;
and the folders it must leave to transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from embedingest.stages import bert
from model_fixtures import BUNDLED

TEXTS = ["hello world", "a much longer sentence, with more tokens in it, so the batch has padding", "x",
         "Crème brûlée ünïcödé 東京都 " * 5]


def transformers_model(folder: Path, dtype=torch.float32):
    from transformers import AutoModel

    return AutoModel.from_pretrained(folder, local_files_only=True, dtype=dtype,
                                     attn_implementation="sdpa").eval()


def batch(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)(TEXTS, padding=True, return_tensors="pt")


def hidden(model, x, mask=None):
    with torch.inference_mode():
        return model(input_ids=x["input_ids"],
                     attention_mask=x["attention_mask"] if mask is None else mask).last_hidden_state


def test_bundled_model_equals_transformers_bit_for_bit():
    """The same operations in the same order: fp32 on the CPU gives identical states, with
    the 2-D mask and with the prepared 4-D boolean one."""
    x = batch(BUNDLED)
    ours = bert.load(BUNDLED, torch.float32)
    assert isinstance(ours, bert.BertEncoder)
    real = x["attention_mask"].bool()
    ref = hidden(transformers_model(BUNDLED), x)
    assert torch.equal(hidden(ours, x)[real], ref[real])
    assert torch.equal(hidden(ours, x, x["attention_mask"][:, None, None, :].bool())[real], ref[real])
    assert not any(p.requires_grad for p in ours.parameters())


def test_bf16_is_as_close_as_transformers_own_bf16():
    x = batch(BUNDLED)
    real = x["attention_mask"].bool()
    ref = hidden(transformers_model(BUNDLED, torch.bfloat16), x)
    ours = hidden(bert.load(BUNDLED, torch.bfloat16), x)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours[real], ref[real])


@pytest.fixture(scope="module", params=["gelu", "relu", "gelu_new", "gelu_pytorch_tanh"])
def random_bert(request, tmp_path_factory) -> Path:
    """A 2-layer random BERT saved by transformers, with the bundled tokenizer."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp(f"bert_{request.param}")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, hidden_act=request.param,
                        layer_norm_eps=1e-7, type_vocab_size=2)
    model = BertModel(config).eval()
    with torch.no_grad():  # type embeddings that differ, so using the wrong row shows
        model.embeddings.token_type_embeddings.weight.normal_()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(BUNDLED / name, folder / name)
    return folder


def test_random_berts_equal_transformers(random_bert):
    x = batch(random_bert)
    real = x["attention_mask"].bool()
    ours = bert.load(random_bert, torch.float32)
    assert ours is not None
    assert torch.equal(hidden(ours, x)[real], hidden(transformers_model(random_bert), x)[real])


def test_weights_saved_under_the_bert_prefix_load_the_same(random_bert, tmp_path):
    """Checkpoints of BertFor* heads name the encoder's weights "bert.*"."""
    folder = tmp_path / "prefixed"
    shutil.copytree(random_bert, folder)
    state = load_file(str(random_bert / "model.safetensors"))
    save_file({f"bert.{k}": v for k, v in state.items()} | {"cls.predictions.bias": torch.zeros(3)},
              str(folder / "model.safetensors"))
    x = batch(random_bert)
    real = x["attention_mask"].bool()
    assert torch.equal(hidden(bert.load(folder, torch.float32), x)[real],
                       hidden(bert.load(random_bert, torch.float32), x)[real])


def with_config(src: Path, dest: Path, **changes) -> Path:
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("changes", [
    {"model_type": "roberta"}, {"position_embedding_type": "relative_key"}, {"is_decoder": True},
    {"add_cross_attention": True}, {"chunk_size_feed_forward": 4}, {"hidden_act": "silu"},
    {"num_attention_heads": 5}, {"hidden_size": None},
], ids=lambda c: next(iter(c)))
def test_other_configs_are_left_to_transformers(random_bert, tmp_path, changes):
    folder = with_config(random_bert, tmp_path / "other", **changes)
    assert not bert.supports(folder)
    assert bert.load(folder, torch.float32) is None


def test_missing_or_renamed_weights_are_left_to_transformers(random_bert, tmp_path):
    folder = tmp_path / "renamed"
    shutil.copytree(random_bert, folder)
    state = load_file(str(random_bert / "model.safetensors"))
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma"): v for k, v in state.items()}
    save_file(renamed, str(folder / "model.safetensors"))
    assert bert.supports(folder) and bert.load(folder, torch.float32) is None
    (folder / "model.safetensors").unlink()
    assert not bert.supports(folder)
    (folder / "config.json").write_text("[not an object]")
    assert bert.read_config(folder) is None and not bert.supports(folder)


def test_the_encoder_of_the_bundled_model_never_imports_transformers():
    """The point of the module: loading, tokenizing and encoding leave transformers (and
    the scikit-learn it pulls in) unimported."""
    code = ("import sys; from embedingest.stages.encoder import TextEncoder; "
            "enc = TextEncoder.load(None); enc.encode(['hello world']); "
            "print(type(enc.model).__name__, 'transformers' in sys.modules, 'sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["BertEncoder", "False", "False"]


@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_cuda_as_transformers_in_half_precision(dtype):
    """On the GPU the same kernels run in the same order: the same states as transformers'
    BertModel in fp16 and bf16."""
    x = {k: v.cuda() for k, v in batch(BUNDLED).items()}
    real = x["attention_mask"].bool()
    ours = hidden(bert.load(BUNDLED, dtype, "cuda"), x)
    ref = hidden(transformers_model(BUNDLED, dtype).cuda(), x)
    assert ours.device.type == "cuda" and ours.dtype == dtype
    assert torch.equal(ours[real], ref[real])
