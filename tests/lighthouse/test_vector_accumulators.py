"""Loop-carried reductions into vector accumulators (lighthouse.targets.vector_accumulators):
FileCheck of the rewrite on hand-written loops and of what it declines, and row reductions
compiled with it against torch (NaN, infinities, rows that do not divide the tiles, f64
accumulation, bf16)."""

import re

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


# a group norm's sum over a group's channels and pixels: two loops into a [1, 1] f64
GROUP_SUM = """
func.func @group_sum(%in: memref<4x32x64xf32>, %out: memref<1x1xf64>) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c4 = arith.constant 4 : index
  %c32 = arith.constant 32 : index
  %f0 = arith.constant 0.0 : f32
  %zero = arith.constant dense<0.0> : vector<1x1xf64>
  %s = scf.for %c = %c0 to %c4 step %c1 iter_args(%outer = %zero) -> (vector<1x1xf64>) {
    %t = scf.for %h = %c0 to %c32 step %c1 iter_args(%acc = %outer) -> (vector<1x1xf64>) {
      %v = vector.transfer_read %in[%c, %h, %c0], %f0 {in_bounds = [true]} : memref<4x32x64xf32>, vector<64xf32>
      %w = arith.extf %v : vector<64xf32> to vector<64xf64>
      %a = vector.extract %acc[0, 0] : f64 from vector<1x1xf64>
      %r = vector.reduction <add>, %w, %a fastmath<reassoc> : vector<64xf64> into f64
      %b = vector.broadcast %r : f64 to vector<1x1xf64>
      scf.yield %b : vector<1x1xf64>
    }
    scf.yield %t : vector<1x1xf64>
  }
  vector.transfer_write %s, %out[%c0, %c0] {in_bounds = [true, true]} : vector<1x1xf64>, memref<1x1xf64>
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


def test_a_sum_over_two_dims_into_one_element_carries_the_lanes():
    """A group norm's f64 sum over channels and pixels, carried as a vector<1x1xf64>: the
    inner loop carries the lanes (64 f64 folded in halves to four registers), and reduces
    them once per channel into the outer loop's [1, 1] (each step reduced its 64 lanes
    into it before)."""
    count, text = _rewritten(GROUP_SUM)
    assert count == 1
    filecheck(text, """
        CHECK: scf.for {{.*}} iter_args(%[[OUTER:.*]] = %{{.*}}) -> (vector<1x1xf64>)
        CHECK: %[[NEUTRAL:.*]] = arith.constant dense<0.000000e+00> : vector<32xf64>
        CHECK: %[[LANES:.*]] = scf.for {{.*}} iter_args(%[[ACC:.*]] = %[[NEUTRAL]]) -> (vector<32xf64>)
        CHECK: %[[LOW:.*]] = vector.extract_strided_slice %{{.*}} {offsets = [0], sizes = [32]
        CHECK: %[[HIGH:.*]] = vector.extract_strided_slice %{{.*}} {offsets = [32], sizes = [32]
        CHECK: %[[STEP:.*]] = arith.addf %[[LOW]], %[[HIGH]] : vector<32xf64>
        CHECK: %[[NEXT:.*]] = arith.addf %[[ACC]], %[[STEP]] : vector<32xf64>
        CHECK: scf.yield %[[NEXT]] : vector<32xf64>
        CHECK: %[[A:.*]] = vector.extract %[[OUTER]][0, 0] : f64 from vector<1x1xf64>
        CHECK-NEXT: %[[R:.*]] = vector.reduction <add>, %[[LANES]], %[[A]] fastmath<reassoc> : vector<32xf64> into f64
        CHECK-NEXT: %[[B:.*]] = vector.broadcast %[[R]] : f64 to vector<1x1xf64>
        CHECK-NEXT: scf.yield %[[B]] : vector<1x1xf64>
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
    (GROUP_SUM, ("vector<1x1xf64>) {\n      %v", "vector<1x1xf64>) {\n      %x = vector.extract %acc[0, 0] : f64 from vector<1x1xf64>\n      memref.store %x, %out[%c0, %c0] : memref<1x1xf64>\n      %v"),
     "the carried [1, 1] is read again"),
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


GROUP = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = NORM
        with torch.no_grad():
            self.norm.weight.normal_(); self.norm.bias.normal_()
    def forward(self, x):
        return self.norm(x)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g) * 3 + 100
    return [x]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("norm, shape, carried", [
    ("torch.nn.GroupNorm(4, 8)", "3, 8, 16, 64", True),     # KernelBench 35's form
    ("torch.nn.InstanceNorm2d(5, affine=True)", "2, 5, 9, 130", True),
    # rows of 37 f64 (296 bytes, odd: no halving fits four registers) stay reduced per step
    ("torch.nn.GroupNorm(3, 6)", "2, 6, 7, 37", False),
])
def test_group_and_instance_norms_carry_their_sums_in_vectors(kernel_file, norm, shape, carried):
    """A group norm's and an instance norm's f64 sums of x and x^2 over several dims
    (carried as [1, 1] vectors) carry f64 lanes in their loops; the results match torch on
    inputs of mean 100 (a variance from E[x^2] - E[x]^2, which needs the f64 sums)."""
    path = kernel_file(GROUP.replace("NORM", norm).replace("SHAPE", shape))
    lowered = str(compile_kernel(path, stop_after="bufferize").module)
    lanes = re.search(r"scf\.for .* -> \(vector<\d+xf64>, vector<\d+xf64>\)", lowered)
    assert bool(lanes) == carried
    for report in compile_kernel(path).check():
        assert report.ok, str(report)

