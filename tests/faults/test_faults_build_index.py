"""Nothing lost: build-index under faults, through the real CLI (``python -m embedingest``).

Each test hits a run (SIGKILL of a consumer or of the main process, Ctrl-C, a full disk,
poisoned inputs), checks that what is on disk is whole, re-runs the same command and
checks that the index then holds every chunk of the corpus exactly once. The ``cli``
fixture (conftest.py) checks after every test that no process of any run is left and
that /dev/shm holds no new file.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import (
    BUILD_ARGS,
    build_args,
    check_ctrl_c_during_start_up,
    check_ctrl_c_stops,
    check_exactly_once,
    check_index_files,
    expected_chunks,
    make_corpus,
    stop_bound,
    stopped_by_dead_consumer,
    tmp_files,
    wait_for,
    words,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda)]
SLOW_SINK = {"EMBEDINGEST_FI_SINK_DELAY": "0.15"}


def n_segments(out: Path) -> int:
    """Committed shards (with rows or not)."""
    seg = out / "shards"
    return len(list(seg.glob("shard-*.commit.json"))) if seg.is_dir() else 0


def assert_no_id_twice(out: Path) -> None:
    """What a reader (search) would see right now lists no vector twice."""
    from embedingest.index.shard_store import ShardStore

    with ShardStore(out) as store:
        ids = np.concatenate([s.ids() for s in store.shards()] or [np.empty(0, np.int64)])
    assert len(ids) == len(np.unique(ids)), "a vector id is listed twice"


def build(cli, corpus: Path, out: Path, *extra, env=None, device="cpu"):
    return cli("build-index", corpus, "--out", out, *build_args(device), *extra, env=env)


def finish(cli, corpus: Path, out: Path, device="cpu", expected=None) -> dict:
    """Re-run the same command to the end; check exactly-once; return its JSON summary."""
    run = build(cli, corpus, out, "--json", device=device)
    assert run.wait() == 0, run.describe()
    check_exactly_once(out, expected if expected is not None else expected_chunks(corpus))
    return json.loads(run.stdout)


@pytest.mark.parametrize("device", DEVICES)
def test_consumer_sigkill_stops_run_naming_it_and_rerun_is_exactly_once(cli, tmp_path, device):
    """A consumer dies while its 3rd shard is half written (its Parquet file renamed, the
    .faiss not, no commit record); the re-run loses another consumer (killed from outside, found among the
    CLI's children); the third run ends it with every chunk once."""
    corpus = make_corpus(tmp_path / "corpus", 10)
    out = tmp_path / "idx"
    run = build(cli, corpus, out, device=device,
                env={**SLOW_SINK, "EMBEDINGEST_FI_KILL": "consumer:shard-*.faiss:3:mid"})
    wait_for(lambda: not run.running() or tmp_files(out), 120, what="a half-written segment")
    stopped_by_dead_consumer(run, None)
    assert tmp_files(out)  # the half-written segment, under its temporary name only
    check_index_files(out)
    assert_no_id_twice(out)

    run = build(cli, corpus, out, env=SLOW_SINK, device=device)
    before = n_segments(out)
    wait_for(lambda: n_segments(out) >= before + 2 or not run.running(), 120,
             what="two committed segments")
    assert run.running(), run.describe()
    consumers = run.consumers()
    assert len(consumers) == 2, consumers
    victim = sorted(consumers)[1]
    os.kill(victim, signal.SIGKILL)
    stopped_by_dead_consumer(run, victim)
    check_index_files(out)
    assert_no_id_twice(out)
    finish(cli, corpus, out, device)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("device", DEVICES)
def test_main_sigkill_at_random_moments_loses_nothing(cli, tmp_path, device, seed):
    """A run killed after a random number of commits; with seed 1 its re-run killed
    again at a random moment (start-up, planning, removal of half-done units, encoding);
    then a run to the end. Only the main process is killed: the consumers (and a
    DataLoader worker) must end by themselves."""
    rng = random.Random(seed)
    corpus = make_corpus(tmp_path / "corpus", 10, seed=seed)
    out = tmp_path / "idx"
    killed = 0
    for attempt in range(1 + seed):
        # the resumed run of seed 1 reads in a DataLoader worker process, which must not
        # outlive the run either
        workers = ["--num-workers", "1"] if attempt == 1 else []
        run = build(cli, corpus, out, *workers, env=SLOW_SINK, device=device)
        before = n_segments(out)
        if attempt == 0:  # mid-encoding: after a random number of this run's commits
            k = rng.randint(1, 12)
            wait_for(lambda run=run, n=before + k: n_segments(out) >= n or not run.running(), 120,
                     what=f"{k} commits")
            time.sleep(rng.uniform(0, 0.3))
        else:  # anywhere in a resumed run (planning, removal, encoding): a random moment
            deadline = time.monotonic() + rng.uniform(0.5, 8.0)
            while run.running() and time.monotonic() < deadline:
                time.sleep(0.01)
        if run.running():
            os.kill(run.pid, signal.SIGKILL)
            killed += 1
            assert run.wait() == -signal.SIGKILL
        # the consumers stop by themselves (PR_SET_PDEATHSIG), having committed what they held
        run.assert_no_leftovers()
        check_index_files(out)
        assert_no_id_twice(out)
    assert killed >= 1
    finish(cli, corpus, out, device)


def test_a_last_commit_slower_than_the_shutdown_timeout_lands(cli, tmp_path):
    """Each consumer's last commit takes 6 s here, more than the engine's 5-s shutdown
    timeout (which is for runs stopped early). The run waits for the commits: the index
    holds every chunk and the summary counts them, where the commits used to be cut by
    SIGTERM and the run said it indexed every file into an empty index."""
    corpus = make_corpus(tmp_path / "corpus", 6, seed=5)
    out = tmp_path / "idx"
    run = build(cli, corpus, out, "--json", "--commit-every", "100000",  # one commit each, at close
                env={"EMBEDINGEST_FI_COMMIT_DELAY": "6"})
    assert run.wait() == 0, run.describe()
    expected = expected_chunks(corpus)
    check_exactly_once(out, expected)
    summary = json.loads(run.stdout)
    assert summary["vectors_total"] == summary["chunks"] == sum(expected.values())
    assert summary["timing"]["close_s"] >= 6


def test_rerun_at_once_after_main_sigkill_waits_for_the_last_commits(cli, tmp_path):
    """Re-run the moment the main process is killed, while its consumers are still
    alive and committing (each commit takes seconds here): the new run waits for them
    (the folder's writers lock; its mechanics are in tests/index/test_lock.py) and,
    once every process of the killed run is gone, the index holds every chunk exactly
    once."""
    corpus = make_corpus(tmp_path / "corpus", 10, seed=3)
    out = tmp_path / "idx"
    run = build(cli, corpus, out, env={"EMBEDINGEST_FI_SINK_DELAY": "0.3",
                                       "EMBEDINGEST_FI_COMMIT_DELAY": "6"})
    wait_for(lambda: n_segments(out) >= 1 or not run.running(), 120, what="a first commit")
    consumers = list(run.consumers())
    assert consumers, run.describe()
    os.kill(run.pid, signal.SIGKILL)
    rerun = build(cli, corpus, out, "--json")
    assert any(_alive(pid) for pid in consumers), "the window this test is about did not open"
    assert rerun.wait() == 0, rerun.describe()
    assert run.wait() == -signal.SIGKILL
    run.assert_no_leftovers()  # the killed run's late commits have landed by now
    check_exactly_once(out, expected_chunks(corpus))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_main_sigkill_as_the_loader_worker_starts_leaves_no_process(cli, tmp_path):
    """The main process killed the moment its DataLoader worker is forked (PyTorch's own
    parent check is not armed yet while the worker loads its tokenizer): the worker must
    not run on, orphaned, forever."""
    corpus = make_corpus(tmp_path / "corpus", 4)
    out = tmp_path / "idx"
    run = build(cli, corpus, out, "--num-workers", "1", env=SLOW_SINK)
    wait_for(lambda: run.loader_workers() or not run.running(), 120, 0.002, "the loader worker")
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL, run.describe()
    run.assert_no_leftovers(timeout=5)
    check_index_files(out)


def test_main_sigkill_while_writing_manifest_report_and_removal(cli, tmp_path):
    """SIGKILL of the main process in the middle of its own writes: the manifest when
    the index is created, the manifest at the end of a run, the commit record of a
    shard rewritten by the removal of changed units, the skip report; each time the
    folder stays whole and the next run goes on."""
    corpus = make_corpus(tmp_path / "corpus", 8, seed=5)
    out = tmp_path / "idx"

    def killed_at(point: str):
        run = build(cli, corpus, out, env={"EMBEDINGEST_FI_KILL": point})
        rc = run.wait()
        assert rc == -signal.SIGKILL, f"never reached {point}: {run.describe()}"
        run.assert_no_leftovers()
        check_index_files(out)
        assert_no_id_twice(out)
        return run

    killed_at("main:manifest.json:1:mid")  # creating the index
    assert not (out / "manifest.json").exists()
    killed_at("main:manifest.json:2:mid")  # the final manifest, every shard committed

    # Change a file that shares a shard with another one, so the removal of its old
    # vectors rewrites that shard (in the main process), and add a bad file.
    from embedingest.index.shard_store import ShardStore
    from embedingest.index.shards import CHUNK_BITS

    with ShardStore(out) as store:
        by_no = {u.unit_no: k for k, u in store.units().items()}
        mixed = next(s for s in store.shards() if len(set((s.ids() >> CHUNK_BITS).tolist())) > 1)
        victim = by_no[int(mixed.ids()[0] >> CHUNK_BITS)]
    (corpus / victim).write_text(words(random.Random(9), 200) + "\n")
    (corpus / "zero.txt").write_bytes(b"")
    killed_at("main:shard-rm*.commit.json:1:mid")  # every other point: test_remove_units_sigkill_...
    killed_at("main:skipped.jsonl:1:mid")
    run = build(cli, corpus, out, "--json")
    assert run.wait() == 3, run.describe()  # finished; zero.txt reported again (its first report was cut)
    check_exactly_once(out, expected_chunks(corpus))


def _remove_units_script(folder: Path, units: list[int]) -> str:
    return (f"from embedingest.index.shard_store import ShardStore\n"
            f"ShardStore({str(folder)!r}).remove_units({units!r})\n")


def _shard_files_named(folder: Path) -> set[str]:
    """The files the committed shards' records name (and the records)."""
    from embedingest.index.shards import list_shards

    names = set()
    for shard in list_shards(folder / "shards"):
        names.add(shard.commit_path().name)
        names.update(info["name"] for info in shard.files.values())
    return names


def test_remove_units_sigkill_at_every_write_keeps_each_vector_once(tmp_path):
    """The removal that every resumed run starts with, killed at each file it commits
    (each rewritten shard's Parquet, faiss and embeddings files and its commit record,
    the switch; mid-write and just after): a reader never sees an id twice, and the
    next build's clean-up plus the removal again finish it with exactly the other units
    left and no file that no commit record names."""
    import shutil
    import subprocess
    import sys

    from fault_helpers import HOOKS
    from index_fixtures import build_index

    from embedingest.index.shard_store import ShardStore
    from embedingest.index.shards import CHUNK_BITS

    base = tmp_path / "base"
    built = build_index(base, n_units=6, chunks=20, commit_every=30, workers=2)
    drop = [built.unit_nos["doc1.txt"], built.unit_nos["doc4.txt"]]
    keep = np.sort(built.ids[~np.isin(built.ids >> CHUNK_BITS, drop)])
    built.store.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")])}
    points, n = [], 1
    while True:  # every replace of the removal, until one run is not killed
        hit = False
        for phase in ("mid", "after"):
            folder = tmp_path / f"n{n}-{phase}"
            shutil.copytree(base, folder)
            proc = subprocess.run([sys.executable, "-c", _remove_units_script(folder, drop)],
                                  env={**env, "EMBEDINGEST_FI_KILL": f"main:*:{n}:{phase}"},
                                  capture_output=True, text=True, timeout=60, check=False)
            if proc.returncode == 0:
                continue
            assert proc.returncode == -signal.SIGKILL, proc.stderr
            hit = True
            points.append((n, phase))
            check_index_files(folder)
            with ShardStore(folder) as store:
                ids = np.concatenate([s.ids() for s in store.shards()])
                assert len(ids) == len(np.unique(ids)), (n, phase)
                assert set(ids.tolist()) >= set(keep.tolist()), (n, phase)  # nothing kept is lost
                store.clean_garbage()
                store.remove_units(drop)
                ids = np.sort(np.concatenate([s.ids() for s in store.shards()]))
                assert np.array_equal(ids, keep), (n, phase)
                assert store.reconcile() == set(), (n, phase)
            check_index_files(folder)
            assert set(os.listdir(folder / "shards")) == _shard_files_named(folder), (n, phase)
        if not hit:
            break
        n += 1
    # every rewritten shard: its Parquet, faiss and commit record (2 shards at least)
    assert len(points) >= 12, points


@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGTERM, True)],
                         ids=["ctrl-c", "sigterm", "sigterm-group"])
