"""Consumers skip the parent's main script unless their sink factory needs it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from multiprocessing import spawn

import pytest
from engine_sinks import HashSinkFactory, PicklesOnce, slow_sink_factory

from embedingest.engine.lean_spawn import needs_main, spawning_without_main

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _DefinedHere:
    """A factory whose class a script would define: pickled by the module it lives in."""

    def __call__(self, worker):
        return print


def test_a_factory_from_a_package_needs_no_main_and_one_from_the_script_does(monkeypatch):
    assert not needs_main(HashSinkFactory((0.0, 0.1)))
    assert not needs_main(slow_sink_factory)
    monkeypatch.setattr(_DefinedHere, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "_DefinedHere", _DefinedHere, raising=False)
    assert needs_main(_DefinedHere())
    assert needs_main(HashSinkFactory((_DefinedHere(),)))  # held inside a package's factory
    assert needs_main(lambda worker: print)  # cannot be pickled: the start says why, as before
    monkeypatch.setattr(PicklesOnce, "allowed", 0)
    assert needs_main(PicklesOnce())


def test_only_the_thread_inside_the_block_drops_the_main_entries(monkeypatch):
    """The preparation data a spawned child gets loses its main-module entries for the
    thread in the block alone; another thread spawning meanwhile gets them, and after the
    block this one does too."""
    main = type(sys)("__main__")
    main.__file__ = "/jobs/run.py"
    monkeypatch.setitem(sys.modules, "__main__", main)
    seen = {}

    def other():
        seen["other"] = spawn.get_preparation_data("other")

    with spawning_without_main(True):
        inside = spawn.get_preparation_data("inside")
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert "init_main_from_path" not in inside and inside["sys_path"] == sys.path
    assert seen["other"]["init_main_from_path"] == "/jobs/run.py"
    assert spawn.get_preparation_data("after")["init_main_from_path"] == "/jobs/run.py"
    with spawning_without_main(False):
        assert spawn.get_preparation_data("kept")["init_main_from_path"] == "/jobs/run.py"


SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    with open({marker!r}, "a") as fh:  # what a script's heavy imports stand for
        fh.write("imported\\n")
    import numpy as np
    from embedingest import EgressEngine
    from engine_sinks import HashSinkFactory

    class ScriptSinkFactory(HashSinkFactory):
        pass

    def main():
        factory = ScriptSinkFactory() if sys.argv[1] == "script" else HashSinkFactory()
        with EgressEngine(factory, num_consumers=3, num_slots=4, device="cpu") as e:
            for i in range(12):
                e.submit(i, {{"x": np.full((8,), i, np.float32)}})
        print(sum(r["count"] for r in e.closed_results))

""")


def _run(tmp_path, factory: str, guarded: bool):
    marker = tmp_path / "imports.txt"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=TESTS, marker=str(marker))
                      + ('if __name__ == "__main__":\n    main()\n' if guarded else "main()\n"))
    done = subprocess.run([sys.executable, str(script), factory], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    return done, marker.read_text().splitlines(), script


@pytest.mark.parametrize("factory, guarded, imports", [("package", True, 1), ("package", False, 1),
                                                      ("script", True, 4)])
def test_consumers_import_the_main_script_only_for_a_factory_defined_there(tmp_path, factory, guarded, imports):
    """A script's top level runs once with a package's sink factory (the parent's own
    import), guarded or not, and once more in each of the 3 consumers with a factory the
    script defines; the runs hand all 12 batches to the sinks."""
    done, imported, _ = _run(tmp_path, factory, guarded)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["12"]
    assert imported == ["imported"] * imports


def test_an_unguarded_script_with_its_own_factory_is_told_to_add_the_guard(tmp_path):
    """Its consumers import it to find the factory, and each would start the run again:
    the consumer refuses, and the run stops naming the script and the guard."""
    done, imported, script = _run(tmp_path, "script", guarded=False)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("embedingest.errors.ConsumerDied: consumer ") and \
        "it ended before it started" in last and \
        f'if {script} starts the run outside `if __name__ == "__main__":`, put it under that guard' in last, last
    assert (f"ConfigError: EgressEngine() was called while a process it started was importing {script}"
            in done.stderr)
    assert imported[0] == "imported" and len(imported) >= 2
