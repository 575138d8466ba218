"""Where the segment job's start goes: the job run twice in one process on a folder,
each step before its batch loop timed (seconds from the call's start, and how long),
printed as JSON lines with the job's own timing.

    python benchmarks/segment_start_spans.py IMAGES OUT WEIGHTS_FILE
"""
import time, sys, json, functools
from embedingest.jobs.segment import run as R, SegmentConfig, segment
from embedingest.engine import worker_loader, egress, pool
from embedingest.sources import shape_batches
from embedingest.stages import segmentation
spans = []
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spans.append((label, round(t - T0, 3), round(time.perf_counter() - t, 3)))
    setattr(obj, name, g)
wrap(worker_loader.WorkerLoader, "__iter__", "loader iter (fork workers)")
wrap(shape_batches.HeaderReaders, "start", "header readers start")
wrap(egress.EgressEngine, "start", "engine start")
wrap(egress.EgressEngine, "_open", "engine _open (pool)")
wrap(R, "load_segmentation_model", "load model")
wrap(R, "write_labels", "labels")
wrap(R, "Segmenter", "Segmenter (to device)")
wrap(R, "preset_preprocessing", "preset prep")
wrap(R, "_decoders", "decoders made")
wrap(R, "run_batches", "run_batches")
if hasattr(pool.HostPool, "ready"):  # the pool made in a thread (since 7badefc): the first batch's wait
    wrap(pool.HostPool, "ready", "pool ready (wait)")
wrap(pool.HostPool, "_register", "pool register (CUDA)")
if __name__ == "__main__":
    images, out, weights = sys.argv[1:4]
    for rep in range(2):
        spans.clear()
        T0 = time.perf_counter()
        s = segment(SegmentConfig(images=images, out=out, weights=weights, overwrite=True), progress=False)
        print(json.dumps({"seconds": s["seconds"], "timing": s["timing"], "spans": spans}))