@pytest.mark.parametrize("device", DEVICES)
def test_ctrl_c_exits_130_within_5_s_and_resume_keeps_saved_work(cli, tmp_path, device, sig, group):
    """Ctrl-C; SIGTERM to the main process (``timeout``, ``docker stop``: before, the run
    died of it silently, status 143 and no word of what was kept) or to every process
    of the run (a batch system's; the DataLoader's workers die of it too)."""
    bound = stop_bound("embedingest.jobs.build_index")
    corpus = make_corpus(tmp_path / "corpus", 10, seed=2)
    out = tmp_path / "idx"
    run = build(cli, corpus, out, "--num-workers", "1", env=SLOW_SINK, device=device)
    wait_for(lambda: n_segments(out) >= 8 or not run.running(), 120, what="eight committed segments")
    check_ctrl_c_stops(run, bound, sig, group)
    check_index_files(out)
    assert_no_id_twice(out)
    from embedingest.index.shard_store import ShardStore

    with ShardStore(out) as store:  # the files fully saved before Ctrl-C
        incomplete = store.reconcile()
        saved = [u for u in store.units().values() if u.status == "done" and u.n_chunks
                 and u.unit_no not in incomplete]
    summary = finish(cli, corpus, out, device)
    assert summary["units_unchanged"] == len(saved) >= 1, summary  # kept, not redone


