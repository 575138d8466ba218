"""Nothing lost: segment under faults, through the real CLI (``python -m embedingest``).

Each test hits a run (SIGKILL of a consumer or of the main process, Ctrl-C, a full disk,
poisoned images), checks that every mask on disk is whole, re-runs the same command and
checks that then every good image has exactly its one mask, readable and at the image's
own size. The ``cli`` fixture (conftest.py) checks after every test that no process of
any run is left and that /dev/shm holds no new file.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import (check_ctrl_c_during_start_up, check_ctrl_c_stops, stop_bound, stopped_by_dead_consumer,
                           tmp_files, wait_for)
from PIL import Image

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda)]
SLOW_SINK = {"EMBEDINGEST_FI_SINK_DELAY": "0.2"}
N_IMAGES = 36


def seg_args(device: str = "cpu") -> list[str]:
    # the small DeepLabV3 with random weights: the whole pipeline at little CPU cost
    return ["--arch", "deeplabv3_mobilenet_v3_large", "--random-weights", "--size", "64",
            "--batch-size", "2", "--device", device, "--num-workers", "0", "--num-consumers", "2"]


def make_images(root: Path, n: int = N_IMAGES, seed: int = 0) -> dict[str, tuple[int, int]]:
    """Images of distinct sizes (a mask given to the wrong image shows by its size), in
    several formats and folders; returns rel path -> (width, height)."""
    rng = np.random.default_rng(seed)
    sizes = {}
    for i in range(n):
        rel = ["", "a/", "a/b/"][i % 3] + f"img{i:02d}." + ["png", "jpg", "webp", "bmp"][i % 4]
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        w, h = 30 + i, 70 - i
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / rel)
        sizes[rel] = (w, h)
    return sizes


def mask_path(out: Path, rel: str) -> Path:
    return out / (rel + ".png")


def masks_on_disk(out: Path) -> list[Path]:
    return [p for p in out.rglob("*.png") if not p.name.startswith(".")]


def check_masks_whole(out: Path, sizes: dict[str, tuple[int, int]]) -> int:
    """Every mask on disk loads, is a palette image, and has its image's size."""
    by_mask = {mask_path(out, rel): size for rel, size in sizes.items()}
    found = masks_on_disk(out)
    for p in found:
        assert p in by_mask, f"unexpected output {p}"
        with Image.open(p) as im:
            im.load()
            assert im.mode == "P" and im.size == by_mask[p], (p, im.mode, im.size)
    return len(found)


def check_all_masks(out: Path, sizes: dict[str, tuple[int, int]]) -> None:
    """Exactly one whole mask per good image, nothing else, no temporary file left."""
    assert check_masks_whole(out, sizes) == len(sizes)
    for rel in sizes:
        assert mask_path(out, rel).is_file(), rel
    assert not tmp_files(out), tmp_files(out)
    if (out / "skipped.jsonl").exists():
        for line in (out / "skipped.jsonl").read_text().splitlines():
            json.loads(line)


def segment(cli, images: Path, out: Path, *extra, env=None, device="cpu"):
    return cli("segment", images, "--out", out, *seg_args(device), *extra, env=env)


def finish(cli, images, out, sizes, device="cpu", rc=0) -> dict:
    run = segment(cli, images, out, "--json", device=device)
    assert run.wait() == rc, run.describe()
    check_all_masks(out, sizes)
    summary = json.loads(run.stdout)
    assert summary["already_done"] + summary["written"] == len(sizes), summary
    return summary


@pytest.mark.parametrize("device", DEVICES)
def test_consumer_sigkill_stops_run_naming_it_and_rerun_completes(cli, tmp_path, device):
    """A consumer dies while its 5th mask is half written; the re-run loses another
    consumer (killed from outside, found among the CLI's children); the third run ends it."""
    images = tmp_path / "images"
    sizes = make_images(images)
    out = tmp_path / "masks"
    run = segment(cli, images, out, device=device,
                  env={**SLOW_SINK, "EMBEDINGEST_FI_KILL": "consumer:*.png:5:mid"})
    wait_for(lambda: not run.running() or tmp_files(out), 120, what="a half-written mask")
    stopped_by_dead_consumer(run, None)
    assert tmp_files(out)  # the half-written mask, under its temporary name only
    first = check_masks_whole(out, sizes)
    assert 0 < first < len(sizes)

    run = segment(cli, images, out, env=SLOW_SINK, device=device)
    wait_for(lambda: len(masks_on_disk(out)) >= first + 4 or not run.running(), 120, what="four masks")
    assert run.running(), run.describe()
    consumers = run.consumers()
    assert len(consumers) == 2, consumers
    victim = min(consumers)
    os.kill(victim, signal.SIGKILL)
    stopped_by_dead_consumer(run, victim)
    assert check_masks_whole(out, sizes) < len(sizes)
    finish(cli, images, out, sizes, device)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("device", DEVICES)
