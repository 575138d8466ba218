"""The test harness itself: subprocesses import the checkout under test, the fault
hooks each work on their own, and the /dev/shm check excuses only a half-made semaphore."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "tests" / "faults" / "hooks"


def child(code: str, env: dict | None = None, cwd=None) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_subprocesses_import_the_checkout_under_test(tmp_path):
    """Run from another folder with the environment the tests give every child: the
    package found is this checkout's, whatever an editable install points at."""
    where = child("import embedingest; print(embedingest.__file__)", cwd=tmp_path)
    assert Path(where) == ROOT / "embedingest" / "__init__.py"
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_spawned_children_import_the_checkout_too(tmp_path):
    code = ("import multiprocessing as mp, embedingest\n"
            "def where(_):\n    import embedingest; return embedingest.__file__\n"
            "if __name__ == '__main__':\n"
            "    with mp.get_context('spawn').Pool(1) as p: print(p.map(where, [0])[0])\n")
    script = tmp_path / "spawn_probe.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert Path(out.stdout.strip()) == ROOT / "embedingest" / "__init__.py", out.stderr


COMMITS = """
import errno, multiprocessing, sys, time
multiprocessing.current_process().name = "embedingest-consumer-0"  # the hooks act in consumers
import embedingest.sinks.shard_writer as m
spec = m.ShardWriterFactory(sys.argv[1], 4)
results, slowest = [], 0.0
for part in range(3):
    start = time.perf_counter()
    try:
        m.commit_finished(spec, [(part, 0)], part)
        results.append("ok")
    except OSError as exc:
        results.append(errno.errorcode[exc.errno])
    slowest = max(slowest, time.perf_counter() - start)
print(m.ShardWriter.commit.__name__, ",".join(results), slowest >= 0.5)
"""


@pytest.mark.parametrize("var, value, expected", [
    ("EMBEDINGEST_FI_COMMIT_DELAY", "0.5", ["slow_commit", "ok,ok,ok", "True"]),  # each took 0.5 s or more
    ("EMBEDINGEST_FI_ENOSPC", "2", ["full_commit", "ok,ok,ENOSPC"]),
])
def test_each_fault_hook_works_alone(tmp_path, var, value, expected):
    """Each hook patches the shard writer's commit by itself, and does what it says
    there (three commits of a consumer process: each slowed down, or the third refused);
    without its variable nothing is patched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDINGEST_FI_")}
    env.update({var: value, "EMBEDINGEST_FI_COUNTER": str(tmp_path / "n"),
                "PYTHONPATH": os.pathsep.join([str(HOOKS), env["PYTHONPATH"]])})
    out = subprocess.run([sys.executable, "-c", COMMITS, str(tmp_path / "a")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.stdout.split()[:len(expected)] == expected, out.stderr
    env.pop(var)
    out = subprocess.run([sys.executable, "-c", COMMITS, str(tmp_path / "b")], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.stdout.split()[:2] == ["commit", "ok,ok,ok"], out.stderr  # no variable, no patch


def test_cli_runs_get_ctrl_c_even_when_pytest_runs_in_the_background():
    """A child sees SIGINT at its default (Python's KeyboardInterrupt), so the Ctrl-C
    tests test the CLI, not an inherited SIG_IGN (tests/conftest.py)."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    assert child(code) == "True"


def test_only_the_two_names_of_a_semaphore_killed_in_the_making_are_excused(tmp_path):
    """The /dev/shm check lets pass exactly a pair that a kill inside glibc's sem_open
    leaves (its temporary name and a ``sem.mp-*`` name, one file); a lone semaphore, two
    separate files, or a pair under other names still count as leaked."""
    import secrets

    from fault_helpers import half_made_semaphores

    tag = secrets.token_hex(3)
    made = []

    def shm(name: str, link_to: str | None = None) -> str:
        path = os.path.join("/dev/shm", name)
        if link_to:
            os.link(os.path.join("/dev/shm", link_to), path)
        else:
            with open(path, "wb") as fh:
                fh.write(b"\0" * 32)
        made.append(path)
        return name

    try:
        temporary = shm(f"sem.{tag}")
        pair = {temporary, shm(f"sem.mp-{tag}ab", link_to=temporary)}
        lone = shm(f"sem.mp-{tag}cd")
        separate = {shm(f"sem.{tag[::-1]}"), shm(f"sem.mp-{tag}ef")}
        other = shm(f"sem.{tag[:3]}xyz")
        other_pair = {other, shm(f"psm_{tag}", link_to=other)}
        names = pair | {lone} | separate | other_pair
        assert half_made_semaphores(names) == pair
        assert half_made_semaphores(names - pair) == set()
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                os.unlink(path)
