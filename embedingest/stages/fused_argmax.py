"""The argmax of class scores scaled bilinearly to an image's size, in one pass on the GPU.

torchvision's pipeline scales all C class planes to the image's size
(``F.interpolate(..., mode="bilinear", align_corners=False)``) and takes their argmax: it
writes C scaled planes and reads them back to keep one byte per pixel. For a photograph
that is most of the masks' GPU time. This kernel computes each output pixel's C scaled
scores in registers, as PyTorch's CUDA kernel does (the source index
``scale * (dst + 0.5) - 0.5`` clamped at 0, the same four neighbours and weights, in
float32), rounds each to the scores' dtype as ``F.interpolate``'s output would be, and
keeps the first greatest (NaN counting as greatest, as ``argmax``); only the uint8 mask
is written.

Only float16 and bfloat16 scores (the GPU's default precisions): rounded to them, the
scores give the masks PyTorch's kernels give, pixel for pixel (float16 checked on an H200
over 98 million pixels of 300 photo-sized calls, none apart; bfloat16 on the tests'
cases); in float32 the unrounded sums expose the last bit of the multiply-adds' order,
which differs there, and the two steps run instead (:func:`handles`).

It needs Triton (installed with PyTorch's CUDA wheels; :func:`available`); without it the
two steps run. Triton compiles the kernel on first use (about 3 s on the H200, once per
scores' dtype and class count; it needs a C compiler for its launcher) and keeps it in its
own cache (``~/.triton/cache``, or ``TRITON_CACHE_DIR``), as it does for PyTorch's
compiled code. A job starts the compile in a thread (:func:`compile_ahead`) and makes its
first masks in two steps until it is done, so a machine with an empty cache never waits
for it; a kernel that does not compile (no C compiler, say) is reported once and the two
steps run (:func:`usable`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

BLOCK = 512  # output pixels per program
FORK_WAIT_S = 120.0  # the longest a fork waits for a compile under way


@functools.cache
def available() -> bool:
    """Whether Triton can be imported (the kernel is compiled on first use)."""
    try:
        importlib.import_module("triton.language")
    except Exception:  # any import failure (missing, broken install): the two-step path
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    # One compiled kernel for every size: Triton would otherwise compile a variant for each
    # mix of sizes and strides divisible by 16 (or equal to 1) and of aligned crops, and a
    # run over photographs of many sizes spent most of its time compiling.
    @triton.jit(do_not_specialize=["h", "w", "out_h", "out_w", "s_n", "s_c", "s_h", "s_w"],
                do_not_specialize_on_alignment=["x_ptr"])
    def scaled_argmax(x_ptr, out_ptr, h, w, out_h, out_w, s_n, s_c, s_h, s_w, scale_h, scale_w,
                      C: tl.constexpr, ROUND_F16: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(1)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < out_h * out_w
        oy = offs // out_w
        ox = offs % out_w
        # area_pixel_compute_source_index (align_corners=False, not cubic)
        sy = tl.maximum(scale_h * (oy.to(tl.float32) + 0.5) - 0.5, 0.0)
        sx = tl.maximum(scale_w * (ox.to(tl.float32) + 0.5) - 0.5, 0.0)
        y0 = sy.to(tl.int32)
        x0 = sx.to(tl.int32)
        y1 = y0 + tl.where(y0 < h - 1, 1, 0)
        x1 = x0 + tl.where(x0 < w - 1, 1, 0)
        ly1 = sy - y0.to(tl.float32)
        ly0 = 1.0 - ly1
        lx1 = sx - x0.to(tl.float32)
        lx0 = 1.0 - lx1
        base = x_ptr + n.to(tl.int64) * s_n
        p00 = base + y0 * s_h + x0 * s_w
        p01 = base + y0 * s_h + x1 * s_w
        p10 = base + y1 * s_h + x0 * s_w
        p11 = base + y1 * s_h + x1 * s_w
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_c = tl.zeros([BLOCK], tl.int32)
        found_nan = tl.zeros([BLOCK], tl.int1)
        for c in tl.static_range(C):
            a = tl.load(p00 + c * s_c, mask=inside, other=0.0).to(tl.float32)
            b = tl.load(p01 + c * s_c, mask=inside, other=0.0).to(tl.float32)
            d = tl.load(p10 + c * s_c, mask=inside, other=0.0).to(tl.float32)
            e = tl.load(p11 + c * s_c, mask=inside, other=0.0).to(tl.float32)
            # PyTorch's ly0 * (lx0 * a + lx1 * b) + ly1 * (lx0 * d + lx1 * e) with the fused
            # multiply-adds its compiled CUDA kernel has (found by comparing the orders)
            v = tl.fma(ly0, tl.fma(lx0, a, lx1 * b), ly1 * tl.fma(lx0, d, lx1 * e))
            if ROUND_F16:  # as F.interpolate's output in the scores' dtype
                v = v.to(tl.float16).to(tl.float32)
            else:
                v = v.to(tl.bfloat16).to(tl.float32)
            is_nan = v != v
            take = ((v > best) | is_nan) & ~found_nan
            best = tl.where(take, v, best)
            best_c = tl.where(take, c, best_c)
            found_nan = found_nan | is_nan
        tl.store(out_ptr + n.to(tl.int64) * out_h * out_w + offs, best_c.to(tl.uint8), mask=inside)

    return scaled_argmax


HALF = (torch.float16, torch.bfloat16)


MAX_PIXELS = 2**31 - BLOCK  # the kernel indexes an image's pixels, its last block's too, in int32


def handles(logits: torch.Tensor, size: tuple[int, int]) -> bool:
    """Whether :func:`scaled_argmax` takes ``logits`` to ``size``: on CUDA, float16 or
    bfloat16, at most 256 classes, at most :data:`MAX_PIXELS` pixels, with Triton there."""
    return (logits.is_cuda and logits.dtype in HALF and logits.shape[1] <= 256
            and size[0] * size[1] <= MAX_PIXELS and available())


class _Compile:
    """One kernel's compile for (device, dtype, classes): done, and whether it worked."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False
        self.thread: threading.Thread | None = None  # the background compile, if any


