"""Batches planned from the files' headers: one shape each, as few per shape as can be,
every image once, each batch handed over as soon as its shape has filled it."""

from __future__ import annotations

import functools
import math
import os
import time
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from segment_fixtures import SIZE, bad_files, exif_rotated_jpeg, image_tree, noise
from torch.utils.data import DataLoader

from embedingest.sources.image_decode import Preprocessing, header_size, open_rgb
from embedingest.sources.images import (BadImage, BatchJoiner, ImageBatch, ImageFileDataset, collate_images,
                                        regroup)
from embedingest.sources.shape_batches import HeaderReaders, ShapeBatchSampler, SizeStream

SHORT = Preprocessing("short", SIZE)


def test_header_size_is_the_decoded_size(tmp_path):
    sizes = image_tree(tmp_path)
    Image.fromarray(noise(30, 50)).save(tmp_path / "exif.png", exif=_orientation(6))  # eXIf before the pixels
    sizes["exif.png"] = (30, 50)
    exif_rotated_jpeg(tmp_path / "mirrored.jpg", 40, 20, orientation=2)  # flipped, not turned
    sizes["mirrored.jpg"] = (40, 20)
    for rel, size in sizes.items():
        assert header_size(tmp_path / rel) == size == open_rgb(tmp_path / rel)[1], rel
    (tmp_path / "bad").mkdir()
    for rel in bad_files(tmp_path / "bad"):
        if rel not in ("cut.jpg", "cut.png"):  # a cut file's header is whole
            assert header_size(tmp_path / "bad" / rel) is None, rel
    assert header_size(tmp_path / "missing.jpg") is None


def _orientation(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


class _Stream(SizeStream):
    """Shapes given instead of read: ``ready_after[k]`` is how many are read ahead (ready
    without waiting) once k have been handed out; it counts the ones handed out."""

    def __init__(self, shapes, ready_after=None):
        super().__init__(list(range(len(shapes))))
        self.shapes, self.ready_after = shapes, ready_after or {}
        self.looked = 0

    def ready(self) -> list:
        upto = min(len(self.shapes), self.ready_after.get(self.looked, self.looked))
        return self._hand(upto - self.looked)

    def next(self):
        return self._hand(1) if self.looked < len(self.shapes) else None

    def _hand(self, n: int) -> list:
        got = self.shapes[self.looked:self.looked + n]
        self.looked += len(got)
        self.done = self.looked
        return list(got)


class _Planned(ShapeBatchSampler):
    """The sampler with the shapes given instead of read, and the files it looked at."""

    def __init__(self, shapes, batch_size, chunk_size=None, ready_after=None):
        super().__init__([(str(i), str(i)) for i in range(len(shapes))], SHORT, batch_size, chunk_size)
        self.stream = _Stream(shapes, ready_after)

    @property
    def looked(self) -> int:
        return self.stream.looked

    def shapes(self):
        return self.stream


def _batches(sampler) -> list[list[int]]:
    """The sampler's lists joined into batches by its ``chunk_batch``."""
    parts: dict[int, list] = {}
    for chunk in sampler:
        place = sampler.chunk_batch(chunk[0])
        parts.setdefault(place.batch, [None] * place.parts)[place.part] = chunk
    assert not sampler._places, "every list asked about once"
    assert sorted(parts) == list(range(len(parts)))
    return [[i for chunk in parts[n] for i in chunk] for n in range(len(parts))]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([(4, 6), (6, 4), (5, 5), (4, 7), None]), max_size=60),
       st.integers(1, 7), st.integers(1, 8))
def test_plan_fills_every_shape_and_hands_batches_over_at_once(shapes, batch_size, chunk):
    sampler = _Planned(shapes, batch_size, batch_size)
    batches, looked_at = [], []
    for batch in sampler:
        batches.append(batch)
        looked_at.append(sampler.looked)
    assert sorted(i for b in batches for i in b) == list(range(len(shapes))), "each image once"
    assert all(len({shapes[i] for i in b}) == 1 for b in batches), "one shape a batch"
    counts = Counter(s for s in shapes if s is not None)
    made = Counter(shapes[b[0]] for b in batches if shapes[b[0]] is not None)
    assert made == {s: math.ceil(n / batch_size) for s, n in counts.items()}, "fewest batches a shape"
    assert all(len(b) == 1 for b in batches if shapes[b[0]] is None), "unknown ones alone"
    for batch, looked in zip(batches, looked_at, strict=True):
        if len(batch) == batch_size:  # handed over as soon as its last image was seen
            assert looked == max(batch) + 1
        if shapes[batch[0]] is None:
            assert looked == batch[0] + 1
    # smaller chunks are the same batches cut in order, and chunk_batch joins them again
    cut = [b[k:k + chunk] for b in batches for k in range(0, len(b), chunk)]
    assert list(_Planned(shapes, batch_size, chunk)) == cut
    assert _batches(_Planned(shapes, batch_size, chunk)) == batches


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([(4, 6), (6, 4), (5, 5), (4, 7), (7, 4), (3, 9), None]), max_size=80),
       st.integers(1, 6), st.dictionaries(st.integers(0, 80), st.integers(0, 80), max_size=6))