def test_main_sigkill_at_random_moments_leaves_only_whole_masks(cli, tmp_path, device, seed):
    """A run killed after a random number of masks; its re-run killed again, with seed 0
    while it writes the skip report, with seed 1 at a random moment (and decoding in a
    DataLoader worker); then a run to the end. Only the main process is killed: the
    consumers (and the worker) must end by themselves."""
    rng = random.Random(seed)
    images = tmp_path / "images"
    sizes = make_images(images, seed=seed)
    (images / "empty.png").write_bytes(b"")
    out = tmp_path / "masks"
    killed = 0
    for attempt in range(2):
        workers = ["--num-workers", "1"] if seed == 1 and attempt == 1 else []
        env = dict(SLOW_SINK)
        if seed == 0 and attempt == 1:
            env["EMBEDINGEST_FI_KILL"] = "main:skipped.jsonl:1:mid"
        run = segment(cli, images, out, *workers, env=env, device=device)
        before = len(masks_on_disk(out))
        if attempt == 0:  # mid-run: after a random number of this run's masks
            k = rng.randint(1, 10)
            wait_for(lambda run=run, n=before + k: len(masks_on_disk(out)) >= n or not run.running(),
                     120, what=f"{k} masks")
            time.sleep(rng.uniform(0, 0.3))
        elif seed == 1:  # anywhere in the resumed run: a random moment
            deadline = time.monotonic() + rng.uniform(0.5, 6.0)
            while run.running() and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            assert run.wait() == -signal.SIGKILL, run.describe()
            assert list(out.glob(".skipped.jsonl.tmp-*"))  # cut mid-write, never renamed
            killed += 1
        if run.running():
            os.kill(run.pid, signal.SIGKILL)
            killed += 1
            assert run.wait() == -signal.SIGKILL
        run.assert_no_leftovers()
        check_masks_whole(out, sizes)
    assert killed >= 1 + (seed == 0)
    summary = finish(cli, images, out, sizes, device, rc=3)
    report = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert [Path(r["path"]).name for r in report] == ["empty.png"]  # reported, once
    assert summary["skipped"] == 1


def test_main_sigkill_as_the_loader_worker_starts_leaves_no_process(cli, tmp_path):
    """The main process killed the moment its DataLoader worker is forked: the worker
    must not run on, orphaned."""
    images = tmp_path / "images"
    sizes = make_images(images, n=8)
    out = tmp_path / "masks"
    run = segment(cli, images, out, "--num-workers", "1", env=SLOW_SINK)
    wait_for(lambda: run.loader_workers() or not run.running(), 120, 0.002, "the loader worker")
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL, run.describe()
    run.assert_no_leftovers(timeout=5)
    check_masks_whole(out, sizes)


@pytest.mark.parametrize("device", DEVICES)
def test_ctrl_c_exits_130_within_5_s_and_resume_keeps_masks(cli, tmp_path, device):
    bound = stop_bound("embedingest.jobs.segment")
    images = tmp_path / "images"
    sizes = make_images(images, seed=2)
    out = tmp_path / "masks"
    run = segment(cli, images, out, "--num-workers", "1", env=SLOW_SINK, device=device)
    wait_for(lambda: len(masks_on_disk(out)) >= 4 or not run.running(), 120, what="four masks")
    check_ctrl_c_stops(run, bound)
    kept = check_masks_whole(out, sizes)
    assert 4 <= kept < len(sizes)
    summary = finish(cli, images, out, sizes, device)
    assert summary["already_done"] == kept  # nothing saved was redone


@pytest.mark.parametrize("devices", [None, "cpu,cpu"], ids=["one", "devices"])
def test_ctrl_c_during_start_up_exits_130_without_a_traceback(cli, tmp_path, devices):
    """Interrupted while importing torch, building the model or starting device
    processes: the same exit and message as later, nothing left running."""
    images = tmp_path / "images"
    make_images(images, n=6, seed=5)
    args = seg_args()
    if devices:
        at = args.index("--device")
        args[at:at + 2] = ["--devices", devices]
    check_ctrl_c_during_start_up(lambda n: cli("segment", images, "--out", tmp_path / f"masks{n}", *args))


