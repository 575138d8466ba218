"""The test harness itself: subprocesses import the checkout under test, and the fault
hooks each work on their own."""

from __future__ import annotations

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


@pytest.mark.parametrize("var, value, patched", [
    ("EMBEDINGEST_FI_COMMIT_DELAY", "0.5", "slow_write_shard"),
    ("EMBEDINGEST_FI_ENOSPC", "3", "full_write_shard"),
])
def test_each_fault_hook_works_alone(tmp_path, var, value, patched):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDINGEST_FI_")}
    env.update({var: value, "EMBEDINGEST_FI_COUNTER": str(tmp_path / "n"),
                "PYTHONPATH": os.pathsep.join([str(HOOKS), env["PYTHONPATH"]])})
    code = "import embedingest.sinks.faiss_shards as m; print(m.write_shard.__name__)"
    assert child(code, env) == patched
    env.pop(var)
    assert child(code, env) == "write_shard"  # no variable, no patch