def test_short_batches_come_after_their_full_ones_whenever_the_headers_end(shapes, batch_size, ahead):
    """However far ahead the headers are read, each image goes once, each shape in as few
    batches as can be, and a shape's short batch after all its full ones."""
    batches = _batches(_Planned(shapes, batch_size, 2, ready_after=ahead))
    assert sorted(i for b in batches for i in b) == list(range(len(shapes)))
    assert all(len({shapes[i] for i in b}) == 1 for b in batches)
    counts = Counter(s for s in shapes if s is not None)
    assert Counter(shapes[b[0]] for b in batches if shapes[b[0]] is not None) == {
        s: math.ceil(n / batch_size) for s, n in counts.items()}
    for k, batch in enumerate(batches):
        shape = shapes[batch[0]]
        if shape is not None and len(batch) < batch_size:
            assert all(len(b) < batch_size or shapes[b[0]] != shape for b in batches[k + 1:])


def test_short_batches_are_spread_between_the_full_ones_once_the_headers_are_read():
    """Eight full batches of one ratio and four photographs of ratios of their own, every
    header read ahead: the four go between the full batches, not after the last."""
    a, odd = (4, 6), [(5, 5), (4, 7), (7, 4), (3, 9)]
    shapes = [a] * 4 + odd + [a] * 28
    batches = _batches(_Planned(shapes, 4, ready_after={0: len(shapes)}))
    order = ["full" if len(b) == 4 else shapes[b[0]] for b in batches]
    assert order == ["full", "full", odd[0], "full", "full", odd[1], "full", "full", odd[2],
                     "full", "full", odd[3]]
    # read one header at a time (nothing ahead), they come only once the last is read
    batches = _batches(_Planned(shapes, 4))
    assert [len(b) for b in batches] == [4] * 8 + [1] * 4


def test_a_shapes_short_batch_waits_for_all_its_full_ones():
    """Three full batches of one ratio are still to go when the headers end: its short
    batch goes after the third, though its turn between the full ones came earlier."""
    a, b = (4, 6), (6, 4)
    shapes = [a] * 13 + [b] * 5
    batches = _batches(_Planned(shapes, 4, ready_after={0: len(shapes)}))
    assert [(shapes[x[0]], len(x)) for x in batches] == [(a, 4), (a, 4), (a, 4), (a, 1), (b, 4), (b, 1)]


def test_short_batches_go_fullest_first_and_a_shape_done_early_is_not_held():
    """The fullest short batch goes first; a shape whose full batches all went before
    the last header was read has its short batch spread like the others, not kept to
    the end."""
    a, b, x, y, z = (4, 6), (6, 4), (5, 5), (4, 7), (7, 4)
    shapes = [a] * 8 + [x] + [y] * 3 + [z] * 2
    batches = _batches(_Planned(shapes, 4, ready_after={0: len(shapes)}))
    assert [(shapes[i[0]], len(i)) for i in batches] == [(a, 4), (y, 3), (a, 4), (z, 2), (x, 1)]
    shapes = [a] * 8 + [b] * 16 + [a, x]  # a's two full batches go before the rest is read
    batches = _batches(_Planned(shapes, 4, ready_after={9: len(shapes)}))
    assert [(shapes[i[0]], len(i)) for i in batches] == [(a, 4), (a, 4), (b, 4), (b, 4), (a, 1),
                                                          (b, 4), (b, 4), (x, 1)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([(4, 6), (6, 4), (5, 5), None]), max_size=60), st.integers(1, 8),
       st.integers(1, 4), st.integers(1, 6), st.randoms(use_true_random=False))
