"""mutmut's own mutants of ``CudaCopyPath``, run on the lent GPU machine.

mutmut 3 writes every mutant of a module into one file, each function behind a
trampoline that calls the mutant named by ``MUTANT_UNDER_TEST``. mutmut does not install
on the GPU machine (nothing installs there from a registry), so this script takes the
file mutmut generated here (``mutants/embedingest/engine/copy_paths.py``, carried),
replaces mutmut's import by a trampoline of its own with the same rule, installs the
file over the module, and runs the GPU engine tests once for each ``CudaCopyPath``
mutant, each in a fresh process (``-x``: the first failure kills the mutant; a mutant
that runs past ``--timeout`` is killed too, as mutmut counts it). The next process is
started while the current one runs, so its imports cost nothing. The module is
restored at the end.

    python3 .ci/cuda_mutmut.py MUTATED.py --out FILE.jsonl [--only NAME,...] [TESTS...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "embedingest" / "engine" / "copy_paths.py"
PACKAGE = "embedingest.engine.copy_paths"
# The quick checks of what reaches the host first, the timings and NVML's after: ``-x``
# stops at the first failure, so most mutants end in seconds.
_E = "tests/engine/test_egress_cuda.py::"
TESTS = [_E + t for t in (
    "test_gpu_result_equals_cpu_result", "test_bfloat16_and_channels_last_outputs",
    "test_pools_are_unregistered_between_runs", "test_release_lets_go_of_the_tensors_over_the_pool",
    "test_copy_waits_for_compute_and_memory_is_not_reused_early",
    "test_a_batch_s_copy_runs_beside_the_next_batch_s_work", "test_pool_is_really_pinned_and_fast",
    "test_submit_does_not_wait_for_the_gpu_and_times_are_the_gpu_s_on_the_host_clock",
    "test_a_wait_for_a_free_slot_is_not_counted_as_compute", "test_idle_fraction_is_measured_by_nvml",
    "test_an_engine_started_early_counts_the_gpu_idle_from_its_first_batch")] + [
    "tests/engine/test_gpu_monitor.py"]
MUTMUT_IMPORT = "from mutmut.mutation.trampoline import wrap_in_trampoline as _mutmut_mutated, MutantDict\n"
TRAMPOLINE = '''\
import functools as _mutmut_functools
import os as _mutmut_os

MutantDict = dict


def _mutmut_mutated(mutants_dict, is_classmethod=False):
    """mutmut's rule: the mutant named in MUTANT_UNDER_TEST if it is of this module."""
    def decorate(func):
        @_mutmut_functools.wraps(func)
        def trampoline(*args, **kwargs):
            module, _, name = _mutmut_os.environ.get("MUTANT_UNDER_TEST", "").rpartition(".")
            chosen = mutants_dict.get(name) if module == func.__module__ else None
            return (chosen or mutants_dict["_mutmut_orig"])(*args, **kwargs)
        return trampoline
    return decorate
'''

WORKER = r'''
import json, os, sys
import pytest, torch, numpy  # the imports, before the mutant is known
import embedingest.engine.copy_paths

class Failures:
    def __init__(self):
        self.failed = []
    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(report.nodeid + ": " + report.longreprtext[-400:])

name = sys.stdin.readline().strip()
os.environ["MUTANT_UNDER_TEST"] = name
failures = Failures()
code = pytest.main(["-x", "-q", "-p", "no:cacheprovider", *sys.argv[1:]],
                   plugins=[failures])
print("RESULT " + json.dumps({"code": int(code), "failed": failures.failed}), flush=True)
sys.stdout.flush()
os._exit(0)
'''


def mutant_names(text: str) -> list[str]:
    names = re.findall(r"def (xǁCudaCopyPathǁ\w+__mutmut_\d+)\(", text)
    return [f"{PACKAGE}.{n}" for n in names]


class Worker:
    def __init__(self, tests: list[str]):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, *tests], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def run(self, name: str, timeout: float) -> dict:
        t0 = time.monotonic()
        try:
            out, _ = self.proc.communicate(name + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.communicate()
            return {"outcome": "timeout", "seconds": round(time.monotonic() - t0, 1)}
        found = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not found:
            return {"outcome": "killed", "seconds": round(time.monotonic() - t0, 1),
                    "detail": "worker died: " + out[-300:]}
        res = json.loads(found[-1][len("RESULT "):])
        last = [ln for ln in out.splitlines() if " passed" in ln or " failed" in ln]
        return {"outcome": "survived" if res["code"] == 0 else "killed",
                "seconds": round(time.monotonic() - t0, 1),
                "detail": res["failed"][0] if res["failed"] else (last[-1] if last else out[-200:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutated", type=Path, help="the copy_paths.py mutmut generated")
    parser.add_argument("--out", type=Path, default=Path("cuda_mutmut.jsonl"))
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--skip", type=Path, help="a previous --out: its mutants are not run again")
    parser.add_argument("--budget", type=float, default=float("inf"),
                        help="stop starting mutants after this many seconds")
    parser.add_argument("--marker", default="needs_cuda", help="pytest -m (empty: every test)")
    parser.add_argument("tests", nargs="*", default=TESTS)
    args = parser.parse_intermixed_args()
    if args.marker:
        args.tests = ["-m", args.marker, *args.tests]
    text = args.mutated.read_text()
    if text.count(MUTMUT_IMPORT) != 1:
        raise SystemExit(f"{args.mutated}: mutmut's trampoline import not found once")
    names = mutant_names(text)
    if args.only:
        names = [n for n in names if n.rpartition(".")[2] in args.only.split(",")]
    if args.skip and args.skip.exists():
        done = {json.loads(ln)["mutant"] for ln in args.skip.read_text().splitlines() if ln}
        names = [n for n in names if n not in done]
    original = MODULE.read_text()
    MODULE.write_text(text.replace(MUTMUT_IMPORT, TRAMPOLINE))
    start = time.monotonic()
    try:
        spare = Worker(args.tests)
        base = spare.run("none", args.timeout)
        print(json.dumps({"mutant": "none (baseline)", **base}), flush=True)
        if base["outcome"] != "survived":
            print("the module fails its tests without a mutant: stop", file=sys.stderr)
            return 1
        spare = Worker(args.tests)
        with args.out.open("a") as out:
            for i, name in enumerate(names):
                if time.monotonic() - start > args.budget:
                    print(f"budget spent: {len(names) - i} mutants not run", flush=True)
                    break
                worker, spare = spare, (Worker(args.tests) if i + 1 < len(names) else None)
                row = {"mutant": name, **worker.run(name, args.timeout)}
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)
            if spare is not None:
                os.killpg(spare.proc.pid, 9)
    finally:
        MODULE.write_text(original)
    return 0


if __name__ == "__main__":
    sys.exit(main())
