"""fold_scalar_or_splat_constant: IR (FileCheck), numerics before/after on the CPU, rejection."""

import torch

from schedules.common import match
from transform_ext.fold_scalar_or_splat_constant import fold_scalar_or_splat_constant
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# x * 0.125 (splat tensor) + b (a 0-d splat) + f (a fill of %s) + s (a scalar operand),
# then * truncf(0.7071...: f64) -- the shapes of torch-mlir's imports.
SPLATS = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#scalar = affine_map<(d0, d1) -> ()>
func.func @main(%x: tensor<4x8xf32>, %st: tensor<f32>) -> tensor<4x8xf32> {
  %s = tensor.extract %st[] : tensor<f32>
  %scale = arith.constant dense<0.125> : tensor<4x8xf32>
  %bias = arith.constant dense<2.0> : tensor<f32>
  %c = arith.constant 0.70710678118654757 : f64
  %e = tensor.empty() : tensor<4x8xf32>
  %f = linalg.fill ins(%s : f32) outs(%e : tensor<4x8xf32>) -> tensor<4x8xf32>
  %r = linalg.generic {indexing_maps = [#id, #id, #scalar, #id, #scalar, #id],
                       iterator_types = ["parallel", "parallel"]}
      ins(%x, %scale, %bias, %f, %s : tensor<4x8xf32>, tensor<4x8xf32>, tensor<f32>, tensor<4x8xf32>, f32)
      outs(%e : tensor<4x8xf32>) {
  ^bb0(%in: f32, %sc: f32, %b: f32, %fi: f32, %sv: f32, %out: f32):
    %t = arith.truncf %c : f64 to f32
    %0 = arith.mulf %in, %sc : f32
    %1 = arith.addf %0, %b : f32
    %2 = arith.addf %1, %fi : f32
    %3 = arith.mulf %2, %sv : f32
    %4 = arith.mulf %3, %t : f32
    linalg.yield %4 : f32
  } -> tensor<4x8xf32>
  return %r : tensor<4x8xf32>
}
"""


def _fold(payload, names="func.func"):
    apply(payload, lambda root: fold_scalar_or_splat_constant(match(root, names)))


def test_folds_splats_fills_scalars_and_constant_casts():
    payload = parse(SPLATS)
    _fold(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-SAME: (%[[X:.*]]: tensor<4x8xf32>
        CHECK: %[[S:.*]] = tensor.extract
        CHECK-DAG: %[[T:.*]] = arith.constant 0.707106769 : f32
        CHECK-DAG: %[[SC:.*]] = arith.constant 1.250000e-01 : f32
        CHECK-DAG: %[[B:.*]] = arith.constant 2.000000e+00 : f32
        CHECK: linalg.generic
        CHECK-SAME: ins(%[[X]] : tensor<4x8xf32>)
        CHECK-NEXT: ^bb0(%[[IN:.*]]: f32, %{{.*}}: f32):
        CHECK-NEXT: %[[M:.*]] = arith.mulf %[[IN]], %[[SC]]
        CHECK-NEXT: %[[A:.*]] = arith.addf %[[M]], %[[B]]
        CHECK-NEXT: %[[A2:.*]] = arith.addf %[[A]], %[[S]]
        CHECK-NEXT: %[[M2:.*]] = arith.mulf %[[A2]], %[[S]]
        CHECK-NEXT: arith.mulf %[[M2]], %[[T]]
        CHECK-NOT: arith.truncf
    """)


def test_constant_casts_fold_only_when_rounding_to_nearest_even():
    """A truncf with the default rounding (spelled or not) folds; another rounding mode stays:
    the fold rounds to nearest, even."""
    payload = parse(SPLATS.replace("%t = arith.truncf %c :", "%t = arith.truncf %c to_nearest_even :"))
    _fold(payload)
    check(payload, """
        CHECK: arith.constant 0.707106769 : f32
        CHECK-NOT: arith.truncf
    """)
    payload = parse(SPLATS.replace("%t = arith.truncf %c :", "%t = arith.truncf %c downward :"))
    _fold(payload)
    check(payload, """
        CHECK: linalg.generic
        CHECK: arith.truncf %{{.*}} downward : f64 to f32
    """)


def test_same_result_before_and_after_and_torch():
    torch.manual_seed(0)
    x, s = torch.randn(4, 8), torch.tensor(1.5)
    before = run_module(parse(SPLATS), [x, s])
    payload = parse(SPLATS)
    _fold(payload)
    after = run_module(payload, [x, s])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    expected = ((x * 0.125 + 2.0 + s) * s) * torch.tensor(0.70710678118654757, dtype=torch.float64).float()
    torch.testing.assert_close(after[0], expected)


# The splat is the only operand indexed by d1: dropping it would lose d1's extent.
ONLY_EXTENT = """
#x = affine_map<(d0, d1) -> (d0)>
#sp = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %c = arith.constant dense<0.5> : tensor<4x8xf32>
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4xf32>
  %a = linalg.fill ins(%z : f32) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %r = linalg.generic {indexing_maps = [#x, #sp, #x], iterator_types = ["parallel", "reduction"]}
      ins(%x, %c : tensor<4xf32>, tensor<4x8xf32>) outs(%a : tensor<4xf32>) {
  ^bb0(%in: f32, %ci: f32, %acc: f32):
    %0 = arith.mulf %in, %ci : f32
    %1 = arith.addf %0, %acc : f32
    linalg.yield %1 : f32
  } -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"""


def test_rejects_folding_the_only_operand_giving_a_loop_extent():
    payload = parse(ONLY_EXTENT)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: fold_scalar_or_splat_constant(match(root, "linalg.generic")))
    assert "transform_ext.fold_scalar_or_splat_constant: linalg.generic" in message
    assert "inputs [1] hold one value but are the only operands giving the extent of a loop dim" in message
    assert str(payload) == before


def test_nested_generic_that_cannot_fold_is_left_alone():
    payload = parse(ONLY_EXTENT)
    before = str(payload)
    _fold(payload)
    assert str(payload) == before
    x = torch.randn(4)
    torch.testing.assert_close(run_module(payload, [x])[0], x * 4.0)
