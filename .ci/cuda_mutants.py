"""Mutation testing of the engine's CUDA copy path by hand, on the lent GPU machine.

mutmut does not run there (nothing can be installed from a registry), so each edit below
is applied to ``embedingest/engine/copy_paths.py`` in turn, the GPU engine tests run
(``-x``: the first failure kills the mutant), and the file is restored. A mutant whose
tests all pass survives and is judged in docs/TESTING.md.

    . .ci/device_env.sh && python3 .ci/cuda_mutants.py [--out FILE.jsonl] [--edits A,B] [TESTS...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODULE = Path(__file__).resolve().parents[1] / "embedingest" / "engine" / "copy_paths.py"
TESTS = ["tests/engine/test_egress_cuda.py", "tests/engine/test_gpu_monitor.py"]

# (name, text in CudaCopyPath, replacement)
EDITS = [
    ("pins False", "    pins = True\n", "    pins = False\n"),
    ("copy stream does not wait for compute", "        self._stream.wait_event(end)\n", ""),
    ("copies on the compute stream", "self._stream = torch.cuda.Stream(device=dev)",
     "self._stream = torch.cuda.current_stream(dev)"),
    ("device tensors not kept until the copy ends", "pending.keep = [t for _, t in items]",
     "pending.keep = []"),
    ("wait does not synchronize", "        pending.done_event.synchronize()\n", ""),
    ("bfloat16 slots not viewed as bfloat16", 'if f.source_dtype == "bfloat16":',
     'if f.source_dtype == "float16":'),
    ("event times in wrong units", "self._ref_event.elapsed_time(ev) / 1e3",
     "self._ref_event.elapsed_time(ev) / 1e6"),
    ("compute end taken at the copy", "        end = self._compute_end  # the engine's submit marks it before every copy\n",
     "        end = torch.cuda.Event(enable_timing=True)\n"
     "        end.record(torch.cuda.current_stream(self.device))\n"),
    ("compute end recorded as compute start", "rec.compute_end = self._host_time(compute_end)",
     "rec.compute_end = self._host_time(compute_start)"),
    ("device index check inverted", "if t.device.index != self._device_index:",
     "if t.device.index == self._device_index:"),
    ("no NVML sampler", "self.sampler = UtilizationSampler(dev).start()", "self.sampler = None"),
    ("stop does not wait for the egress stream",
     "        if self._stream is not None:\n            self._stream.synchronize()\n", ""),
    ("host tensors kept after release", "        self._host_tensors = []\n", "        pass\n"),
    ("bytes of the device copies not counted", "nbytes += t.numel() * t.element_size()",
     "nbytes += 0"),
    ("copy blocking the host", "copy_(t, non_blocking=True)", "copy_(t, non_blocking=False)"),
    ("spans read before their events end", "if pool_open and a.query() and b.query():",
     "if pool_open:"),
]


def run_tests(tests: list[str], timeout: float) -> tuple[str, float, str]:
    t0 = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                              "-m", "needs_cuda", *tests], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0, ""
    last = (run.stdout.strip().splitlines() or [""])[-1]
    failed = [ln for ln in run.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return ("survived" if run.returncode == 0 else "killed"), time.monotonic() - t0, \
        (failed[0] if failed else last)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("cuda_mutants.jsonl"))
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--edits", default="", help="comma-separated edit names (default: all)")
    parser.add_argument("tests", nargs="*", default=TESTS)
    args = parser.parse_args()
    chosen = [e for e in EDITS if not args.edits or e[0] in args.edits.split(",")]
    original = MODULE.read_text()
    for _, old, _ in EDITS:
        assert original.count(old) == 1, f"edit text not found once: {old!r}"
    outcome, seconds, detail = run_tests(args.tests, args.timeout)
    rows = [{"edit": "none (baseline)", "outcome": outcome, "seconds": round(seconds, 1), "detail": detail}]
    print(json.dumps(rows[-1]), flush=True)
    if outcome != "survived":
        print("the unchanged module fails its tests: stop", file=sys.stderr)
        return 1
    with args.out.open("w") as out:
        out.write(json.dumps(rows[-1]) + "\n")
        for name, old, new in chosen:
            MODULE.write_text(original.replace(old, new))
            try:
                outcome, seconds, detail = run_tests(args.tests, args.timeout)
            finally:
                MODULE.write_text(original)
            row = {"edit": name, "outcome": outcome, "seconds": round(seconds, 1), "detail": detail}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
