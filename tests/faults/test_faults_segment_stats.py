"""segment --stats under SIGKILL: a killed run loses only rows not yet committed, every
committed row has its mask, and the re-run leaves exactly one row per image."""

from __future__ import annotations

import json
import os
import signal

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from fault_helpers import wait_for

from .test_faults_segment import (SLOW_SINK, check_all_masks, check_masks_whole, make_images,
                                  mask_path, masks_on_disk, seg_args)


def rows(out) -> list[str]:
    if not (out / "stats").exists():
        return []
    return pads.dataset(out / "stats").to_table(columns=["source"]).column("source").to_pylist()


@pytest.mark.parametrize("victim", ["main", "consumer"])
def test_killed_run_loses_only_uncommitted_rows_and_rerun_has_each_once(cli, tmp_path, victim):
    images = tmp_path / "images"
    sizes = make_images(images, n=24, seed=4)
    out = tmp_path / "masks"
    stats = ["--stats", "--stats-commit-seconds", "0.3"]
    run = cli("segment", images, "--out", out, *seg_args(), *stats, env=SLOW_SINK)
    wait_for(lambda: (len(masks_on_disk(out)) >= 8 and rows(out)) or not run.running(), 120,
             what="eight masks and a committed part")
    assert run.running(), run.describe()
    pid = run.pid if victim == "main" else min(run.consumers())
    os.kill(pid, signal.SIGKILL)
    run.wait()
    if run.running():
        run.kill_all()
    run.assert_no_leftovers()
    committed = rows(out)
    assert len(committed) == len(set(committed)), "no row twice"
    for source in committed:  # a committed row always has its mask
        assert mask_path(out, source).is_file(), source
    masks = check_masks_whole(out, sizes)
    assert 0 < len(committed) <= masks < len(sizes)

    run = cli("segment", images, "--out", out, *seg_args(), *stats, "--json")
    assert run.wait() == 0, run.describe()
    summary = json.loads(run.stdout)
    assert summary["written"] == len(sizes) - len(committed), "images without a row are redone"
    check_all_masks(out, sizes)  # no temporary file left either, in stats/ too
    assert sorted(rows(out)) == sorted(sizes), "every image exactly once"
    for part in (out / "stats").glob("part-*.parquet"):
        assert pq.read_metadata(part).num_rows > 0