def test_sigterm_during_overwrite_puts_the_old_index_back_and_says_so(cli, tmp_path):
    """A rebuild with --overwrite stopped by SIGTERM: the old index is back, whole, and the
    message says so (it said every finished file was saved and the run would resume)."""
    corpus = make_corpus(tmp_path / "corpus", 10, seed=5)
    out = tmp_path / "idx"
    assert build(cli, corpus, out).wait() == 0
    before = sorted(os.listdir(out / "shards"))
    run = build(cli, corpus, out, "--overwrite", "--num-workers", "1", env={"EMBEDINGEST_FI_SINK_DELAY": "1.0"})
    wait_for(lambda: ((out / ".overwritten").is_dir() and n_segments(out) >= 1) or not run.running(), 120,
             what="the old index set aside and a new shard committed")
    check_ctrl_c_stops(run, stop_bound("embedingest.jobs.build_index"), signal.SIGTERM, group=False,
                       advice="the index is as it was before this run (--overwrite puts the old one back")
    assert sorted(os.listdir(out / "shards")) == before
    assert not (out / ".overwritten").exists()
    check_exactly_once(out, expected_chunks(corpus))


def test_an_overwrite_killed_with_its_shards_committed_keeps_their_chunking(cli, tmp_path):
    """A rebuild with other --chunk-tokens killed (SIGKILL) after its first shards: the
    manifest it had written said nothing of its chunking, so the plain run that finished it
    took the default and mixed two cuts in one index without a word."""
    import json

    plain = [a for i, a in enumerate(BUILD_ARGS)  # BUILD_ARGS without their chunking
             if a not in ("--chunk-tokens", "--overlap") and BUILD_ARGS[i - 1] not in ("--chunk-tokens", "--overlap")]
    corpus = make_corpus(tmp_path / "corpus", 10, seed=6)
    out = tmp_path / "idx"
    assert build(cli, corpus, out).wait() == 0
    old = set((out / "shards").glob("*.commit.json"))
    run = cli("build-index", corpus, "--out", out, *plain, "--overwrite", "--chunk-tokens", "40", "--overlap", "8",
              "--num-workers", "1", env={"EMBEDINGEST_FI_SINK_DELAY": "1.0"})
    wait_for(lambda: set((out / "shards").glob("*.commit.json")) - old or not run.running(), 120,
             what="a shard of the rebuild committed")
    assert run.running() and (out / ".overwritten").is_dir()
    run.kill_all()
    assert json.loads((out / "manifest.json").read_text())["chunking"] == {"tokens": 40, "overlap": 8}
    refused = cli("build-index", corpus, "--out", out, *plain, "--chunk-tokens", "256")
    assert refused.wait() == 1
    assert "cuts texts into chunks of 40 tokens overlapping by 8, not 256 by 8" in refused.stderr
    assert cli("build-index", corpus, "--out", out, *plain).wait() == 0  # finished as it was cut
    assert json.loads((out / "manifest.json").read_text())["chunking"] == {"tokens": 40, "overlap": 8}
    check_exactly_once(out, expected_chunks(corpus, chunk_tokens=40, overlap=8))


