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


def meta(pid: int, tid: int | None, kind: str, name: str) -> list[dict]:
    """A track's (or, with no ``tid``, a process's) name, and a track's place: its tid."""
    if tid is None:
        return [{"ph": "M", "pid": pid, "name": kind, "args": {"name": name}}]
    return [{"ph": "M", "pid": pid, "tid": tid, "name": kind, "args": {"name": name}},
            {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}}]


def engine_tracks(pid: int, name: str) -> list[dict]:
    return (meta(pid, None, "process_name", name) + meta(pid, 1, "thread_name", "compute")
            + meta(pid, 2, "thread_name", "d2h copy") + meta(pid, 3, "thread_name", "hand-off"))


def test_engine_events_of_records_made_by_hand():
    """Every event of three batches and three stage spans, exactly: times in µs rounded to
    the nanosecond (the third span, 1000003.0004 to 1000004.2344 µs, starts at 1000003.0 and
    lasts 1.234); a batch with its compute and copy marked, with all its consumer's
    times; one with only the compute's end and no copy marks (its copy is the slot's
    wait until ready) that no consumer took; one without compute whose slot came back
    unrecorded. A stage's track is made once, at its first span; consumers' tracks
    follow the batches, in worker order."""
    from embedingest.engine.telemetry import BatchRecord
    from embedingest.engine.trace import engine_events

    marked = BatchRecord(seq=3, slot=1, nbytes=64, submit_t=1.00001, slot_t=1.00001, ready_t=1.000013,
                         sink_start_t=1.00002, sink_end_t=1.00003, freed_t=1.000031, worker=1,
                         compute_start=1.000005, compute_end=1.000008, copy_start=1.000009, copy_end=1.000012)
    unmarked = BatchRecord(seq=4, slot=0, nbytes=32, submit_t=1.000015, slot_t=1.000015, ready_t=1.000017,
                           compute_end=1.000014)
    no_compute = BatchRecord(seq=5, slot=2, nbytes=16, submit_t=1.00002, slot_t=1.00002, ready_t=1.000023,
                             sink_start_t=1.000025, sink_end_t=1.000026, worker=0, copy_start=1.000021,
                             copy_end=1.000022)
    spans = [("h2d", 1.0, 1.0000015), ("tokenize", 1.000001, 1.000002), ("h2d", 1.0000030004, 1.0000042344)]
    events = engine_events([no_compute, marked, unmarked], spans)

    def flow(ph, tid, seq, ts):
        return {"ph": ph, "pid": 1, "tid": tid, "name": "batch", "cat": "batch", "id": 1000000000 + seq,
                "ts": ts, "bp": "e"}

    a3, a4, a5 = ({"batch": 3, "slot": 1, "bytes": 64}, {"batch": 4, "slot": 0, "bytes": 32},
                  {"batch": 5, "slot": 2, "bytes": 16})
    assert events == engine_tracks(1, "engine") + meta(1, 10, "thread_name", "h2d") + [
        {"ph": "X", "pid": 1, "tid": 10, "name": "h2d", "cat": "stage", "ts": 1000000.0, "dur": 1.5},
    ] + meta(1, 11, "thread_name", "tokenize") + [
        {"ph": "X", "pid": 1, "tid": 11, "name": "tokenize", "cat": "stage", "ts": 1000001.0, "dur": 1.0},
        {"ph": "X", "pid": 1, "tid": 10, "name": "h2d", "cat": "stage", "ts": 1000003.0, "dur": 1.234},
        # batch 3
        {"ph": "X", "pid": 1, "tid": 1, "name": "compute 3", "cat": "compute", "ts": 1000005.0, "dur": 3.0,
         "args": a3},
        {"ph": "X", "pid": 1, "tid": 2, "name": "copy 3", "cat": "copy", "ts": 1000009.0, "dur": 3.0, "args": a3},
        {"ph": "b", "pid": 1, "tid": 3, "name": "hand-off", "cat": "hand-off", "id": "1-3", "ts": 1000012.0,
         "args": a3},
        {"ph": "e", "pid": 1, "tid": 3, "name": "hand-off", "cat": "hand-off", "id": "1-3", "ts": 1000020.0,
         "args": {}},
        {"ph": "X", "pid": 1, "tid": 101, "name": "sink 3", "cat": "consumer", "ts": 1000020.0, "dur": 10.0,
         "args": {"batch": 3, "slot": 1, "bytes": 64, "worker": 1, "slot_back_ts": 1000031.0}},
        flow("s", 1, 3, 1000005.0), flow("t", 2, 3, 1000009.0), flow("f", 101, 3, 1000020.0),
        # batch 4
        {"ph": "X", "pid": 1, "tid": 1, "name": "compute 4", "cat": "compute", "ts": 1000014.0, "dur": 0.0,
         "args": a4},
        {"ph": "X", "pid": 1, "tid": 2, "name": "copy 4", "cat": "copy", "ts": 1000015.0, "dur": 2.0, "args": a4},
        flow("s", 1, 4, 1000014.0), flow("f", 2, 4, 1000015.0),
        # batch 5
        {"ph": "X", "pid": 1, "tid": 2, "name": "copy 5", "cat": "copy", "ts": 1000021.0, "dur": 1.0, "args": a5},
        {"ph": "b", "pid": 1, "tid": 3, "name": "hand-off", "cat": "hand-off", "id": "1-5", "ts": 1000022.0,
         "args": a5},
        {"ph": "e", "pid": 1, "tid": 3, "name": "hand-off", "cat": "hand-off", "id": "1-5", "ts": 1000025.0,
         "args": {}},
        {"ph": "X", "pid": 1, "tid": 100, "name": "sink 5", "cat": "consumer", "ts": 1000025.0, "dur": 1.0,
         "args": {"batch": 5, "slot": 2, "bytes": 16, "worker": 0}},
        flow("s", 2, 5, 1000021.0), flow("f", 100, 5, 1000025.0),
    ] + meta(1, 100, "thread_name", "consumer 0") + meta(1, 101, "thread_name", "consumer 1")