def test_chunks_taken_as_they_finish_wait_within_the_bound(shapes, batch_size, chunk, in_flight, rng):
    """A loader that keeps ``in_flight`` (k) lists out and hands each over the moment it
    is done, in any order (``in_order=False``; it sends the next list before handing one
    over): the batches are the plan's, and regroup holds at most (k + 1)(P - 1) decoded
    chunks of a batch's P, with those in flight at most k + 1 batches' worth, and none
    at the end."""
    sampler = _Planned(shapes, batch_size, chunk)
    parts = -(-batch_size // sampler.chunk_size)
    lists, out, got = iter(sampler), [], []
    joiner = BatchJoiner(sampler.chunk_batch)

    def send() -> None:
        while len(out) < in_flight and (nxt := next(lists, None)) is not None:
            out.append(nxt)

    send()
    while out:
        done = out.pop(rng.randrange(len(out)))
        send()
        decoded = ImageBatch([], tuple(BadImage(str(i), str(i), "x", i) for i in done), first=done[0])
        got += joiner.add(decoded)
        assert joiner.held <= (in_flight + 1) * (parts - 1)
        assert joiner.held + len(out) <= (in_flight + 1) * parts
    assert not joiner.waiting and joiner.held == 0
    want = _batches(_Planned(shapes, batch_size, chunk))
    assert sorted([b.index for b in batch.bad] for batch in got) == sorted(want)


def test_default_chunks_and_a_bad_batch_size(tmp_path):
    files = [(str(i), str(tmp_path / f"{i}.png")) for i in range(12)]
    assert ShapeBatchSampler(files, SHORT, 16).chunk_size == 4  # a quarter batch of whole pictures
    assert ShapeBatchSampler(files, Preprocessing("fit", SIZE), 16).chunk_size == 16
    assert ShapeBatchSampler(files, SHORT, 2).chunk_size == 1
    fit = ShapeBatchSampler(files, Preprocessing("fit", SIZE), 6)
    assert [(c, fit.chunk_batch(c[0])) for c in fit] == [(list(range(6)), (0, 0, 1)),
                                                         (list(range(6, 12)), (1, 0, 1))]
    odd = _Planned([(4, 6)] * 6, 6)
    assert [(len(c), odd.chunk_batch(c[0])) for c in odd] == [(1, (0, part, 6)) for part in range(6)]
    with pytest.raises(ValueError, match="batch_size=0: must be at least 1"):
        ShapeBatchSampler(files, SHORT, 0)


def test_the_shapes_are_the_model_inputs_height_then_width(tmp_path):
    sizes = image_tree(tmp_path)
    files = [(rel, str(tmp_path / rel)) for rel in sizes]
    got = drain(ShapeBatchSampler(files, SHORT, 4).shapes())
    assert got == [SHORT.model_size(*size)[::-1] for size in sizes.values()]
    assert any(h != w for h, w in got)


def _dies_on_the_killer(parent: int, chunk):
    """A header reader that dies on a file named killer.png (this process reads it)."""
    if os.getpid() != parent and any(p.endswith("killer.png") for p in chunk):
        os._exit(9)
    return [header_size(p) for p in chunk]


def test_a_reader_that_dies_mid_stream_leaves_its_chunks_to_this_process(tmp_path, monkeypatch):
    """A hostile file can take a header reader down while its chunk is read: that chunk
    and the ones after are read here, and the sizes are those of a plain read."""
    from embedingest.sources import shape_batches

    sizes = image_tree(tmp_path)
    paths = [str(tmp_path / rel) for rel in sizes] * 2
    paths.insert(len(paths) // 2, str(tmp_path / "killer.png"))
    want = [header_size(p) for p in paths]
    monkeypatch.setattr(shape_batches, "_read_chunk", functools.partial(_dies_on_the_killer, os.getpid()))
    with HeaderReaders(1, chunksize=2) as read:
        stream = read(paths)
        assert stream._futures, "submitted to the reader, which then dies"
        assert drain(stream) == want


def test_fit_reads_no_header_and_keeps_the_order(tmp_path):
    files = [(f"{i}", str(tmp_path / f"missing{i}.jpg")) for i in range(10)]
    sampler = ShapeBatchSampler(files, Preprocessing("fit", SIZE), 4)
    assert list(sampler) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_loader_batches_are_full_across_the_run(tmp_path):
    """Three aspect ratios in turn, 7 images each, batch 3: the DataLoader (two workers,
    chunks of one image) and regroup make exactly ceil(7/3) = 3 batches of each shape
    (where grouping within loader batches made 21 of one image)."""
    files, ratio_of = [], {}
    for i in range(21):
        w, h = [(90, 60), (60, 90), (80, 80)][i % 3]
        path = tmp_path / f"{i}.png"
        Image.fromarray(noise(h, w, seed=i)).save(path)
        files.append((f"{i}.png", str(path)))
        ratio_of[f"{i}.png"] = (w, h)
    sampler = ShapeBatchSampler(files, SHORT, 3)
    loader = DataLoader(ImageFileDataset(files, SHORT), batch_sampler=sampler, num_workers=2, in_order=False,
                        collate_fn=functools.partial(collate_images, resize="short"))
    sizes = Counter()
    for batch in regroup(iter(loader), sampler.chunk_batch):
        assert len({hw for _, _, hw in batch.groups}) == 1
        assert len({ratio_of[m.rel_path] for m in batch.items}) == 1
        sizes[len(batch)] += 1
    assert sizes == {3: 6, 1: 3}
    assert np.sum(list(sizes.elements())) == 21


def test_header_readers_give_the_sizes_in_order_and_survive_a_dead_reader(tmp_path, monkeypatch):
    sizes = image_tree(tmp_path)
    paths = [str(tmp_path / rel) for rel in sizes] * 3 + [str(tmp_path / "missing.png")]
    want = [header_size(p) for p in paths]
    with HeaderReaders(2, chunksize=2) as read:
        assert drain(read(paths)) == want
        stream = read(paths)
        got, deadline = stream.next(), time.monotonic() + 30
        while not stream.finished and time.monotonic() < deadline:
            got += stream.ready()  # read ahead in the background: no next() needed
            time.sleep(0.01)
        assert got == want and stream.next() is None
        assert sorted(map(sorted, ShapeBatchSampler([(p, p) for p in paths], SHORT, 4, read_sizes=read))) == \
            sorted(map(sorted, ShapeBatchSampler([(p, p) for p in paths], SHORT, 4)))
    with HeaderReaders(1, chunksize=1, initializer=functools.partial(os._exit, 3)) as read:  # each reader dies
        assert drain(read(paths)) == want
        assert read._pool._broken, "the readers ran the initializer, and died of it"
    assert drain(HeaderReaders(1)(paths)) == want  # not started: read here
    assert HeaderReaders(0).start()._pool is None  # no processes asked: none started


def test_headers_read_ahead_are_the_first_iteration_s_and_read_once(tmp_path):
    """read_ahead() asks for the headers before a DataLoader forks its workers; the first
    iteration plans from that stream (no second read), a later one reads anew."""
    sizes = image_tree(tmp_path)
    files = [(rel, str(tmp_path / rel)) for rel in sizes] * 2
    asked = []

    def read(paths):
        asked.append(len(paths))
        return SizeStream(paths)

    sampler = ShapeBatchSampler(files, SHORT, 3, read_sizes=read)
    assert sampler.read_ahead() is sampler and sampler.read_ahead() is sampler and asked == [len(files)]
    planned = sorted(map(sorted, sampler))
    assert asked == [len(files)] and planned == sorted(map(sorted, ShapeBatchSampler(files, SHORT, 3)))
    assert sorted(map(sorted, sampler)) == planned and asked == [len(files)] * 2


def test_header_readers_start_as_many_processes_as_asked_and_stop_them():
    with HeaderReaders(3) as read:  # not the machine's CPU count (a pool's default) on CI
        processes = list(read._pool._processes.values())
        assert len(processes) == 3 and all(p.is_alive() for p in processes)
    assert read._pool is None
    deadline = time.monotonic() + 30
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in processes)


def drain(stream) -> list:
    out = []
    while True:
        out += stream.ready()
        got = stream.next()
        if got is None:
            assert stream.finished
            return out
        out += got


def test_readers_fork_with_the_parents_objects_frozen():
    """A reader forked from a process that used CUDA (a library caller's second job) must
    never collect the parent's objects: a CUDA tensor freed there aborts the reader
    (seen on the H200 as "terminate called ... initialization error"). Forked with the
    collector frozen, the parent's objects sit in the reader's permanent generation."""
    import gc
    import multiprocessing

    assert gc.get_freeze_count() == 0
    with HeaderReaders(1, multiprocessing.get_context("fork")) as read:
        frozen = read._pool.submit(gc.get_freeze_count).result()
    assert frozen > 1000  # every object of this test process
    assert gc.get_freeze_count() == 0  # the parent's collector runs as before
