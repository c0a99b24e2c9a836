"""A schedule that fails on a payload it took: the next family compiles it, with a note
naming the failure (generic after a specialized family, scalar loops after generic);
under strict the failure is the error."""

import pytest

import schedules.attention
import transform_ext.tile_to_vector_tiles
from lighthouse.compile import compile_kernel
from lighthouse.errors import StageError
from tests.conftest import EXAMPLES

ATTENTION = dict(B=1, H=2, S=24, D=8)


def _broken(*args, **kwargs):
    raise RuntimeError("a bug in the schedule")


def test_a_failing_specialized_schedule_falls_back_to_generic(monkeypatch):
    monkeypatch.setattr(schedules.attention, "attention_script", _broken)
    compiled = compile_kernel(EXAMPLES / "attention.py", overrides=ATTENTION)
    assert compiled.family.name == "generic"
    assert compiled.notes == ["the attention schedule failed on this payload (stage 'fuse' "
                              "failed: a bug in the schedule); using the generic schedule"]
    for r in compiled.check():
        assert r.ok, str(r)


def test_a_failing_generic_schedule_falls_back_to_loops(monkeypatch):
    # a bug inside a transform op of the generic script's @vectorize, raised at apply time
    monkeypatch.setattr(transform_ext.tile_to_vector_tiles, "tile_plan", _broken)
    compiled = compile_kernel(EXAMPLES / "softmax.py", overrides={"N": 5, "C": 33})
    assert compiled.family.name == "loops"
    assert "the generic schedule failed on this payload (stage 'vectorize' failed: a bug in " \
           "the schedule); using the loops schedule" in compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)


def test_under_strict_the_failure_is_the_error(monkeypatch):
    monkeypatch.setattr(schedules.attention, "attention_script", _broken)
    with pytest.raises(StageError, match="stage 'fuse' failed: a bug in the schedule"):
        compile_kernel(EXAMPLES / "attention.py", overrides=ATTENTION, strict=True)


# a class sum of (z - max z)^2 beside a log-softmax: the row max enters it additively,
# which the fused loop's online correction (a factor exp(m_old - m_new)) cannot rescale
NOT_SEPARABLE = """
import torch
import torch.nn.functional as F

class Model(torch.nn.Module):
    def forward(self, x0, x1):
        z = torch.log(x0.abs() + 1.0) * x1
        return F.log_softmax(z, dim=0) + ((z - z.amax(0, keepdim=True)) ** 2).sum(0, keepdim=True)

def get_inputs():
    return [torch.randn(130), torch.randn(130)]

def get_init_inputs():
    return []
"""


def test_a_transform_failure_note_is_one_clean_line(monkeypatch, kernel_file):
    """A transform op's silenceable failure reaches the note without its locations and
    without the notes MLIR appends ("...at loc(unknown): at loc(unknown):
    TransformOpInterfaceFallbackModel: silenceable failure")."""
    import schedules.cross_entropy

    monkeypatch.setattr(schedules.cross_entropy, "check", lambda module, params=None: None)
    compiled = compile_kernel(kernel_file(NOT_SEPARABLE), backward=True)
    assert compiled.family.name == "generic"
    assert compiled.notes[0] == (
        "the cross_entropy schedule failed on this payload (stage 'fuse' failed: "
        "transform_ext.fuse_dependent_reduction_ops: linalg.generic: E is not separable in "
        "the reduction result: arith.mulf does not keep a separable dependence on the "
        "reduction result); using the generic schedule")
    assert all("\n" not in note and "loc(" not in note for note in compiled.notes)
    for r in compiled.check():
        assert r.ok, str(r)


def test_the_check_reason_is_one_clean_line(kernel_file):
    compiled = compile_kernel(kernel_file(NOT_SEPARABLE), backward=True)
    assert compiled.notes[0] == (
        "the cross_entropy schedule does not apply (transform_ext.fuse_dependent_reduction_ops: "
        "linalg.generic: E is not separable in the reduction result: arith.mulf does not keep "
        "a separable dependence on the reduction result); using the generic schedule")
    assert all("\n" not in note and "loc(" not in note for note in compiled.notes)


def test_failure_reason_drops_locations_and_appended_notes():
    from transform_ext.common import failure_reason

    raw = ('Failed to apply named transform sequence.\nDiagnostic message at loc("/k.py":15:0): '
           'transform_ext.fuse_dependent_reduction_ops: linalg.generic at loc(callsite("/k.py"'
           ':15:0 at "/m.py":3:1)): E is not separable in the reduction result: its terms '
           'depend on it additively, not as a factorat loc(unknown): at loc(unknown): '
           'TransformOpInterfaceFallbackModel: silenceable failure\nat loc(unknown): see '
           'current operation: %4 = "transform_ext.fuse_dependent_reduction_ops"(%3, %2)')
    assert failure_reason(raw) == (
        "transform_ext.fuse_dependent_reduction_ops: linalg.generic: E is not separable in the "
        "reduction result: its terms depend on it additively, not as a factor")
    assert failure_reason("error: 'tensor.cast' op is bad\nmore") == "'tensor.cast' op is bad"