def test_a_trace_of_two_engines_and_the_job_s_phases(tmp_path):
    """The file, exactly: compact JSON; the phases as process 0; each engine a process of
    its own, numbered from 1 and named after it; times from the earliest start (here the
    first phase's), so the same instant has the same time on every track."""
    from types import SimpleNamespace

    from embedingest.engine.telemetry import BatchRecord

    cpu = SimpleNamespace(records=[], spans=[("h2d", 1.0, 1.25)])
    rec = BatchRecord(seq=0, slot=0, nbytes=8, submit_t=1.5, slot_t=1.5, ready_t=1.625, compute_start=1.25,
                      compute_end=1.375)
    cuda = SimpleNamespace(records=[rec], spans=[("h2d", 1.75, 2.0)])
    path = write_trace(str(tmp_path / "t.json"), [("cpu", cpu), ("cuda:1", cuda)],
                       phases=[("job", 0.5, 3.0), ("encode", 1.0, 2.0)], title="a job")
    assert path == tmp_path / "t.json"
    events = meta(0, None, "process_name", "a job") + meta(0, 0, "thread_name", "phases") + [
        {"ph": "X", "pid": 0, "tid": 0, "name": "job", "cat": "phase", "ts": 0.0, "dur": 2500000.0},
        {"ph": "X", "pid": 0, "tid": 0, "name": "encode", "cat": "phase", "ts": 500000.0, "dur": 1000000.0},
    ] + engine_tracks(1, "engine cpu") + meta(1, 10, "thread_name", "h2d") + [
        {"ph": "X", "pid": 1, "tid": 10, "name": "h2d", "cat": "stage", "ts": 500000.0, "dur": 250000.0},
    ] + engine_tracks(2, "engine cuda:1") + meta(2, 10, "thread_name", "h2d") + [
        {"ph": "X", "pid": 2, "tid": 10, "name": "h2d", "cat": "stage", "ts": 1250000.0, "dur": 250000.0},
        {"ph": "X", "pid": 2, "tid": 1, "name": "compute 0", "cat": "compute", "ts": 750000.0, "dur": 125000.0,
         "args": {"batch": 0, "slot": 0, "bytes": 8}},
        {"ph": "X", "pid": 2, "tid": 2, "name": "copy 0", "cat": "copy", "ts": 1000000.0, "dur": 125000.0,
         "args": {"batch": 0, "slot": 0, "bytes": 8}},
        {"ph": "s", "pid": 2, "tid": 1, "name": "batch", "cat": "batch", "id": 2000000000, "ts": 750000.0, "bp": "e"},
        {"ph": "f", "pid": 2, "tid": 2, "name": "batch", "cat": "batch", "id": 2000000000, "ts": 1000000.0,
         "bp": "e"},
    ]
    data = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": "a job"}}
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == data
    assert text == json.dumps(json.loads(text), separators=(",", ":"))  # compact: no spaces


def test_without_phases_the_trace_starts_at_the_first_compute(tmp_path):
    """A compute marked before its batch's slot was taken (the model runs first) is the
    trace's time zero; a batch without a compute mark adds no start; the default title."""
    from types import SimpleNamespace

    from embedingest.engine.telemetry import BatchRecord

    recs = [BatchRecord(seq=0, slot=0, nbytes=8, submit_t=2.0, slot_t=2.0, ready_t=2.5, compute_start=1.0,
                        compute_end=1.5),
            BatchRecord(seq=1, slot=1, nbytes=8, submit_t=3.0, slot_t=3.0, ready_t=3.5)]
    path = write_trace(tmp_path / "t.json", [("cpu", SimpleNamespace(records=recs, spans=[("h2d", 1.25, 1.5)]))])
    data = json.loads(path.read_text())
    assert data["otherData"] == {"title": "embedingest"}
    assert [(e["name"], e["ts"], e["dur"]) for e in data["traceEvents"] if e["ph"] == "X"] == [
        ("h2d", 250000.0, 250000.0), ("compute 0", 0.0, 500000.0), ("copy 0", 1000000.0, 500000.0),
        ("copy 1", 2000000.0, 500000.0)]


def test_a_trace_with_nothing_timed_names_its_tracks_only(tmp_path):
    from types import SimpleNamespace

    path = write_trace(tmp_path / "t.json", [("cpu", SimpleNamespace(records=[], spans=[]))])
    assert json.loads(path.read_text()) == {"traceEvents": engine_tracks(1, "engine cpu"), "displayTimeUnit": "ms",
                                            "otherData": {"title": "embedingest"}}