@pytest.mark.parametrize("where", [["--device", "cpu"], ["--devices", "cpu,cpu"]], ids=["one", "devices"])
def test_ctrl_c_during_start_up_exits_130_without_a_traceback(cli, tmp_path, where):
    """Interrupted while importing torch, loading the model or starting device processes:
    the same exit and message as later, nothing left running."""
    corpus = make_corpus(tmp_path / "corpus", 3, seed=4)
    check_ctrl_c_during_start_up(
        lambda n: cli("build-index", corpus, "--out", tmp_path / f"idx{n}", *BUILD_ARGS, *where))


@pytest.mark.parametrize("where", [["--device", "cpu"], ["--devices", "cpu,cpu"]], ids=["one", "devices"])
def test_ctrl_c_while_children_start_is_not_lost(cli, tmp_path, where):
    """A Ctrl-C sent while the first child (consumer, device process) starts: the run ran
    on to exit 0 when it landed after multiprocessing's resource tracker unblocked SIGINT,
    or in a thread that did not block it, while SIGINT was ignored for the start."""
    corpus = make_corpus(tmp_path / "corpus", 3, seed=4)
    run = cli("build-index", corpus, "--out", tmp_path / "idx", *BUILD_ARGS, *where,
              env={"EMBEDINGEST_FI_CTRL_C_IN_CHILD_START": "1"})
    assert run.wait(60) == 130, run.describe()
    assert "interrupted:" in run.stderr and "Traceback" not in run.stderr, run.describe()
    run.assert_no_leftovers()


