"""NVTX ranges: each kind's colour, the domain, the no-op without nvtx, and the ranges the
engine marks around its steps (the consumer's sink range: test_consumers.py)."""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest

from embedingest.engine import markers


class Recorder:
    """Stands for the ``nvtx`` module: keeps what each ``annotate`` was given."""

    def __init__(self):
        self.calls = []

    def annotate(self, name, **kw):
        self.calls.append((name, kw))
        return contextlib.nullcontext(name)


def test_each_kind_has_its_colour_and_every_range_is_in_embedingest_s_domain(monkeypatch):
    nvtx = Recorder()
    monkeypatch.setattr(markers, "_nvtx", nvtx)
    assert markers.COLORS == {"submit": "blue", "copy": "yellow", "handoff": "cyan", "sink": "green",
                              "compute": "purple", "load": "red"}
    for kind in markers.COLORS:
        with markers.annotate(f"step {kind}", kind) as entered:
            assert entered == f"step {kind}"
    markers.annotate("no kind given")
    markers.annotate("unknown kind", "other")
    assert nvtx.calls == [(f"step {kind}", {"color": color, "domain": "embedingest"})
                          for kind, color in markers.COLORS.items()] + [
        ("no kind given", {"color": "blue", "domain": "embedingest"}),
        ("unknown kind", {"color": "white", "domain": "embedingest"})]


def test_without_nvtx_a_range_is_a_no_op(monkeypatch):
    monkeypatch.setattr(markers, "_nvtx", None)
    mark = markers.annotate("anything", "sink")
    assert isinstance(mark, contextlib.nullcontext)
    with mark as entered:
        assert entered is None


@pytest.mark.parametrize("setting,off", [("0", True), ("1", False), (None, False)])
def test_embedingest_nvtx_0_turns_the_ranges_off(setting, off):
    pytest.importorskip("nvtx")
    env = {k: v for k, v in os.environ.items() if k != "EMBEDINGEST_NVTX"}
    if setting is not None:
        env["EMBEDINGEST_NVTX"] = setting
    code = "import embedingest.engine.markers as m; print(m._nvtx is None, getattr(m._nvtx, '__name__', None))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == (["True", "None"] if off else ["False", "nvtx"])


def test_the_engine_marks_each_submit_copy_wait_and_handoff(monkeypatch, no_leaks):
    """Per batch: its submit (named after it, cut to 64 characters) around its copy, then
    the wait for the copy and the hand-off to a consumer."""
    from engine_sinks import HashSinkFactory

    from embedingest import EgressEngine
    from embedingest.engine import egress

    marks = []
    real = egress.annotate
    monkeypatch.setattr(egress, "annotate", lambda name, kind: marks.append((name, kind)) or real(name, kind))
    long_id = "b" * 100
    with EgressEngine(HashSinkFactory(), num_consumers=1, device="cpu") as engine:
        for batch_id in ("a", long_id):
            engine.submit(batch_id, {"x": np.zeros((2, 3), np.float32)})
    assert collections.Counter(marks) == collections.Counter({
        ("submit 'a'", "submit"): 1, (f"submit '{long_id}"[:64], "submit"): 1, ("copy", "copy"): 2,
        ("wait copy", "handoff"): 2, ("handoff", "handoff"): 2})
    submits = [i for i, m in enumerate(marks) if m[1] in ("submit", "copy")]
    assert [marks[i] for i in submits] == [("submit 'a'", "submit"), ("copy", "copy"),
                                           (f"submit '{long_id}"[:64], "submit"), ("copy", "copy")]
