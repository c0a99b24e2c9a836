"""Loop-carried reductions into vector accumulators (lighthouse.targets.vector_accumulators):
FileCheck of the rewrite on hand-written loops and of what it declines, and row reductions
compiled with it against torch (NaN, infinities, rows that do not divide the tiles, f64
accumulation, bf16)."""

import pytest

from lighthouse.compile import compile_kernel
from lighthouse.targets.vector_accumulators import reductions_into_vector_accumulators
from tests.conftest import ROOT
from tests.transform_ext.helpers import check as filecheck
from tests.transform_ext.helpers import rewritten

ROW_MAX = """
func.func @row_max(%in: memref<4x256xf32>, %out: memref<4xf32>) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c4 = arith.constant 4 : index
  %c64 = arith.constant 64 : index
  %c256 = arith.constant 256 : index
  %f0 = arith.constant 0.0 : f32
  %init = arith.constant dense<0xFF800000> : vector<1xf32>
  scf.for %i = %c0 to %c4 step %c1 {
    %m = scf.for %j = %c0 to %c256 step %c64 iter_args(%acc = %init) -> (vector<1xf32>) {
      %v = vector.transfer_read %in[%i, %j], %f0 {in_bounds = [true]} : memref<4x256xf32>, vector<64xf32>
      %a = vector.extract %acc[0] : f32 from vector<1xf32>
      %r = vector.reduction <maximumf>, %v, %a : vector<64xf32> into f32
      %b = vector.broadcast %r : f32 to vector<1xf32>
      scf.yield %b : vector<1xf32>
    }
    vector.store %m, %out[%i] : memref<4xf32>, vector<1xf32>
  }
  return
}
"""

ROW_SUM = """
func.func @row_sum(%in: memref<4x256xf32>, %out: memref<4xf32>) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c4 = arith.constant 4 : index
  %c64 = arith.constant 64 : index
  %c256 = arith.constant 256 : index
  %f0 = arith.constant 0.0 : f32
  scf.for %i = %c0 to %c4 step %c1 {
    %start = memref.load %out[%i] : memref<4xf32>
    %s = scf.for %j = %c0 to %c256 step %c64 iter_args(%acc = %start) -> (f32) {
      %v = vector.transfer_read %in[%i, %j], %f0 {in_bounds = [true]} : memref<4x256xf32>, vector<64xf32>
      %r = vector.reduction <add>, %v, %acc fastmath<reassoc> : vector<64xf32> into f32
      scf.yield %r : f32
    }
    memref.store %s, %out[%i] : memref<4xf32>
  }
  return
}
"""


def _rewritten(source: str) -> tuple[int, str]:
    return rewritten(source, reductions_into_vector_accumulators)


def test_a_row_max_carries_the_lanes_and_reduces_them_once():
    count, text = _rewritten(ROW_MAX)
    assert count == 1
    filecheck(text, """
        CHECK: %[[INIT:.*]] = arith.constant dense<0xFF800000> : vector<1xf32>
        CHECK: %[[NEUTRAL:.*]] = arith.constant dense<0xFF800000> : vector<64xf32>
        CHECK: %[[LANES:.*]] = scf.for {{.*}} iter_args(%[[ACC:.*]] = %[[NEUTRAL]]) -> (vector<64xf32>)
        CHECK: %[[V:.*]] = vector.transfer_read
        CHECK-NEXT: %[[M:.*]] = arith.maximumf %[[ACC]], %[[V]] : vector<64xf32>
        CHECK-NEXT: scf.yield %[[M]] : vector<64xf32>
        CHECK: %[[A:.*]] = vector.extract %[[INIT]][0]
        CHECK-NEXT: %[[R:.*]] = vector.reduction <maximumf>, %[[LANES]], %[[A]] : vector<64xf32> into f32
        CHECK-NEXT: %[[B:.*]] = vector.broadcast %[[R]] : f32 to vector<1xf32>
        CHECK-NEXT: vector.store %[[B]]
    """)