_compiles: dict[tuple, _Compile] = {}
_compiles_lock = threading.Lock()


def _key(device: torch.device, dtype: torch.dtype, classes: int) -> tuple:
    if device.type == "cuda" and device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    return device, dtype, classes


def _first_run(device: torch.device, dtype: torch.dtype, classes: int) -> None:
    """The kernel once on a tiny input, on a stream of its own: Triton compiles it then (or
    loads it from its cache)."""
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        scaled_argmax(torch.zeros((1, classes, 2, 2), dtype=dtype, device=device), (3, 3))
        torch.cuda.current_stream().synchronize()


def _compile(device: torch.device, dtype: torch.dtype, classes: int, state: _Compile) -> None:
    """:func:`_first_run`; a failure is logged and leaves ``state.ok`` False, so the two
    steps run."""
    try:
        _first_run(device, dtype, classes)
        state.ok = True
    except Exception as exc:  # noqa: BLE001 - any compile failure: the two steps make the same masks
        log.warning("the one-pass masks kernel did not compile for %s scores of %d classes on %s "
                    "(%s: %s); masks are made in two steps (scaled scores, then the argmax): the "
                    "same masks, more GPU time", str(dtype).removeprefix("torch."), classes,
                    device, type(exc).__name__, exc)
    finally:
        state.done.set()


def _start(device: torch.device, dtype: torch.dtype, classes: int, background: bool) -> _Compile:
    """The compile for these scores: the one under way or done, or one started now (here,
    or in a thread)."""
    device = torch.device(device)
    key = _key(device, dtype, classes)
    with _compiles_lock:
        state = _compiles.get(key)
        if state is not None:
            return state
        state = _compiles[key] = _Compile()
    if background:
        state.thread = threading.Thread(target=_compile, args=(device, dtype, classes, state),
                                        daemon=True, name="embedingest-masks-kernel")
        state.thread.start()
    else:
        _compile(device, dtype, classes, state)
    return state


def _join_before_fork() -> None:
    """A process forked while a compile runs would hold, forever, whatever lock the compile
    held (in LLVM, in Triton) in its copy of memory: a job forking its decoders right after
    another job's short run waits for that compile first (a few seconds, once; at most
    :data:`FORK_WAIT_S`, so a compile that hangs cannot hang every fork)."""
    threads = [state.thread for state in list(_compiles.values()) if state.thread is not None]
    if threading.current_thread() in threads:  # a compile that forks (none does) waits for none
        return
    deadline = time.monotonic() + FORK_WAIT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_join_before_fork)


def compile_ahead(device: str | torch.device, dtype: torch.dtype, classes: int) -> bool:
    """Compile the kernel for ``classes`` scores of ``dtype`` on ``device`` in a background
    thread (a job's main thread mostly waits meanwhile, for the GPU and the decoders);
    until it is done :func:`usable` says no and the masks take the two steps. False
    (nothing started) where the kernel would not be used."""
    device = torch.device(device)
    if (device.type != "cuda" or dtype not in HALF or not 1 <= classes <= 256
            or not available()):
        return False
    _start(device, dtype, classes, background=True)
    return True


def usable(logits: torch.Tensor, size: tuple[int, int]) -> bool:
    """Whether to take ``logits`` to ``size`` in one pass now: :func:`handles` them and the
    kernel is compiled for them. The first call compiles it here unless
    :func:`compile_ahead` is at it (False meanwhile); False for good where it did not
    compile (reported once)."""
    if not handles(logits, size):
        return False
    state = _start(logits.device, logits.dtype, logits.shape[1], background=False)
    return state.done.is_set() and state.ok


def scaled_argmax(logits: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [B, H, W]: the argmax over classes of ``logits`` [B, C, h, w] (CUDA, any
    strides, float16 or bfloat16, C <= 256) scaled bilinearly to ``size`` (H, W)."""
    b, c, h, w = logits.shape
    if c > 256:
        raise ValueError(f"{c} classes do not fit a uint8 mask")
    if logits.dtype not in HALF:
        raise ValueError(f"scores of {logits.dtype}: the one-pass argmax takes float16 or bfloat16 "
                         "(upsampled_argmax runs the two steps for others)")
    out_h, out_w = size
    if out_h * out_w > MAX_PIXELS:
        raise ValueError(f"a mask of {out_h}x{out_w} pixels is over the kernel's {MAX_PIXELS}")
    if (h, w) == (out_h, out_w):  # F.interpolate copies then: no weights, not even 0 x inf
        return logits.argmax(dim=1).to(torch.uint8)
    out = torch.empty((b, out_h, out_w), dtype=torch.uint8, device=logits.device)
    if out.numel() == 0:
        return out
    # the scale as PyTorch computes it: float(input) / output, in float32
    scale_h = float(torch.tensor(h, dtype=torch.float32) / out_h)
    scale_w = float(torch.tensor(w, dtype=torch.float32) / out_w)
    grid = (-(-out_h * out_w // BLOCK), b)
    on = torch.cuda.device(logits.device) if logits.is_cuda else contextlib.nullcontext()
    with on:  # a CPU tensor only under Triton's interpreter (TRITON_INTERPRET=1, the tests)
        _kernel()[grid](logits, out, h, w, out_h, out_w, *logits.stride(), scale_h, scale_w,
                        C=c, ROUND_F16=logits.dtype == torch.float16, BLOCK=BLOCK)
    return out
