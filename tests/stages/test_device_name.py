"""stages/device_name.py: the torch-free form of a --device value, which open_index checks
and resolve_device builds on."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, strategies as st

from embedingest.errors import ConfigError
from embedingest.stages.device import resolve_device
from embedingest.stages.device_name import device_name


@pytest.mark.parametrize("given_name, expected", [
    ("cpu", "cpu"), ("cpu:0", "cpu"), ("cpu:3", "cpu"), ("auto", "auto"), ("cuda", "cuda"),
    ("cuda:1", "cuda:1"), (torch.device("cuda", 2), "cuda:2"), (torch.device("cpu"), "cpu"),
])
def test_a_device_name_is_taken_as_the_jobs_load_it(given_name, expected):
    assert device_name(given_name) == expected


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "auto:0", " cpu", "", None, 0])
def test_a_bad_device_is_named_with_the_choices(bad):
    with pytest.raises(ConfigError, match=rf"device={str(bad)!r} is not a device; use auto, cuda, cuda:N or cpu"):
        device_name(bad)


@given(st.one_of(st.text(max_size=8), st.sampled_from(["cpu", "cuda", "auto", "meta", "mps"]).flatmap(
    lambda kind: st.sampled_from([kind, kind + ":0", kind + ":7", kind + ":a"]))))
def test_resolve_device_takes_exactly_the_names_device_name_takes(name):
    """One rule: where torch sees no GPU, a name is resolved if and only if its form is
    right (a cuda name is then refused for want of a GPU, not for its form)."""
    try:
        form = device_name(name)
    except ConfigError as exc:
        with pytest.raises(ConfigError) as refused:
            resolve_device(name)
        assert str(refused.value).startswith(str(exc).split(" is not")[0])
        return
    if form.startswith("cuda") and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch sees no CUDA device"):
            resolve_device(name)
    else:
        assert str(resolve_device(name)).startswith(form if form != "auto" else "c")


def test_device_name_imports_no_torch():
    code = ("import sys; from embedingest.stages.device_name import device_name; "
            "device_name('cuda:1'); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