@pytest.mark.parametrize("devices", [None, "cpu,cpu"], ids=["one", "devices"])
def test_ctrl_c_while_children_start_is_not_lost(cli, tmp_path, devices):
    """A Ctrl-C sent while the first child (consumer, device process) starts: the run ran
    on to exit 0 when it landed after multiprocessing's resource tracker unblocked SIGINT,
    or in the engine's pool thread, while SIGINT was ignored for the start."""
    images = tmp_path / "images"
    make_images(images, n=6, seed=5)
    args = seg_args()
    if devices:
        at = args.index("--device")
        args[at:at + 2] = ["--devices", devices]
    run = cli("segment", images, "--out", tmp_path / "masks", *args,
              env={"EMBEDINGEST_FI_CTRL_C_IN_CHILD_START": "1"})
    assert run.wait(60) == 130, run.describe()
    assert "interrupted:" in run.stderr and "Traceback" not in run.stderr, run.describe()
    run.assert_no_leftovers()


@pytest.mark.parametrize("device", DEVICES)
def test_disk_full_in_a_sink_fails_clearly_keeps_written_masks(cli, tmp_path, device):
    images = tmp_path / "images"
    sizes = make_images(images, seed=3)
    out = tmp_path / "masks"
    env = {"EMBEDINGEST_FI_ENOSPC": "7", "EMBEDINGEST_FI_COUNTER": str(tmp_path / "writes"),
           "EMBEDINGEST_FI_SINK_DELAY": "0.05"}
    run = segment(cli, images, out, env=env, device=device)
    assert run.wait() == 1, run.describe()
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("Error:") and "No space left on device" in last, run.describe()
    run.assert_no_leftovers()
    assert check_masks_whole(out, sizes) == 7  # the writes before the disk filled up
    summary = finish(cli, images, out, sizes, device)  # space freed: the same command again
    assert summary["already_done"] == 7


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` pixels (a decompression bomb)."""
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


def test_poisoned_images_are_each_reported_and_every_good_image_segmented(cli, tmp_path):
    images = tmp_path / "images"
    sizes = make_images(images, n=8, seed=4)
    rng = random.Random(4)
    bad: dict[str, set[str]] = {}

    def put(name: str, data: bytes, *reasons: str):
        (images / name).parent.mkdir(parents=True, exist_ok=True)
        (images / name).write_bytes(data)
        bad[name] = set(reasons)

    good_jpg = io.BytesIO()
    Image.fromarray(np.full((40, 40, 3), 90, np.uint8)).save(good_jpg, "JPEG")
    good_png = (images / "img00.png").read_bytes()
    put("random.jpg", bytes(rng.randrange(256) for _ in range(4000)), "not an image")
    put("zero.png", b"", "empty file")
    put("notes.png", b"this is text with an image name\n", "not an image")
    put("cut.jpg", good_jpg.getvalue()[: len(good_jpg.getvalue()) // 2], "corrupt or truncated")
    put("a/cut.png", good_png[: len(good_png) // 2], "corrupt or truncated")
    put("bomb.png", _png_claiming(60_000, 60_000), "too large")
    put("junk50.tif", b"II*\0" + bytes(rng.randrange(256) for _ in range(2000)) * 25_000,
        "corrupt or truncated", "not an image", "cannot decode", "too large", "unsupported mode")
    (images / "a" / "loop").symlink_to("..")
    bad["a/loop"] = {"symlink loop"}
    (images / "self.png").symlink_to("self.png")
    bad["self.png"] = {"cannot stat", "broken or looping symbolic link"}
    (images / "locked.png").write_bytes(good_png)
    bad["locked.png"] = {"unreadable"}
    os.chmod(images / "locked.png", 0)
    env = {}
    try:
        with open(images / "locked.png", "rb"):
            env = {"EMBEDINGEST_FI_EACCES": "locked.png"}  # running as root: simulate it
    except PermissionError:
        pass
    (images / "misnamed.png").write_bytes(good_jpg.getvalue())  # a JPEG named .png is fine
    sizes["misnamed.png"] = (40, 40)
    out = tmp_path / "masks"
    run = segment(cli, images, out, "--json", env=env)
    assert run.wait(120) == 3, run.describe()  # finished, some images skipped
    report = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    for name, reasons in bad.items():
        where = str(images / name)
        mine = [r for r in report if r["path"] == where]
        assert mine, f"{name} is not in skipped.jsonl: {report}"
        for r in mine:
            assert any(r["reason"].startswith(k) for k in reasons), (name, r)
    check_all_masks(out, sizes)
    assert json.loads(run.stdout)["written"] == len(sizes)
