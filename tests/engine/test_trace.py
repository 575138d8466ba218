"""Chrome trace files from real CPU runs, read back with the json module: the events'
order per batch, their nesting per track, and the tracks they are on."""

from __future__ import annotations

import json
import time
from collections import defaultdict

import numpy as np
import pytest
from click.testing import CliRunner
from engine_sinks import HashSinkFactory

from embedingest import EgressEngine
from embedingest.cli import main
from embedingest.engine.trace import phase_spans, write_trace


def tracks(events: list[dict]) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name"}


def assert_nested(events: list[dict]) -> None:
    """Complete events of one track either nest or follow each other, as the format needs."""
    by_track = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
            by_track[e["pid"], e["tid"]].append((e["ts"], -e["dur"], e))
    for track, items in by_track.items():
        open_ends = []
        for ts, neg_dur, e in sorted(items, key=lambda x: (x[0], x[1])):
            while open_ends and open_ends[-1] <= ts + 1e-3:
                open_ends.pop()
            end = ts - neg_dur
            assert not open_ends or end <= open_ends[-1] + 1e-3, f"{e['name']} overlaps on {track}"
            open_ends.append(end)


def batches(events: list[dict], pid: int) -> dict[int, dict]:
    """Per batch: its compute, copy, hand-off (begin, end) and consumer events."""
    out = defaultdict(dict)
    names = tracks(events)
    for e in events:
        if e.get("pid") != pid or e["ph"] not in ("X", "b", "e"):
            continue
        cat = e["cat"]
        if cat == "hand-off":
            seq = int(e["id"].split("-")[1])
            out[seq]["handoff_" + e["ph"]] = e["ts"]
        elif cat in ("compute", "copy", "consumer"):
            out[e["args"]["batch"]][cat] = e
            out[e["args"]["batch"]][cat + "_track"] = names[pid, e["tid"]]
    return out


def assert_batch_order(per_batch: dict[int, dict], workers: int) -> None:
    for seq, b in per_batch.items():
        compute, copy, sink = b["compute"], b["copy"], b["consumer"]
        assert b["compute_track"] == "compute" and b["copy_track"] == "d2h copy"
        assert b["consumer_track"] == f"consumer {sink['args']['worker']}"
        assert 0 <= sink["args"]["worker"] < workers
        assert compute["ts"] + compute["dur"] <= copy["ts"] + 1e-3, seq
        assert copy["ts"] + copy["dur"] <= b["handoff_b"] + 1e-3, seq
        assert b["handoff_b"] <= b["handoff_e"] <= sink["ts"] + 1e-3, seq
        assert sink["dur"] > 0
        assert sink["args"]["slot_back_ts"] >= sink["ts"] + sink["dur"] - 1e-3, seq  # freed after


def test_engine_run_as_a_chrome_trace(tmp_path, no_leaks):
    with EgressEngine(HashSinkFactory(delays=(0.004, 0.008)), num_consumers=2, num_slots=3,
                      device="cpu") as engine:
        for i in range(10):
            with engine.span("h2d"):
                time.sleep(0.001)
            engine.mark_compute_start()
            time.sleep(0.002)  # the "model"
            engine.submit(i, {"x": np.full((4, 4), i, np.float32)})
    st = engine.stats
    t_start, t_end = st.spans[0][1] - 0.01, max(r.sink_end_t for r in st.records) + 0.01
    path = write_trace(tmp_path / "run.json", [("cpu", st)],
                       phases=[("job", t_start, t_end), ("work", t_start + 0.005, t_end - 0.005)])
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    assert data["displayTimeUnit"] == "ms"
    assert_nested(events)
    per_batch = batches(events, pid=1)
    assert sorted(per_batch) == list(range(10))
    assert_batch_order(per_batch, workers=2)
    assert all(b["compute"]["dur"] >= 1500 for b in per_batch.values())  # µs: the 2 ms sleeps
    names = tracks(events)
    assert {names[1, t] for t in (1, 2, 3)} == {"compute", "d2h copy", "hand-off"}
    assert {"h2d", "consumer 0", "consumer 1", "phases"} <= set(names.values())
    # a flow per batch: starts on the compute track, ends on its consumer's track
    flows = defaultdict(list)
    for e in events:
        if e["ph"] in ("s", "t", "f"):
            flows[e["id"]].append(e)
    assert len(flows) == 10
    for chain in flows.values():
        assert [e["ph"] for e in chain] == ["s", "t", "f"]
        assert [e["ts"] for e in chain] == sorted(e["ts"] for e in chain)
    job, work = (e for e in events if e.get("cat") == "phase")
    assert job["ts"] == 0 and work["ts"] > job["ts"] and work["ts"] + work["dur"] < job["ts"] + job["dur"]