@pytest.mark.parametrize("device", DEVICES)
def test_disk_full_in_a_sink_fails_clearly_keeps_written_segments(cli, tmp_path, device):
    corpus = make_corpus(tmp_path / "corpus", 10, seed=3)
    out = tmp_path / "idx"
    env = {"EMBEDINGEST_FI_ENOSPC": "5", "EMBEDINGEST_FI_COUNTER": str(tmp_path / "writes"),
           "EMBEDINGEST_FI_SINK_DELAY": "0.05"}
    run = build(cli, corpus, out, env=env, device=device)
    rc = run.wait()
    assert rc == 1, run.describe()
    assert "No space left on device" in run.stderr, run.describe()
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("Error:") and "No space left on device" in last, run.describe()
    run.assert_no_leftovers()
    segments = check_index_files(out)
    # The five commits the disk took, less one the other consumer may have had under way
    # when the run stopped (on a loaded machine): abandoned whole, its files garbage the
    # next run removes. Never more, never a part of one.
    assert len(segments) in (4, 5), sorted(segments)
    assert_no_id_twice(out)
    summary = finish(cli, corpus, out, device)  # space freed: the same command again
    assert summary["units_indexed"] >= 1


def _poisoned_corpus(root: Path) -> tuple[dict[str, set[str]], str | None]:
    """Good files plus bad ones; returns {bad file key: accepted reason keywords} and the
    name to make unreadable through the fault hook (None when chmod works)."""
    rng = random.Random(7)
    make_corpus(root, 4, seed=7)
    bad: dict[str, set[str]] = {}

    def put(name: str, data: bytes, *reasons: str):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        bad[name] = set(reasons)

    put("random.txt", bytes(rng.randrange(256) for _ in range(5000)) + b"\0", "binary")
    put("zero.md", b"", "empty")
    put("truncated-png.txt", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x10\0\0", "binary")
    put("bad-utf8.txt", b"caf\xc3\xa9 ok then \x81\x8d\x90 undefined bytes", "decode")
    big = b'{"id": "big", "text": "' + b"a" * (50 * 2**20)  # one 50 MB line, never closed
    put("huge-line.jsonl", big, "json")
    put("huge-line.txt", b"word " * (10 * 2**20) + b"\x81", "decode")  # 50 MB, one line
    put("deep.json", b"[" * 200_000 + b"]" * 200_000, "json")
    put("deep.jsonl", b"[" * 200_000 + b"\n", "json")
    put("malformed.jsonl", b'{"id": 1, "text": "no end\n{broken\n[1, 2\n', "json")
    put("wrong-types.jsonl", b'{"id": 1, "text": 42}\n{"id": 2, "text": null}\n'
                             b'{"id": 3, "text": ["a", "b"]}\n{"id": 4, "body": "no text"}\n'
                             b'[1, 2, 3]\n"just a string"\n', "field", "json")
    put("wrong-type.json", b'{"id": 1, "text": {"nested": true}}', "field")
    # junk with neither NUL (the whole file would be "binary") nor the bytes cp1252 leaves
    # undefined (the rest of the file would be "decode"): one bad line between good ones
    junk = bytes(b for b in (rng.randrange(1, 256) for _ in range(3000))
                 if b not in b"\n\r\x81\x8d\x8f\x90\x9d")
    good = json.dumps({"id": "ok", "text": words(rng, 60)}).encode()
    put("junk-mixed.jsonl", good + b"\n" + junk + b"\n" + good.replace(b'"ok"', b'"ok2"') + b"\n",
        "json", "decode")
    # a broken \ud83d escape: that record alone is skipped, the ones after it are indexed
    put("surrogate.jsonl", good + b'\n{"id": "cut", "text": "half an emoji \\ud83d"}\n'
        + good.replace(b'"ok"', b'"ok3"') + b"\n", "unicode")
    records = b"".join(json.dumps({"id": i, "text": words(rng, 40)}).encode() + b"\n" for i in range(400))
    put("cut.jsonl.gz", gzip.compress(records)[:6000], "decompress")  # a download cut short
    if hasattr(os, "mkfifo"):
        os.mkfifo(root / "pipe.txt")  # reading it would wait forever
        bad["pipe.txt"] = {"not a regular file"}
    (root / "sub" / "loop").symlink_to("..")  # a folder link loop
    bad["sub/loop"] = {"symlink loop"}
    (root / "self.txt").symlink_to("self.txt")  # a file link loop
    bad["self.txt"] = {"cannot stat", "broken or looping symbolic link"}
    (root / "locked.txt").write_text(words(rng, 80))
    bad["locked.txt"] = {"unreadable"}
    hook = None
    os.chmod(root / "locked.txt", 0)
    try:
        with open(root / "locked.txt", "rb"):
            pass
        hook = "locked.txt"  # root reads it anyway: simulate EACCES in the run instead
    except PermissionError:
        pass
    return bad, hook


def test_poisoned_inputs_are_each_reported_and_every_good_file_is_indexed(cli, tmp_path):
    corpus = tmp_path / "corpus"
    bad, hook = _poisoned_corpus(corpus)
    out = tmp_path / "idx"
    run = build(cli, corpus, out, "--json", env={"EMBEDINGEST_FI_EACCES": hook} if hook else None)
    assert run.wait(240) == 3, run.describe()  # finished, some inputs skipped
    report = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    for name, reasons in bad.items():
        where = str(corpus / name)
        mine = [r for r in report if r["path"] == where or r["path"].startswith(where + ":")]
        assert mine, f"{name} is not in skipped.jsonl: {report}"
        for r in mine:
            assert any(r["reason"].startswith(k) for k in reasons), (name, r)
    os.chmod(corpus / "locked.txt", 0o644)
    expected = expected_chunks(corpus)
    expected["locked.txt"] = 0  # a unit its worker could not read: no chunks, reported
    assert expected["junk-mixed.jsonl"] >= 2 and expected["surrogate.jsonl"] >= 2  # their good records
    assert expected["cut.jsonl.gz"] >= 1  # the records before the cut
    ids = check_exactly_once(out, expected)
    assert len(ids) == sum(expected.values()) and json.loads(run.stdout)["skipped"] >= len(bad)
