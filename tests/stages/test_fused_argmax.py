"""The one-pass scaled argmax (:mod:`embedingest.stages.fused_argmax`) against torchvision's
two steps, ``F.interpolate(bilinear, align_corners=False)`` then ``argmax``: the same mask,
pixel for pixel. On the CPU the kernel runs under Triton's interpreter (numpy); on the
GPU (``needs_cuda``) compiled, against PyTorch's own CUDA kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from embedingest.stages import fused_argmax
from embedingest.stages.segmentation import upsampled_argmax

pytestmark = pytest.mark.skipif(not fused_argmax.available(), reason="Triton is not installed")


def reference(logits: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's pipeline: the scaled scores in the logits' dtype, then the argmax."""
    up = F.interpolate(logits.float(), size=size, mode="bilinear", align_corners=False)
    return up.to(logits.dtype).argmax(dim=1).to(torch.uint8)


# Triton reads TRITON_INTERPRET when it is imported: the interpreted cases run in a child.
PRELUDE = """
import torch, torch.nn.functional as F
from embedingest.stages.fused_argmax import scaled_argmax

def reference(logits, size):
    up = F.interpolate(logits.float(), size=size, mode="bilinear", align_corners=False)
    return up.to(logits.dtype).argmax(dim=1).to(torch.uint8)

def same(logits, size):
    got, want = scaled_argmax(logits, size), reference(logits, size)
    assert torch.equal(got, want), (logits.shape, logits.stride(), size, (got != want).sum().item())
"""


def interpreted(body: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body) + "\nprint('checked')"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("checked"), run.stderr[-3000:]


def test_the_same_mask_as_scaling_then_argmax():
    """Random sizes (up and down, 1 pixel included), classes and seeds, in float16 (the
    interpreter truncates to bfloat16 where the GPU rounds, so bfloat16 is checked there)."""
    interpreted("""
        import random
        rng = random.Random(7)
        for case in range(16):
            h, w, oh, ow = (rng.randint(1, 12) for _ in range(4))
            oh, ow = oh * rng.choice((1, 2)), ow * rng.choice((1, 2))
            classes = rng.randint(1, 5)
            g = torch.Generator().manual_seed(case)
            same((torch.randn((2, classes, h, w), generator=g) * 4).half(), (oh, ow))
    """)


def test_any_strides_up_and_down():
    """A channels-last tensor (the model's output on the GPU), a crop of one (the image part
    of a padded input), up- and down-scaling, 21 classes."""
    interpreted("""
        g = torch.Generator().manual_seed(1)
        logits = (torch.randn((2, 21, 14, 18), generator=g) * 3).to(torch.float16)
        last = logits.contiguous(memory_format=torch.channels_last)
        for view in (logits, last, last[:, :, 1:12, :15], logits[1:, :, ::2, 3:]):
            for size in ((31, 40), (9, 7), (14, 18)):
                same(view, size)
    """)


def test_ties_go_to_the_first_class_and_nan_counts_as_greatest():
    interpreted("""
        assert scaled_argmax(torch.zeros((1, 4, 3, 3)).half(), (5, 6)).tolist() == [[[0] * 6] * 5]
        x = torch.zeros((1, 4, 3, 3), dtype=torch.float16)
        x[0, 2] = 1.0
        x[0, 3] = 1.0  # a tie above the rest: the lower class
        x[0, 1, 0, 0] = float("nan")  # every output pixel that touches it
        same(x, (5, 6))
        assert {int(v) for v in reference(x, (5, 6)).unique()} == {1, 2}
        assert scaled_argmax(torch.full((1, 3, 2, 2), float("-inf")).half(), (3, 3)).tolist() == [[[0] * 3] * 3]
        # float16: 1 + 2**-12 rounds to 1, a tie with class 0 (which unrounded it would beat)
        x = torch.tensor([[[[1.0, 1.0]], [[1.0, 1.0 + 2**-10]]]], dtype=torch.float16)
        same(x, (1, 4))
        assert scaled_argmax(x, (1, 4)).tolist() == [[[0, 0, 1, 1]]]
    """)


def test_more_classes_than_a_mask_holds_or_float32_are_refused():
    with pytest.raises(ValueError, match="257 classes"):
        fused_argmax.scaled_argmax(torch.zeros((1, 257, 2, 2)).half(), (4, 4))
    with pytest.raises(ValueError, match="torch.float32: the one-pass argmax takes float16 or bfloat16"):
        fused_argmax.scaled_argmax(torch.zeros((1, 3, 2, 2)), (4, 4))
    with pytest.raises(ValueError, match="a mask of 65536x32768 pixels is over the kernel's 2147483136"):
        fused_argmax.scaled_argmax(torch.zeros((1, 3, 2, 2)).half(), (65536, 32768))


