"""Where the segment job's main thread spends its time: the bench's timed job (after its
warm-up, in the same process) sampled by py-spy (without pausing it; --native: native frames too, pausing it at each sample; idle samples kept), with
the job's Chrome trace beside it, then the main thread's samples summed by step.

    python benchmarks/segment_host_samples.py --photos 8192 --photo-dir /tmp/photos \\
        --py-spy /tmp/pyspy/bin/py-spy --out /tmp/samples

Writes OUT/samples.speedscope.json (py-spy's samples), OUT/trace.json, OUT/summary.json and prints
the main thread's share of samples in each step of the loop.
"""
import argparse
import collections
import ctypes
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from embedingest.bench.segment_photos import PhotoBenchConfig, warmed_job
from embedingest.jobs.segment import segment

# (label, a frame name that marks it), first match from the innermost frame outwards
STEPS = [("masks", "image_masks"), ("model input (send)", "model_input"), ("logits", "logits"),
         ("parts", "_parts"), ("submit", "submit"), ("regroup / loader next", "regroup"),
         ("prefetch", "prefetch"), ("done", "done"), ("run_batches other", "run_batches"),
         ("_model_and_engine", "_model_and_engine"), ("_decoders", "_decoders"),
         ("list_inputs", "list_inputs"), ("segment other", "segment")]


def allow_ptrace() -> None:
    """Let a child (py-spy) attach to this process under Yama's ptrace_scope 1."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)


def summarise(speedscope: Path, rate: int, windows: int = 12) -> dict:
    """The main thread's samples (in time order, one per 1/rate s with idle ones kept) by
    step: over the whole job and in ``windows`` equal stretches of it."""
    doc = json.loads(speedscope.read_text())
    frames = [f["name"] for f in doc["shared"]["frames"]]
    main = next(p for p in doc["profiles"] if "MainThread" in p["name"])
    files = [f.get("file") or "" for f in doc["shared"]["frames"]]
    labels, python = [], []
    leaves: collections.Counter = collections.Counter()
    for stack in main["samples"]:  # one per sampling interval (idle ones kept)
        names = [frames[i] for i in stack]
        if not labels and "segment" not in names:
            continue  # before the job
        label = next((lab for lab, mark in STEPS for f in reversed(names) if f == mark), "other")
        labels.append(label)
        inner = [i for i in stack if files[i].endswith(".py")][-2:]
        python.append(" < ".join(f"{frames[i]} ({Path(files[i]).name}:{doc['shared']['frames'][i].get('line')})"
                                 for i in reversed(inner)))
        leaves[(label, ";".join(names[-5:]))] += 1
    total = len(labels)
    slice_n = max(1, rate // 10)  # the first 3 s in tenths: the innermost Python frames
    start = [collections.Counter(python[i:i + slice_n]).most_common(2) for i in range(0, min(total, 3 * rate), slice_n)]
    per = max(1, -(-total // windows))
    stretches = [dict(collections.Counter(labels[i:i + per]).most_common()) for i in range(0, total, per)]
    return {"main_samples": total, "sample_s": 1 / rate,
            "steps": {k: round(v / max(total, 1), 4) for k, v in collections.Counter(labels).most_common()},
            "stretches": stretches, "first_3s_by_tenth": start,
            "top_python": [[f, round(n / max(total, 1), 4)] for f, n in collections.Counter(python).most_common(40)],
            "top_leaves": [[lab, leaf, round(n / max(total, 1), 4)] for (lab, leaf), n in leaves.most_common(60)]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--photos", type=int, default=8192)
    ap.add_argument("--photo-dir", default="/tmp/photos")
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--rate", type=int, default=200)
    ap.add_argument("--out", required=True)
    ap.add_argument("--native", action="store_true", help="native frames too (pauses the job at each sample)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        job, _ = warmed_job(PhotoBenchConfig(photos=args.photos), Path(args.photo_dir), Path(tmp))
        allow_ptrace()
        raw = out / "samples.speedscope.json"
        spy = subprocess.Popen([args.py_spy, "record", "--pid", str(os.getpid()), "--rate", str(args.rate),
                                "--idle", "--threads", "--format", "speedscope", "--output", str(raw)]
                               + (["--native"] if args.native else ["--nonblocking"]))
        time.sleep(2.0)  # py-spy attaches
        t0 = time.perf_counter()
        summary = segment(job, progress=False, trace=str(out / "trace.json"))
        seconds = time.perf_counter() - t0
        time.sleep(0.5)
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    result = {"seconds": seconds, "summary": {k: summary[k] for k in ("timing", "phases", "engine", "written")},
              **summarise(raw, args.rate)}
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("seconds", "main_samples", "steps", "stretches")}))
    for i, tenth in enumerate(result["first_3s_by_tenth"]):
        print(f"{i / 10:.1f} s", tenth)
    for row in result["top_python"]:
        print(row)
