"""A schedule that fails on a payload it took: the next family compiles it, with a note
naming the failure (generic after a specialized family, scalar loops after generic);
under strict the failure is the error."""

import pytest

import schedules.attention
import schedules.generic
from lighthouse.compile import compile_kernel
from lighthouse.errors import StageError
from tests.conftest import EXAMPLES

ATTENTION = dict(B=1, H=2, S=24, D=8)


def _broken(*args, **kwargs):
    raise RuntimeError("a bug in the schedule")


def test_a_failing_specialized_schedule_falls_back_to_generic(monkeypatch):
    monkeypatch.setattr(schedules.attention, "fuse_attention", _broken)
    compiled = compile_kernel(EXAMPLES / "attention.py", overrides=ATTENTION)
    assert compiled.family.name == "generic"
    assert compiled.notes == ["the attention schedule failed on this payload (stage 'fuse' "
                              "failed: a bug in the schedule); using the generic schedule"]
    for r in compiled.check():
        assert r.ok, str(r)


def test_a_failing_generic_schedule_falls_back_to_loops(monkeypatch):
    monkeypatch.setattr(schedules.generic, "vectorize_generic", _broken)
    compiled = compile_kernel(EXAMPLES / "softmax.py", overrides={"N": 5, "C": 33})
    assert compiled.family.name == "loops"
    assert "the generic schedule failed on this payload (stage 'vectorize' failed: a bug in " \
           "the schedule); using the loops schedule" in compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)


def test_under_strict_the_failure_is_the_error(monkeypatch):
    monkeypatch.setattr(schedules.attention, "fuse_attention", _broken)
    with pytest.raises(StageError, match="stage 'fuse' failed: a bug in the schedule"):
        compile_kernel(EXAMPLES / "attention.py", overrides=ATTENTION, strict=True)
