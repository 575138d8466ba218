"""Helpers of the fault-injection tests (tests/faults): run the real CLI in its own
session, hit it with signals or injected faults, find every process it left, and check
what is on disk.

Faults inside the run's processes come from ``tests/faults/hooks/sitecustomize.py``,
switched on by environment variables (see its docstring); :func:`start` puts that folder
on ``PYTHONPATH`` so the CLI, its spawned consumers and its DataLoader workers load it.
The engine sinks of the property test live here too: consumers must import them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent
HOOKS = TESTS / "faults" / "hooks"

# Small and slow on purpose: many commits (one segment per batch), a sink slow enough
# that a run can be hit mid-way, and runs of a few seconds on two CPU cores.
CHUNK_TOKENS = 32
BUILD_ARGS = ["--num-workers", "0", "--num-consumers", "2", "--batch-size", "4",
              "--chunk-tokens", str(CHUNK_TOKENS), "--overlap", "0", "--commit-every", "4"]


def build_args(device: str = "cpu") -> list[str]:
    return ["--device", device, *BUILD_ARGS]

WORDS = ("river mountain engine harbour lantern orchard violin glacier copper meadow "
         "falcon quartz thunder pepper saddle candle marble timber velvet island "
         "compass ember nectar oyster pilgrim riddle sparrow tunnel walnut zephyr").split()


# -- processes ------------------------------------------------------------------------


def _proc_table() -> list[tuple[int, int, int, str, bytes]]:
    """(pid, ppid, session, state, cmdline) of every live process."""
    rows = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        rows.append((int(d.name), int(fields[1]), int(fields[3]), fields[0], cmd))
    return rows


def session_pids(sid: int) -> set[int]:
    """Live (not zombie) processes of session ``sid``: a run started with
    ``start_new_session=True`` and everything it started, even once re-parented."""
    return {pid for pid, _, s, state, _ in _proc_table() if s == sid and state != "Z"}


def pids_mentioning(text: str) -> set[int]:
    """Live processes whose command line contains ``text`` (e.g. a run's output folder)."""
    needle = os.fsencode(text)
    me = os.getpid()
    return {pid for pid, _, _, state, cmd in _proc_table()
            if state != "Z" and needle in cmd and pid != me}


def descendants(parent: int) -> dict[int, bytes]:
    """Live descendants of ``parent`` with their command lines."""
    table = _proc_table()
    kids: dict[int, list[tuple[int, bytes]]] = {}
    for pid, ppid, _, state, cmd in table:
        if state != "Z":
            kids.setdefault(ppid, []).append((pid, cmd))
    out, stack = {}, [parent]
    while stack:
        for pid, cmd in kids.get(stack.pop(), []):
            out[pid] = cmd
            stack.append(pid)
    return out


def _threads_waiting_in(pid: int) -> list[str]:
    """Where each thread of ``pid`` sleeps in the kernel (for the message of a leak)."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            out.append(f"{(task / 'comm').read_text().strip()}:{(task / 'wchan').read_text()}")
        except OSError:
            pass
    return out


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def stop_bound(module: str, floor: float = 5.0) -> float:
    """Seconds a run of the CLI may take to stop after Ctrl-C on this machine, now: the
    promised 5 s, or 1.5 times what a fresh interpreter takes right now to import the
    job's ``module`` (torch, faiss, transformers), whichever is larger. A stop is a few
    commits and the teardown of such an interpreter (1.9 s on two cores at load 2, where
    the import takes longer), so it slows down with the machine as the import does; a
    stop that waits out a timeout or the rest of the work does not fit on an idle one."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, timeout=600)
    return max(floor, 1.5 * (time.monotonic() - t0))


def check_ctrl_c_stops(run, bound: float, sig: int = signal.SIGINT, group: bool = True,
                       advice: str = "run the same command again to resume") -> None:
    """Ctrl-C to a running ``run``: it exits 130 within ``bound`` seconds (:func:`stop_bound`)
    with the message that says how to resume, no traceback and nothing left running.
    ``sig=SIGTERM``: exit 143 with the same message, sent to the whole process group (a
    batch system's end of a job) or, ``group=False``, to the main process alone (as
    ``timeout``, ``docker stop`` and ``kill`` send it). ``advice``: what the message must say."""
    assert run.running(), run.describe()
    if group:
        run.signal_group(sig)
    else:
        os.kill(run.pid, sig)
    t0 = time.monotonic()
    rc = run.wait(60)
    stopped = time.monotonic() - t0
    assert stopped < bound, f"the run took {stopped:.1f} s to stop (bound {bound:.1f} s)"
    assert rc == (130 if sig == signal.SIGINT else 143), run.describe()
    said = "interrupted:" if sig == signal.SIGINT else "terminated (SIGTERM):"
    assert said in run.stderr and advice in run.stderr, run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    run.assert_no_leftovers()


def before_the_program(stderr: str) -> bool:
    """Whether a KeyboardInterrupt's traceback lies wholly in the interpreter's own start
    (runpy, importlib: ``python -m`` still finding the module), before any line of
    embedingest ran: Python's to print, not the program's."""
    frames = [line for line in stderr.splitlines() if line.strip().startswith('File "')]
    return bool(frames) and "KeyboardInterrupt" in stderr and not any("embedingest" in f for f in frames)


def check_ctrl_c_during_start_up(start, delays=(0.4, 1.5)) -> None:
    """``start(n)`` starts run ``n``; each is interrupted ``delay`` s in (importing torch,
    loading the model, starting device processes) and must exit 130 with the usual
    message, no traceback and nothing left running."""
    for n, delay in enumerate(delays):
        for tries in range(3):
            run = start(n if not tries else f"{n}-again{tries}")
            time.sleep(delay)
            assert run.running(), run.describe()
            run.signal_group(signal.SIGINT)
            # 130, or ended by the SIGINT itself after printing the message (rarely, when it
            # lands inside torch's import); a shell shows 130 for both.
            rc = run.wait(60)
            if not (rc == -signal.SIGINT and before_the_program(run.stderr)):
                break
            delay += 0.5  # a loaded machine had not reached the program yet: interrupt later
            run.assert_no_leftovers()
        assert rc in (130, -signal.SIGINT), run.describe()
        assert "interrupted:" in run.stderr and "Traceback" not in run.stderr, run.describe()
        run.assert_no_leftovers()


class Run:
    """One CLI process in a session of its own; stdout/stderr go to files (a pipe left
    unread could block the run)."""

    def __init__(self, args: list[str], log_dir: Path, env: dict | None = None,
                 cwd: Path | None = None, marker: str | None = None, preexec_fn=None):
        log_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(log_dir.glob("run*.out")))
        self.out_path = log_dir / f"run{n}.out"
        self.err_path = log_dir / f"run{n}.err"
        full_env = dict(os.environ)
        for key in list(full_env):
            if key.startswith("EMBEDINGEST_FI_"):
                del full_env[key]
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(HOOKS)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        # Two cores shared by the encoder and the consumers: OpenMP threads spinning
        # against each other make a CPU run several times slower.
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env.update(env or {})
        self.args = [sys.executable, "-m", "embedingest", *args]
        self.marker = marker  # a string in the command line (the output folder)
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                         env=full_env, cwd=cwd, start_new_session=True,
                                         preexec_fn=preexec_fn)
        self.pid = self.proc.pid
        self.t0 = time.monotonic()

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"{self} did not end within {timeout} s; stderr:\n{self.stderr[-3000:]}")

    def running(self) -> bool:
        return self.proc.poll() is None

    def consumers(self) -> dict[int, bytes]:
        """The engine's consumer processes (spawned: their command line names spawn_main)."""
        return {pid: cmd for pid, cmd in descendants(self.pid).items()
                if b"spawn_main" in cmd and b"resource_tracker" not in cmd}

    def loader_workers(self) -> dict[int, bytes]:
        """The DataLoader worker processes (forked: the same command line as the CLI)."""
        return {pid: cmd for pid, cmd in descendants(self.pid).items()
                if b"spawn_main" not in cmd and b"resource_tracker" not in cmd}

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill_all(self) -> None:
        self.signal_group(signal.SIGKILL)
        for pid in session_pids(self.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def leftovers(self) -> set[int]:
        pids = session_pids(self.pid)
        if self.marker:
            pids |= pids_mentioning(self.marker)
        return pids

    def assert_no_leftovers(self, timeout: float = 15.0) -> None:
        """Every process of the run ended (PyTorch DataLoader workers poll for their
        parent every 5 s, hence the margin)."""
        if self.running():
            self.wait()
        try:
            wait_for(lambda: not self.leftovers(), timeout, 0.1, "the run's processes to end")
        except AssertionError:
            left = {pid: (cmd[:200], _threads_waiting_in(pid)) for pid, _, _, _, cmd in _proc_table()
                    if pid in self.leftovers()}
            self.kill_all()
            raise AssertionError(f"processes of {self} left behind: {left}") from None

    def __repr__(self) -> str:
        return f"Run(pid {self.pid}: {' '.join(self.args[3:])})"

    def describe(self) -> str:
        return f"{self!r} exit {self.proc.returncode}\n--- stdout\n{self.stdout[-2000:]}\n--- stderr\n{self.stderr[-4000:]}"


# -- a disk that fills up -------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: int):
    """A real tmpfs of ``size`` bytes (whole pages) mounted at ``folder`` for the block, or
    None where this machine does not let the tests mount one (not root, no CAP_SYS_ADMIN);
    each test that uses it says what it does then."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                               str(folder)], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is None or done.returncode != 0:
        yield None
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30, check=False)


def fill_until(folder: Path, free: int) -> Path:
    """Fill the file system of ``folder`` with a file until about ``free`` bytes are left."""
    st = os.statvfs(folder)
    filler = folder / "filler"
    with open(filler, "ab") as fh:
        fh.write(b"\0" * max(0, st.f_bavail * st.f_frsize - free))
    return filler


# -- corpora --------------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_corpus(root: Path, n_docs: int = 10, seed: int = 0) -> Path:
    """Plain text, Markdown and JSON lines files of ~10 chunks each (at CHUNK_TOKENS)."""
    rng = random.Random(seed)
    (root / "sub").mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        kind = i % 3
        if kind == 0:
            (root / f"doc{i:02d}.txt").write_text(words(rng, rng.randint(150, 320)) + "\n")
        elif kind == 1:
            (root / "sub" / f"note{i:02d}.md").write_text(
                f"# Note {i}\n\n" + words(rng, rng.randint(150, 320)) + "\n")
        else:
            with open(root / f"rec{i:02d}.jsonl", "w") as fh:
                for r in range(3):
                    fh.write(json.dumps({"id": f"r{i}-{r}", "text": words(rng, rng.randint(40, 110))}) + "\n")
    return root


def expected_chunks(corpus: Path, keys: list[str] | None = None, chunk_tokens: int = CHUNK_TOKENS,
                    overlap: int = 0) -> dict[str, int]:
    """Chunks per file key (path relative to the corpus) as build-index cuts them with
    BUILD_ARGS (or ``chunk_tokens`` and ``overlap``): the library's tokenizer and chunker
    only, no model and no engine."""
    from embedingest.sources.files import walk_files
    from embedingest.sources.text import TEXT_EXTENSIONS
    from embedingest.sources.text_dataset import TextChunkDataset, Unit
    from embedingest.stages.model_folder import resolve_model
    from embedingest.stages.tokenizer import load_tokenizer

    paths = list(walk_files(corpus, TEXT_EXTENSIONS))
    units = [Unit(n, p.relative_to(corpus).as_posix(), path=str(p)) for n, p in enumerate(paths)]
    if keys is not None:
        units = [u for u in units if u.key in set(keys)]
    ds = TextChunkDataset(units, resolve_model(None)[0], batch_size=64, max_tokens=chunk_tokens,
                          overlap=overlap, tokenizer_loader=load_tokenizer)
    by_no = {u.unit_no: u.key for u in units}
    counts = {}
    for item in ds:
        for unit_no, n in item["units_done"]:
            counts[by_no[int(unit_no)]] = int(n)
    return counts


# -- what is on disk ------------------------------------------------------------------


def tmp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".*") if ".tmp-" in p.name]


def check_index_files(out: Path) -> dict:
    """Everything build-index left in ``out`` is whole, whatever moment it was stopped at:
    the manifest (if any) parses, every committed shard's files are those its commit
    record names (sizes and sha256), its vectors load with faiss under the ids of its
    Parquet rows, the units database passes sqlite's integrity check, the skip report
    parses. Temporary files and files of uncommitted shards may remain (the next run
    deletes them). Returns {shard name: ids}."""
    import faiss

    from embedingest.index.shards import list_shards, read_ids

    generation = 0
    if (out / "manifest.json").exists():
        manifest = json.loads((out / "manifest.json").read_text())
        assert {"model", "dim", "segments"} <= set(manifest), manifest
        generation = manifest.get("generation", 0)
    if (out / "skipped.jsonl").exists():
        for line in (out / "skipped.jsonl").read_text().splitlines():
            assert {"path", "reason"} <= set(json.loads(line))
    if (out / "units.sqlite").exists():
        db = sqlite3.connect(f"file:{out / 'units.sqlite'}?mode=ro", uri=True)
        try:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            db.execute("SELECT count(*) FROM units").fetchone()
        finally:
            db.close()
    shards = {}
    for shard in list_shards(out / "shards", generation=generation):
        assert shard.verify() is None, shard.name
        if not shard.rows:
            continue
        index = faiss.read_index(str(shard.faiss_path(generation)))
        ids = read_ids(shard)
        assert index.ntotal == len(ids) == shard.rows, shard.name
        assert np.array_equal(faiss.vector_to_array(index.id_map), ids), shard.name
        shards[shard.name] = ids
    return shards


def check_exactly_once(out: Path, expected: dict[str, int]) -> np.ndarray:
    """The index in ``out`` holds every chunk of every expected file once: the committed
    shards give exactly ids ``unit_no << 32 | 0..n-1`` of each expected key, no
    duplicate, nothing else; every id has its chunk row; the manifest lists the shards;
    no temporary file is left; every shard's files are whole."""
    from embedingest.index.shard_store import ShardStore
    from embedingest.index.shards import CHUNK_BITS

    check_index_files(out)
    assert not tmp_files(out), f"temporary files left: {tmp_files(out)}"
    with ShardStore(out) as store:
        shards = store.shards()
        ids = np.concatenate([s.ids() for s in shards]) if shards else np.empty(0, np.int64)
        dup = [i for i, c in Counter(ids.tolist()).items() if c > 1]
        assert not dup, f"{len(dup)} ids indexed more than once, e.g. {dup[:5]}"
        assert len(ids) == sum(expected.values()), (len(ids), sum(expected.values()))
        units = store.units()
        assert set(units) == set(expected), set(units) ^ set(expected)
        for key, n in expected.items():
            u = units[key]
            assert u.status == "done" and u.n_chunks == n, (key, u, n)
            mine = np.sort(ids[(ids >> CHUNK_BITS) == u.unit_no] & ((1 << CHUNK_BITS) - 1))
            assert np.array_equal(mine, np.arange(n)), (key, mine)
        rows = store.chunks(ids.tolist())
        assert len(rows) == len(ids) and all(r.text for r in rows.values())
        assert store.reconcile() == set()
        listed = {s["name"]: s["count"] for s in store.read_manifest().segments}
        assert listed == {s.name: s.count for s in shards}
    return ids


# -- /dev/shm -------------------------------------------------------------------------


def shm_listing() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def shm_in_use() -> set[str]:
    """Names of the /dev/shm files some live process has open or mapped. A file our runs
    left behind is in none (they all ended); one that another program on the machine is
    using right now (tests run side by side) is, and is not ours to judge."""
    used = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.split("/dev/shm/", 1)[1].split()[0])
            for fd in (d / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue
    return used


def half_made_semaphores(names: set[str]) -> set[str]:
    """The names among ``names`` that are semaphores a process was killed while making.
    glibc's ``sem_open`` makes the file under a temporary name (``sem.`` and six random
    letters or digits), links it to the semaphore's name, then unlinks the temporary one;
    a SIGKILL between the two leaves both names of one file, and nobody can remove them: Python's resource tracker
    learns the name only once ``sem_open`` returns. A test that kills a process at an
    arbitrary moment (as its DataLoader makes its queues) may leave such a pair; only
    exact pairs are returned (two names of one inode, the temporary one and a
    ``sem.mp-*``), so any other file still counts as leaked."""
    by_inode: dict[int, set[str]] = {}
    for name in names:
        try:
            by_inode.setdefault(os.stat(os.path.join("/dev/shm", name)).st_ino, set()).add(name)
        except OSError:
            continue
    half_made = set()
    for group in by_inode.values():
        temporary = {n for n in group if re.fullmatch(r"sem\.[A-Za-z0-9]{6}", n)}
        named = group - temporary
        if len(temporary) == 1 and len(named) == 1 and next(iter(named)).startswith("sem.mp-"):
            half_made |= group
    return half_made


def shm_wait() -> float:
    """How long a /dev/shm file nobody uses may stay before it counts as leaked. Alone, 5 s.
    Beside another pytest-xdist worker, 120 s: /dev/shm is the machine's, and a run the
    other worker's test killed leaves its multiprocessing semaphores (``sem.mp-*``) until
    that test ends its run's last process, when the run's resource tracker unlinks them.
    A real leak stays for good, so the longer wait only delays its failure."""
    return 120.0 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else 5.0


def new_shm_files(before: set[str], timeout: float | None = None) -> set[str]:
    """/dev/shm files that appeared since ``before``, are still there after ``timeout``
    (default :func:`shm_wait`) and no live process uses: what a run leaked."""
    deadline = time.monotonic() + (shm_wait() if timeout is None else timeout)
    while True:
        new = shm_listing() - before
        if new:
            new -= shm_in_use()
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(0.1)


# -- engine sinks of the property test (consumers import them from here) ---------------


def array_digest(arrays: dict) -> dict:
    return {k: (a.shape, str(a.dtype), hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest())
            for k, a in arrays.items()}


class DelayedDigestSinkFactory:
    """Sinks that sleep a per-worker delay, then return the digest of what they got."""

    def __init__(self, delays: tuple[float, ...]):
        self.delays = tuple(delays)

    def __call__(self, worker: int):
        return DelayedDigestSink(worker, self.delays[worker % len(self.delays)])


class DelayedDigestSink:
    def __init__(self, worker: int, delay: float):
        self.worker, self.delay, self.seen = worker, delay, []

    def __call__(self, batch_id, arrays):
        if self.delay:
            time.sleep(self.delay)
        self.seen.append(batch_id)
        return (self.worker, array_digest(arrays))

    def close(self):
        return {"worker": self.worker, "seen": self.seen}


def stopped_by_dead_consumer(run, victim: int | None) -> None:
    """The run ends within 10 s of the consumer's death, exit 1, naming it, no traceback."""
    t0 = time.monotonic()
    rc = run.wait(60)
    assert time.monotonic() - t0 < 10, f"the run took {time.monotonic() - t0:.1f} s to stop"
    assert rc == 1, run.describe()
    pid = victim if victim is not None else r"\d+"
    assert re.search(rf"consumer \d+ \(pid {pid}\) was killed by SIGKILL", run.stderr), run.describe()
    assert "Traceback" not in run.stderr, run.describe()
    run.assert_no_leftovers()


def unblock_later(fifo, seconds: float = 10.0) -> None:
    """Open ``fifo`` for writing after ``seconds`` (in a daemon thread), so a reader that
    blocked on it (the defect under test) wakes up and the test fails instead of hanging;
    with no reader waiting the open fails, which is the case the tests expect."""
    def write_end():
        time.sleep(seconds)
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=write_end, daemon=True).start()