class _Scores:
    """What :func:`fused_argmax.handles` looks at, without a GPU."""

    def __init__(self, dtype, classes=21, cuda=True):
        self.is_cuda, self.dtype, self.shape = cuda, dtype, (1, classes, 8, 8)


def test_the_kernel_takes_half_precision_cuda_scores_of_int32_sized_masks_only():
    size = (1200, 1600)
    assert fused_argmax.handles(_Scores(torch.float16), size) and fused_argmax.handles(_Scores(torch.bfloat16), size)
    assert not fused_argmax.handles(_Scores(torch.float32), size)
    assert not fused_argmax.handles(_Scores(torch.float16, cuda=False), size)
    assert not fused_argmax.handles(_Scores(torch.float16, classes=300), size)
    assert fused_argmax.handles(_Scores(torch.float16), (1, 2**31 - 512))
    assert not fused_argmax.handles(_Scores(torch.float16), (1, 2**31 - 511))  # its last block past int32


def test_off_the_gpu_the_two_steps_run(monkeypatch):
    """``upsampled_argmax`` uses the kernel on CUDA only: a CPU tensor never reaches it."""
    monkeypatch.setattr(fused_argmax, "scaled_argmax", lambda *a: pytest.fail("the kernel ran on the CPU"))
    logits = torch.randn((1, 3, 4, 5))
    assert torch.equal(upsampled_argmax(logits, (9, 11)), reference(logits, (9, 11)))


@pytest.mark.needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_the_gpu_the_same_masks_as_pytorchs_kernels(dtype):
    """Photo-sized masks from model-sized scores, as the job makes them (channels-last
    scores, cropped), against PyTorch's CUDA interpolate and argmax: every pixel equal."""
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = (torch.randn((4, 21, 520, 693), generator=g, device="cuda") * 4).to(dtype)
    scores = scores.contiguous(memory_format=torch.channels_last)
    for view, size in ((scores, (1200, 1600)), (scores[:, :, :, :690], (1199, 1594)),
                       (scores[1:3], (333, 250)), (scores[:1], (520, 693))):
        want = F.interpolate(view, size=size, mode="bilinear", align_corners=False).argmax(dim=1).to(torch.uint8)
        assert torch.equal(fused_argmax.scaled_argmax(view, size), want), (dtype, view.shape, size)


@pytest.mark.needs_cuda
def test_one_compiled_kernel_serves_every_size_and_crop():
    """Sizes divisible by 16 or not, of 1, crops at odd offsets: Triton compiles the kernel
    once (a variant per size would cost a run over photographs most of its time)."""
    kernel = fused_argmax._kernel()
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton does not expose its kernel cache")
    scores = torch.randn((3, 21, 48, 65), device="cuda").half().contiguous(memory_format=torch.channels_last)
    before = sum(len(cache[0]) for cache in caches.values())  # the float16 variant may exist already
    for view in (scores, scores[1:], scores[:, :, 1:, 3:], scores[2:, :, :47, :64]):
        for size in ((1, 1), (16, 32), (17, 33), (480, 641), (1, 700)):
            want = F.interpolate(view, size=size, mode="bilinear", align_corners=False).argmax(dim=1).to(torch.uint8)
            assert torch.equal(fused_argmax.scaled_argmax(view, size), want)
    assert sum(len(cache[0]) for cache in caches.values()) - before <= 1


@pytest.fixture
def no_compiles(monkeypatch):
    """No kernel compiled yet, as in a fresh process."""
    monkeypatch.setattr(fused_argmax, "_compiles", {})


def test_a_kernel_that_does_not_compile_is_reported_once_and_the_two_steps_run(monkeypatch, caplog, no_compiles):
    """Triton builds its launcher with the system's C compiler: where there is none (a slim
    image), the masks are still made, in two steps, and the user is told why, once."""
    tried = []

    def first_run(device, dtype, classes):
        tried.append((device, dtype, classes))
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(fused_argmax, "_first_run", first_run)
    monkeypatch.setattr(fused_argmax, "handles", lambda logits, size: True)  # CPU scores stand in for CUDA ones
    monkeypatch.setattr(fused_argmax, "scaled_argmax", lambda *a: pytest.fail("the kernel ran though it did not compile"))
    logits = torch.randn((2, 5, 4, 6))
    with caplog.at_level("WARNING", logger=fused_argmax.__name__):
        for _ in range(3):
            assert torch.equal(upsampled_argmax(logits, (9, 13)), reference(logits, (9, 13)))
    assert tried == [(torch.device("cpu"), torch.float32, 5)]
    [record] = caplog.records
    assert "did not compile for float32 scores of 5 classes on cpu (RuntimeError: Failed to find C compiler" \
        in record.getMessage()


