"""--devices parsing, the split of units by size, and the environment of each device."""

from __future__ import annotations

import pytest

from embedingest import build_index
from embedingest.errors import ConfigError
from embedingest.scaleout import child_env, parse_devices, share_of_cpus, split_by_size
from embedingest.scaleout import devices as devices_mod


def test_parse_devices_names(monkeypatch):
    monkeypatch.setattr(devices_mod, "_cuda_count", lambda: 4)
    assert parse_devices("") == []
    assert parse_devices("cpu,cpu") == ["cpu", "cpu"]
    assert parse_devices("all") == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert parse_devices("0, 2") == ["cuda:0", "cuda:2"]
    assert parse_devices("cuda:1,cuda:1") == ["cuda:1", "cuda:1"]


@pytest.mark.parametrize("spec, words", [
    ("gpu0", ["'gpu0' is not a device", "cpu,cpu"]),
    ("cpu,0", ["mixes CPU and GPUs"]),
    ("0,5", ["there is no GPU 5", "0..3"]),
])
def test_parse_devices_errors_name_the_value(monkeypatch, spec, words):
    monkeypatch.setattr(devices_mod, "_cuda_count", lambda: 4)
    with pytest.raises(ConfigError) as err:
        parse_devices(spec)
    for word in words:
        assert word in str(err.value)


def test_gpus_asked_for_without_cuda(monkeypatch):
    monkeypatch.setattr(devices_mod, "_cuda_count", lambda: 0)
    for spec in ("all", "0,1"):
        with pytest.raises(ConfigError, match="no CUDA GPU.*cpu,cpu"):
            parse_devices(spec)


def test_device_and_devices_together_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="both given"):
        build_index([("a", "text")], out=str(tmp_path / "i"), device="cpu", devices="cpu,cpu")


def test_split_by_size_balances_bytes_and_keeps_order():
    sizes = [900, 10, 10, 10, 500, 400, 10, 0]
    groups = split_by_size(sizes, 2)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in g) for g in groups]
    assert max(loads) - min(loads) <= 20
    assert all(g == sorted(g) for g in groups)
    assert split_by_size([5], 3) == [[0], [], []]


def test_child_env_pins_one_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert child_env("cpu") == ({}, "cpu")
    assert child_env("cuda:1") == ({"CUDA_VISIBLE_DEVICES": "1"}, "cuda:0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert child_env("cuda:1") == ({"CUDA_VISIBLE_DEVICES": "6"}, "cuda:0")


def test_share_of_cpus(monkeypatch):
    monkeypatch.setattr(devices_mod, "usable_cpus", lambda: 32)
    assert share_of_cpus(3, 2) == 3
    assert share_of_cpus(-1, 2) == 14
    assert share_of_cpus(-1, 8) == 2
    assert share_of_cpus(-1) == 30
    monkeypatch.setattr(devices_mod, "usable_cpus", lambda: 2)
    assert share_of_cpus(-1, 2) == 1


def test_usable_cpus_follows_affinity(monkeypatch):
    monkeypatch.setattr(devices_mod.os, "sched_getaffinity", lambda pid: {0, 3, 5})
    monkeypatch.setattr(devices_mod.os, "cpu_count", lambda: 64)
    assert devices_mod.usable_cpus() == 3
