"""segment --devices on two CPU processes: the same masks as one process, one report."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from segment_fixtures import SIZE, noise, random_weights_file

from embedingest.errors import ConfigError
from embedingest.jobs.segment import SegmentConfig, segment
from embedingest.cli.segment import segment_command
from embedingest.sinks.masks import output_paths

SMALL = "deeplabv3_mobilenet_v3_large"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return random_weights_file(tmp_path_factory.mktemp("w") / "small.pth", arch=SMALL)


def make_images(root):
    """Images of distinct sizes in two folders, and two bad files."""
    sizes = {}
    for i in range(10):
        rel = ("" if i % 2 else "sub/") + f"img{i}.png"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(noise(20 + i, 40 - i, seed=i)).save(root / rel)
        sizes[rel] = (40 - i, 20 + i)
    (root / "empty.png").write_bytes(b"")
    (root / "sub" / "junk.jpg").write_bytes(b"not a jpeg at all")
    return sizes


def config(images, out, weights, **kw) -> SegmentConfig:
    return SegmentConfig(images=str(images), out=str(out), weights=str(weights), arch=SMALL,
                         size=SIZE, batch_size=3, num_workers=0, num_consumers=1, **kw)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, weights):
    """The images, and one CPU process's masks of them: the reference the tests compare with."""
    root = tmp_path_factory.mktemp("one_process")
    sizes = make_images(root / "images")
    summary = segment(config(root / "images", root / "one", weights, device="cpu"), progress=False)
    return root / "images", sizes, root / "one", summary


def test_two_processes_write_the_same_masks_as_one(tmp_path, weights, one_process):
    images, sizes, one_out, one = one_process
    two = segment(config(images, tmp_path / "two", weights, devices="cpu,cpu", stats=True), progress=False)
    assert one["written"] == two["written"] == len(sizes)
    assert two["skipped"] == one["skipped"] == 2 and two["device"] == "cpu,cpu"
    assert two["arch"] == one["arch"] == SMALL and two["resize"] == "short"
    assert len(two["engine"]["per_device"]) == 2
    shapes = [s for p in two["engine"]["per_device"] for s in p["batch_shapes"]]
    assert sum(n * k for n, _, _, k in shapes) == sum(n * k for n, _, _, k in one["batch_shapes"]) == len(sizes)
    # the devices' together at the top (a batch shape both ran counted once, its batches added)
    assert sum(n * k for n, _, _, k in two["batch_shapes"]) == len(sizes)
    assert len({(n, h, w) for n, h, w, _ in two["batch_shapes"]}) == len(two["batch_shapes"])
    assert two["decoders"] == sum(p["decoders"] for p in two["engine"]["per_device"])
    assert all(p["batches"] > 0 for p in two["engine"]["per_device"]), "both processes worked"
    for part in two["engine"]["per_device"]:
        assert part["timing"]["start_method"] == "spawn"  # CPU device processes never fork
        assert part["timing"]["first_forward_s"] > 0 and part["timing"]["load_model_s"] > 0
    for rel, (w, h) in sizes.items():
        a = np.asarray(Image.open(output_paths(one_out, rel)["mask"]))
        b = np.asarray(Image.open(output_paths(tmp_path / "two", rel)["mask"]))
        assert a.shape == (h, w) and np.array_equal(a, b), rel
    report = [json.loads(line) for line in (tmp_path / "two" / "skipped.jsonl").read_text().splitlines()]
    assert sorted(r["path"].rsplit("/", 1)[-1] for r in report) == ["empty.png", "junk.jpg"]
    import pyarrow.dataset as pads

    rows = pads.dataset(tmp_path / "two" / "stats").to_table().column("source").to_pylist()
    assert two["stats_rows"] == len(sizes) and sorted(rows) == sorted(sizes), "one row per image"
    again = segment(config(images, tmp_path / "two", weights, devices="cpu,cpu", stats=True), progress=False)
    assert again["already_done"] == len(sizes) and again["written"] == 0


def test_cli_devices_and_conflicting_device(tmp_path, weights):
    images = tmp_path / "images"
    make_images(images)
    args = [str(images), "--out", str(tmp_path / "o"), "--weights", str(weights), "--arch", SMALL,
            "--size", str(SIZE), "--num-workers", "0", "--num-consumers", "1", "--json"]
    result = CliRunner().invoke(segment_command, [*args, "--devices", "cpu,cpu"])
    assert result.exit_code == 3, result.output  # finished, with the two bad files skipped
    assert json.loads(result.output)["written"] == 10
    clash = CliRunner().invoke(segment_command, [*args, "--devices", "cpu,cpu", "--device", "cpu"])
    assert clash.exit_code == 1 and "devices" in clash.output
    with pytest.raises(ConfigError, match="devices="):
        segment(config(images, tmp_path / "x", weights, devices="cpu,cuda:0"), progress=False)


FORKED_SEGMENT = """
import json, sys
import embedingest.jobs.segment.devices as ms
ms.start_method = lambda devices: "fork"
from embedingest.jobs.segment import SegmentConfig, segment
s = segment(SegmentConfig(**json.loads(sys.argv[1])), progress=False)
print(json.dumps([p["timing"]["start_method"] for p in s["engine"]["per_device"]]))
"""


def _forked_segment(images, out, weights, devices) -> list[str]:
    import subprocess
    import sys

    cfg = dict(images=str(images), out=str(out), weights=str(weights), arch=SMALL, size=SIZE,
               batch_size=3, num_workers=0, num_consumers=1, devices=devices)
    run = subprocess.run([sys.executable, "-c", FORKED_SEGMENT, json.dumps(cfg)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_forked_device_processes_write_the_same_masks(tmp_path, weights, one_process):
    """The fork path GPUs take, on two CPU processes from a fresh interpreter."""
    images, sizes, one_out, _ = one_process
    assert _forked_segment(images, tmp_path / "two", weights, "cpu,cpu") == ["fork", "fork"]
    for rel in sizes:
        a = np.asarray(Image.open(output_paths(one_out, rel)["mask"]))
        b = np.asarray(Image.open(output_paths(tmp_path / "two", rel)["mask"]))
        assert np.array_equal(a, b), rel


@pytest.mark.needs_cuda
def test_gpu_processes_are_forked_and_write_the_one_gpu_masks(tmp_path, weights):
    """Two processes on GPU 0 (named twice, so one GPU is enough): forked, since the
    parent never touched CUDA, and the masks of one GPU."""
    import subprocess
    import sys

    images = tmp_path / "images"
    sizes = make_images(images)
    code = ("import json, sys; from embedingest.jobs.segment import SegmentConfig, segment; "
            "s = segment(SegmentConfig(**json.loads(sys.argv[1])), progress=False); "
            "print(json.dumps([p['timing']['start_method'] for p in s['engine'].get('per_device', [])]))")
    methods = []
    for out, devices in (("one", "0"), ("two", "0,0")):
        cfg = dict(images=str(images), out=str(tmp_path / out), weights=str(weights), arch=SMALL,
                   size=SIZE, batch_size=3, num_workers=0, num_consumers=1, devices=devices,
                   dtype="fp32")
        run = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        methods = json.loads(run.stdout.splitlines()[-1])
    assert methods == ["fork", "fork"]
    for rel in sizes:
        a = np.asarray(Image.open(output_paths(tmp_path / "one", rel)["mask"]))
        b = np.asarray(Image.open(output_paths(tmp_path / "two", rel)["mask"]))
        # cuDNN may pick other kernels in another process: near-ties of random weights may flip
        assert a.shape == b.shape and (a != b).mean() < 0.01, rel
