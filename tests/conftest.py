"""Shared test fixtures: CUDA gating and leak checks (processes, /dev/shm)."""

from __future__ import annotations

import os
import signal

import pytest

# Under pytest-xdist, each worker (and every process its tests start) computes on its share
# of the cores: with OpenMP's default of one thread per core, two workers on two cores run
# four spinning threads, and a loaded CPU run then took twice its CPU time and more than
# twice its wall time (docs/TESTING.md). Set before torch is imported: OpenMP reads it once.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(
        1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAS_CUDA = False


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    """Every process a test starts (a CLI run, a script, a spawned consumer, a Ray worker)
    imports embedingest from this checkout, not from wherever the venv's install points:
    the checkout goes first on PYTHONPATH, which child processes inherit."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *parts])
    # Ctrl-C reaches the CLI runs the tests start as it would from a terminal, also when
    # pytest itself runs as a background job (which ignores SIGINT, and an ignored signal
    # stays ignored in every program the job starts; a handled one is reset at exec).
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True)
def pytest_report_to_serializable(config, report):
    """Reports as pytest-xdist's workers send them: strict UTF-8. Tests feed lone surrogates
    on purpose and the skip warnings they capture quote them; such a string crashed the
    worker (execnet: "strings must be utf-8 encodable") and ended the whole run."""
    data = yield
    return _utf8(data)


def _utf8(obj):
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return obj.encode("utf-8", "backslashreplace").decode("utf-8")
        return obj
    if isinstance(obj, dict):
        return {_utf8(k): _utf8(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_utf8(v) for v in obj)
    return obj


RAY_FILES = {"test_build_index_ray.py", "test_ray_cluster.py"}


def pytest_xdist_make_scheduler(config, log):
    """``-n 2 --dist loadfile`` (README's test command): each test file runs whole on one
    worker, so its module fixtures (a Ray cluster, a served index, the browser) start once,
    and the two Ray files share one worker: side by side their builds starve each other's
    actors on two cores. (``xdist_group`` marks would say the same, but pytest-xdist 3.8's
    ``loadgroup`` renames items through an attribute pytest 9 no longer reads.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if os.path.basename(path) in RAY_FILES else path

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "needs_cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


def child_pids(parent: int | None = None) -> set[int]:
    """Live descendants of ``parent`` (default: this process), multiprocessing's helper excluded."""
    from fault_helpers import descendants

    parent = os.getpid() if parent is None else parent
    return {pid for pid, cmd in descendants(parent).items() if b"resource_tracker" not in cmd}


def shm_files() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves a child process or a new /dev/shm file behind."""
    import time

    before_shm = shm_files()
    before_kids = child_pids()
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        extra = child_pids() - before_kids
        if not extra:
            break
        time.sleep(0.1)
    assert not extra, f"processes left behind: {sorted(extra)}"
    # files that a live process (another test run on the machine) still uses are not ours
    from fault_helpers import new_shm_files

    new = new_shm_files(before_shm)
    assert not new, f"new /dev/shm files: {sorted(new)}"