def test_phase_spans_are_consecutive_inside_the_run():
    spans = phase_spans("build-index", 100.0, {"load_model_s": 2.0, "plan_s": 0.5, "encode_s": 3.0})
    assert spans == [("build-index", 100.0, 105.5), ("load model", 100.0, 102.0),
                     ("plan", 102.0, 102.5), ("encode", 102.5, 105.5)]


def test_build_index_trace(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(" ".join(f"Sentence {j} of file {i} about rivers." for j in range(30)))
    out, trace = tmp_path / "idx", tmp_path / "build.json"
    r = CliRunner().invoke(main, ["build-index", str(corpus), "--out", str(out), "--num-workers", "1",
                                  "--num-consumers", "2", "--batch-size", "4", "--chunk-tokens", "32",
                                  "--overlap", "4", "--trace", str(trace), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    events = json.loads(trace.read_text())["traceEvents"]
    assert_nested(events)
    phases = [e for e in events if e.get("cat") == "phase"]
    assert [p["name"] for p in phases] == ["build-index", "plan", "load model", "train", "encode", "finish"]
    run, encode = phases[0], phases[4]
    for p in phases[1:]:
        assert run["ts"] <= p["ts"] and p["ts"] + p["dur"] <= run["ts"] + run["dur"] + 1
    per_batch = batches(events, pid=1)
    assert len(per_batch) == summary["engine"]["batches"] > 3
    assert_batch_order(per_batch, workers=2)
    for b in per_batch.values():  # every batch's engine work lies inside the encode phase
        assert encode["ts"] <= b["copy"]["ts"] and b["consumer"]["ts"] <= encode["ts"] + encode["dur"]
    assert summary["trace"] == str(trace)


def test_segment_trace(tmp_path):
    from PIL import Image
    from segment_fixtures import noise, random_weights_file

    from embedingest.cli.segment import segment_command

    weights = random_weights_file(tmp_path / "small.pth", arch="deeplabv3_mobilenet_v3_large")
    images = tmp_path / "in"
    images.mkdir()
    for i in range(6):
        Image.fromarray(noise(24, 32, seed=i)).save(images / f"{i}.png")
    trace = tmp_path / "segment.json"
    args = [str(images), "--out", str(tmp_path / "o"), "--weights", str(weights), "--arch",
            "deeplabv3_mobilenet_v3_large", "--size", "32", "--device", "cpu", "--num-workers", "0",
            "--num-consumers", "2", "--batch-size", "2", "--trace", str(trace), "--json"]
    r = CliRunner().invoke(segment_command, args)
    assert r.exit_code == 0, r.output
    events = json.loads(trace.read_text())["traceEvents"]
    assert_nested(events)
    per_batch = batches(events, pid=1)
    assert sorted(per_batch) == [0, 1, 2]
    assert_batch_order(per_batch, workers=2)
    (run,) = [e for e in events if e.get("cat") == "phase"]
    assert all(run["ts"] <= b["compute"]["ts"] and b["consumer"]["ts"] <= run["ts"] + run["dur"]
               for b in per_batch.values())
    two = [a for a in args[:-3] if a not in ("--device", "cpu")]
    r = CliRunner().invoke(segment_command, [*two, "--devices", "cpu,cpu", "--trace", str(trace)])
    assert r.exit_code == 1 and "--trace records one device" in r.output


@pytest.mark.slow
def test_bench_text_trace(tmp_path):
    trace = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "text", "--docs", "48", "--device", "cpu", "--batch-size", "16",
                                  "--num-workers", "0", "--num-consumers", "1", "--no-st-fp32",
                                  "--trace", str(trace)])
    assert r.exit_code == 0, r.output
    events = json.loads(trace.read_text())["traceEvents"]
    assert_nested(events)
    assert [e["name"] for e in events if e.get("cat") == "phase"][0] == "build-index"
    per_batch = batches(events, pid=1)
    assert len(per_batch) == 3  # 48 paragraphs in batches of 16
    assert_batch_order(per_batch, workers=1)