def test_a_reassociable_sum_from_a_scalar_carries_the_lanes():
    count, text = _rewritten(ROW_SUM)
    assert count == 1
    filecheck(text, """
        CHECK: %[[START:.*]] = memref.load
        CHECK: %[[LANES:.*]] = scf.for {{.*}} iter_args(%[[ACC:.*]] = %{{.*}}) -> (vector<64xf32>)
        CHECK: arith.addf %[[ACC]], %{{.*}} : vector<64xf32>
        CHECK: %[[R:.*]] = vector.reduction <add>, %[[LANES]], %[[START]] fastmath<reassoc>
        CHECK-NEXT: memref.store %[[R]]
    """)


@pytest.mark.parametrize("source, change, reason", [
    (ROW_SUM, (" fastmath<reassoc>", ""), "a sum that must keep its order"),
    (ROW_SUM, ("scf.yield %r : f32", "%t = arith.addf %r, %acc : f32\n      scf.yield %t : f32"),
     "the carried value is read again"),
    (ROW_SUM, ("scf.yield %r : f32", "memref.store %r, %out[%i] : memref<4xf32>\n      scf.yield %r : f32"),
     "each step's partial is stored"),
    (ROW_MAX, ("scf.yield %b : vector<1xf32>", "%c = arith.addf %b, %b : vector<1xf32>\n      scf.yield %c : vector<1xf32>"),
     "the yielded value is not the reduction's"),
    (ROW_MAX, ("<maximumf>", "<maxsi>"), "not a float kind"),
])
def test_reductions_that_cannot_carry_lanes_stay(source, change, reason):
    if change[1].startswith("<maxsi>"):
        source = source.replace("f32", "i32").replace("0.0 : i32", "0 : i32").replace(
            "dense<0xFF800000>", "dense<0>")
    count, text = _rewritten(source.replace(*change))
    assert count == 0, reason
    assert "-> (vector<64x" not in text


ROW = """
import torch
class Model(torch.nn.Module):
    def forward(self, x, w, b):
        return EXPRESSION
def get_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, COLUMNS, generator=g) - 4
    x[1, 5] = float("nan"); x[2, :] = float("-inf"); x[3, 7] = float("inf"); x[4] *= 1e4
    x[5] = -x[5].abs() - 1; x[6] = x[6].abs() + 1
    return [x, torch.randn(COLUMNS, generator=g), torch.randn(COLUMNS, generator=g)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("expression", [
    "x.amax(-1)", "x.amin(-1)", "x.sum(-1)", "torch.logsumexp(x, -1)", "torch.softmax(x, -1)",
    "torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b)", "x.double().sum(-1)",
    "x.bfloat16().sum(-1)"])
@pytest.mark.parametrize("columns", [4096, 1000, 33])
def test_row_reductions_with_lane_accumulators_match_torch(kernel_file, expression, columns):
    """Rows of all-negative values (a max from 0 would be wrong), of positives (a min from 0),
    with NaN, with infinities, of -inf only, of 1e4-scaled values."""
    path = kernel_file(ROW.replace("EXPRESSION", expression).replace("COLUMNS", str(columns)))
    compiled = compile_kernel(path)
    for report in compiled.check():
        assert report.ok, str(report)


def test_a_softmax_carries_its_max_and_sum_in_vectors():
    compiled = compile_kernel(ROOT / "examples" / "softmax.py", overrides={"N": 8, "C": 4096},
                              stop_after="bufferize")
    filecheck(str(compiled.module), """
        CHECK: scf.for {{.*}} -> (vector<64xf32>)
        CHECK: arith.maximumf %{{.*}} : vector<64xf32>
        CHECK: scf.for {{.*}} -> (vector<64xf32>)
        CHECK: arith.addf %{{.*}} : vector<64xf32>
    """)
