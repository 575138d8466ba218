"""stages/device.py: the one owner of the --device and --dtype rules."""

from __future__ import annotations

import pytest
import torch

from embedingest.config import DTYPE_NAMES
from embedingest.errors import ConfigError
from embedingest.stages.device import DTYPES, precision, resolve_device, resolve_dtype


def test_dtype_names_agree_with_the_config_choices():
    assert tuple(DTYPES) == DTYPE_NAMES
    assert DTYPES == {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def test_auto_precision_is_fp16_on_cuda_and_fp32_elsewhere():
    assert precision("auto", cuda=True) == "fp16" and precision("auto", cuda=False) == "fp32"
    assert precision("bf16", cuda=True) == "bf16" and precision("fp16", cuda=False) == "fp16"
    assert resolve_dtype("auto", "cpu") == torch.float32
    with pytest.raises(ConfigError, match="dtype='fp8' is not one of auto, fp32, fp16, bf16"):
        resolve_dtype("fp8", "cpu")


def test_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="device='gpu9' is not a device"):
        resolve_device("gpu9")
    with pytest.raises(ConfigError, match="device='meta' is not supported"):
        resolve_device("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_without_a_gpu_says_what_to_pass():
    with pytest.raises(ConfigError, match="torch sees no CUDA device; use device cpu"):
        resolve_device("cuda:0")
