"""segment on several devices of one host: one process per device, each running the
single-device job (:func:`~.run.segment_on_device`) on its share of the images.

The parent lists the images (resume included) once and splits the ones still to do by
bytes. It never touches CUDA, so GPU processes are forked where that is safe (no
interpreter start and imports in each), and before any progress bar starts a thread.
Masks are one file per image, written by rename, so the children need no
coordination: they write into the same output folder, and the parent writes the one
skip report from what each child read. A run stopped at any point resumes like a
single-device run (an image with its mask is done).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

from ...report import SkipReport
from ...scaleout.devices import child_env, split_by_size
from ...scaleout.procs import BatchedProgress, DeviceJob, DeviceProcesses, start_method
from ...stages.device import resolve_device
from .run import segment_on_device


def segment_on_devices(devices: list[str], config, todo: list[tuple[str, str]],
                       report: SkipReport, progress: bool) -> dict:
    """Segment ``todo`` ((rel_path, path) pairs) on ``devices``; add the children's
    skipped images to ``report``; return the summary fields of the run."""
    from tqdm import tqdm

    sizes = []
    for _, path in todo:
        try:
            sizes.append(os.stat(path).st_size)
        except OSError:
            sizes.append(0)  # the child reports it when it reads it
    groups = [g for g in split_by_size(sizes, len(devices)) if g]
    used = devices[:len(groups)]
    child_config = dataclasses.replace(config, devices="")
    method = start_method(used)
    jobs, work = [], []
    for device, group in zip(used, groups):
        env, local = child_env(device)
        jobs.append(DeviceJob(device, (), env))
        work.append((local, child_config, [todo[i] for i in group], len(used), method))
    with DeviceProcesses(None, jobs, start_method=method) as procs, \
            tqdm(total=len(todo), unit="img", desc=f"segment x{len(used)}", dynamic_ncols=True,
                 disable=None if progress else True) as bar:  # None: only on a terminal
        results = procs.run(_segment_part, work, on_progress=lambda _, n: bar.update(n))
    for r in results:
        report.entries.extend(r["skipped"])
    first = results[0]["summary"]
    shapes: Counter = Counter()
    for r in results:
        for n, h, w, k in r["summary"]["batch_shapes"]:
            shapes[n, h, w] += k
    return {"written": sum(r["summary"]["written"] for r in results), "model": first["model"],
            "arch": first["arch"], "num_classes": first["num_classes"], "device": ",".join(used),
            "dtype": first["dtype"], "resize": first["resize"],
            "batch_shapes": [[n, h, w, k] for (n, h, w), k in sorted(shapes.items())],
            "decoders": sum(r["summary"]["decoders"] for r in results),
            **({"stats_rows": sum(r["summary"]["stats_rows"] for r in results)} if config.stats else {}),
            "engine": {"per_device": [r["summary"]["engine"] | {"device": d, "timing": r["summary"]["timing"],
                                                                "batch_shapes": r["summary"]["batch_shapes"],
                                                                "decoders": r["summary"]["decoders"]}
                                      for d, r in zip(used, results)]}}


def _segment_part(device: str, config, todo: list[tuple[str, str]], processes: int, method: str,
                  report_progress) -> dict:
    """The child: the single-device segment step on this process's images."""
    report = SkipReport()
    progress = BatchedProgress(report_progress)
    summary = segment_on_device(config, resolve_device(device), todo, report, on_images=progress.add,
                            processes=processes)
    progress.flush()
    summary["timing"] = {"start_method": method} | summary["timing"]
    return {"summary": summary, "skipped": report.entries}