def test_while_the_kernel_compiles_in_the_background_the_two_steps_run(monkeypatch, no_compiles):
    """``compile_ahead``: the first masks do not wait for the compile, and once it is done
    the kernel takes over; a second call starts nothing."""
    started, release, runs, kernel_sizes = threading.Event(), threading.Event(), [], []

    def first_run(device, dtype, classes):
        runs.append((device, dtype, classes))
        started.set()
        assert release.wait(30)

    def kernel(logits, size):
        kernel_sizes.append(size)
        return reference(logits, size)

    monkeypatch.setattr(fused_argmax, "_first_run", first_run)
    monkeypatch.setattr(fused_argmax, "available", lambda: True)
    monkeypatch.setattr(fused_argmax, "handles", lambda logits, size: True)
    # CPU scores in float32 stand in for the GPU's float16 ones
    monkeypatch.setattr(fused_argmax, "_key", lambda device, dtype, classes: ("gpu", classes))
    monkeypatch.setattr(fused_argmax, "scaled_argmax", kernel)
    logits = torch.randn((1, 7, 5, 5))
    assert fused_argmax.compile_ahead("cuda:0", torch.float16, 7)
    assert started.wait(30)
    assert not fused_argmax.usable(logits, (8, 8))
    assert torch.equal(upsampled_argmax(logits, (8, 8)), reference(logits, (8, 8)))
    assert kernel_sizes == []
    release.set()
    assert fused_argmax._compiles[("gpu", 7)].done.wait(30)
    assert fused_argmax.usable(logits, (8, 8))
    assert torch.equal(upsampled_argmax(logits, (8, 8)), reference(logits, (8, 8)))
    assert kernel_sizes == [(8, 8)]
    assert fused_argmax.compile_ahead("cuda:0", torch.float16, 7)
    assert runs == [(torch.device("cuda", 0), torch.float16, 7)]


def test_compile_ahead_starts_nothing_where_the_kernel_would_not_run(monkeypatch, no_compiles):
    monkeypatch.setattr(fused_argmax, "available", lambda: True)
    monkeypatch.setattr(fused_argmax, "_first_run", lambda *a: pytest.fail("compiled"))
    assert not fused_argmax.compile_ahead("cpu", torch.float16, 21)
    assert not fused_argmax.compile_ahead("cuda:0", torch.float32, 21)
    assert not fused_argmax.compile_ahead("cuda:0", torch.float16, 257)
    monkeypatch.setattr(fused_argmax, "available", lambda: False)
    assert not fused_argmax.compile_ahead("cuda:0", torch.float16, 21)
    assert fused_argmax._compiles == {}


@pytest.mark.needs_cuda
def test_compiled_ahead_on_the_gpu_the_kernel_is_used(no_compiles):
    fused_argmax.compile_ahead("cuda", torch.bfloat16, 9)
    state = fused_argmax._compiles[(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, 9)]
    assert state.done.wait(120) and state.ok
    scores = torch.randn((2, 9, 30, 41), device="cuda").bfloat16()
    assert fused_argmax.usable(scores, (61, 80))
    want = F.interpolate(scores, size=(61, 80), mode="bilinear", align_corners=False).argmax(dim=1).to(torch.uint8)
    assert torch.equal(upsampled_argmax(scores, (61, 80)), want)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_fork_waits_for_a_compile_in_the_background(monkeypatch, no_compiles):
    """A forked child gets no half-held locks of a compile: the fork happens after it."""
    release = threading.Event()
    monkeypatch.setattr(fused_argmax, "_first_run", lambda *a: release.wait(30))
    monkeypatch.setattr(fused_argmax, "available", lambda: True)
    assert fused_argmax.compile_ahead("cuda:0", torch.float16, 3)
    [state] = fused_argmax._compiles.values()
    threading.Timer(0.3, release.set).start()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert release.is_set() and state.done.is_set() and not state.thread.is_alive()
    assert os.waitpid(pid, 0)[1] == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_compile_that_hangs_holds_a_fork_up_only_so_long(monkeypatch, no_compiles):
    release = threading.Event()
    monkeypatch.setattr(fused_argmax, "_first_run", lambda *a: release.wait(60))
    monkeypatch.setattr(fused_argmax, "available", lambda: True)
    monkeypatch.setattr(fused_argmax, "FORK_WAIT_S", 0.5)
    assert fused_argmax.compile_ahead("cuda:0", torch.float16, 3)
    [state] = fused_argmax._compiles.values()
    try:
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        waited = time.monotonic() - t0
        assert 0.4 < waited < 30 and state.thread.is_alive()
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        release.set()
        state.thread.join(30)
