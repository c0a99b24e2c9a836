"""expand_fast_exp: the IR it produces (FileCheck), its accuracy and edge values against
torch's exp in f64, and the rejection of a targeted exp on vectors."""

import math

import numpy as np
import torch

from schedules.common import match
from transform_ext.expand_fast_exp import expand_fast_exp
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

EXP = """
func.func @main(%x: tensor<64xf32>) -> tensor<64xf32> {
  %e = tensor.empty() : tensor<64xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>],
                       iterator_types = ["parallel"]} ins(%x : tensor<64xf32>) outs(%e : tensor<64xf32>) {
  ^bb0(%a: f32, %o: f32):
    %y = math.exp %a : f32
    linalg.yield %y : f32
  } -> tensor<64xf32>
  return %r : tensor<64xf32>
}
"""


def test_exp_becomes_a_polynomial_scaled_by_exponent_bits():
    """The flushing variant of the one expansion: one fma rounds k, no compare, no select, no
    float-int conversion, one scaling."""
    payload = parse(EXP)
    apply(payload, lambda root: expand_fast_exp(match(root, "func.func")))
    check(str(payload), """
        CHECK: ^bb0(%[[X:.*]]: f32, %{{.*}}: f32):
        CHECK: %[[LO:.*]] = arith.maximumf %[[X]], %{{.*}} : f32
        CHECK: %[[XC:.*]] = arith.minimumf %[[LO]], %{{.*}} : f32
        CHECK: %[[S:.*]] = math.fma %[[XC]], %{{.*}}, %{{.*}} : f32
        CHECK: %[[K:.*]] = arith.subf %[[S]], %{{.*}} : f32
        CHECK-COUNT-8: math.fma
        CHECK: %[[BITS:.*]] = arith.bitcast %[[S]] : f32 to i32
        CHECK: %[[SH:.*]] = arith.shli %[[BITS]]
        CHECK: %[[E:.*]] = arith.addi %[[SH]]
        CHECK: %[[SCALE:.*]] = arith.bitcast %[[E]] : i32 to f32
        CHECK: %[[Y:.*]] = math.fma %{{.*}}, %[[SCALE]], %{{.*}} : f32
        CHECK-NEXT: linalg.yield %[[Y]]
        CHECK-NOT: math.exp
    """)
    body = str(payload)
    for absent in ("arith.cmpf", "arith.select", "arith.fptosi", "math.roundeven"):
        assert absent not in body, absent
    assert body.count("math.fma") == 10 and "arith.mulf" not in body


def _ulp_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    spacing = torch.from_numpy(np.spacing(want.float().abs().numpy())).double()
    return (got.double() - want).abs() / spacing


def test_accuracy_in_ulp_and_edges():
    """About one ulp on every normal result; exactly 0 below 2^-125.5 (x < -86.99, -inf
    included); +inf past ln(FLT_MAX) = 88.7228; NaN for NaN; e^+-0 = 1."""
    flush_below = -125.5 * math.log(2.0)  # -86.988
    special = [-float("inf"), -1e4, -104.0, -87.5, -87.0, -86.99, -86.98, -86.7, -86.6, -50.5,
               -20.25, -1e-3, -1e-30, -0.0, 0.0, 1e-30, 0.5, 1.0, 10.0, 88.0, 88.72, 88.7228,
               88.7229, 88.73, 88.75, 89.0, 1e4, float("inf"), float("nan")]
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(special), torch.linspace(-86.98, 88.72, 4096 - len(special)),
                   torch.randn(4096, generator=g) * 4]).float()
    payload = parse(EXP.replace("64xf32", f"{x.numel()}xf32"))
    apply(payload, lambda root: expand_fast_exp(match(root, "func.func")))
    (got,) = run_module(payload, [x])
    want = torch.exp(x.double())
    normal = (x > flush_below) & (want < 3.4028234663852886e38)
    err = _ulp_error(got[normal], want[normal])
    assert err.max().item() <= 1.5, (err.max().item(), x[normal][err.argmax()].item())
    assert (got[x < flush_below] == 0).all()
    assert (got[x == -float("inf")] == 0).all()
    assert torch.isinf(got[x >= 88.7229]).all() and (got[x >= 88.7229] > 0).all()
    assert torch.isfinite(got[x == 88.7228]).all()
    assert torch.isnan(got[x.isnan()]).all()
    assert (got[x == 0] == 1.0).all()  # +0 and -0


VECTOR_EXP = """
func.func @main(%x: vector<8xf32>, %h: f16) -> (vector<8xf32>, f16) {
  %y = math.exp %x : vector<8xf32>
  %z = math.exp %h : f16
  return %y, %z : vector<8xf32>, f16
}
"""


def test_a_targeted_exp_on_vectors_is_refused():
    payload = parse(VECTOR_EXP)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: expand_fast_exp(match(root, "math.exp")))
    assert "transform_ext.expand_fast_exp: math.exp at" in message
    assert "exp on vector<8xf32>: only scalar f32 is expanded" in message
    assert str(payload) == before


def test_nested_exps_on_other_types_are_left_alone():
    payload = parse(VECTOR_EXP)
    before = str(payload)
    apply(payload, lambda root: expand_fast_exp(match(root, "func.func")))
    assert str(payload) == before


ROW_SUMS = """
func.func @main(%x: tensor<8x256xf32>) -> tensor<8xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8xf32>
  %init = linalg.fill ins(%zero : f32) outs(%e : tensor<8xf32>) -> tensor<8xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>, affine_map<(d0, d1) -> (d0)>],
                       iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<8x256xf32>) outs(%init : tensor<8xf32>) {
  ^bb0(%a: f32, %acc: f32):
    %y = math.exp %a : f32
    %s = arith.addf %y, %acc : f32
    linalg.yield %s : f32
  } -> tensor<8xf32>
  return %r : tensor<8xf32>
}
"""


def test_a_sum_of_exps_vectorizes_without_a_contraction():
    """The expansion's last product is an fma with -0.0: the vectorized sum of exps stays an
    add reduction (a final mulf would become a vector.contract, lowered lane by lane)."""
    from lighthouse.compile import cleanup
    from lighthouse.pipeline import Pipeline, Stage
    from schedules.generic import GenericParams, fuse_generic, vectorize_generic

    payload = parse(ROW_SUMS)
    apply(payload, lambda root: expand_fast_exp(match(root, "func.func")))
    params = GenericParams(threads=1)
    Pipeline([Stage("cleanup", cleanup), Stage("fuse", lambda m: fuse_generic(m, params)),
              Stage("vectorize", lambda m: vectorize_generic(m, params))]).run(payload)
    text = str(payload)
    assert "vector.contract" not in text
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 4
    payload = parse(ROW_SUMS)
    apply(payload, lambda root: expand_fast_exp(match(root, "func.func")))
    (got,) = run_module(payload, [x])
    torch.testing.assert_close(got.double(), torch.exp(x.double()).sum(1), rtol=1e-6, atol=0)


def test_nesting_targets_expand_each_exp_once():
    """The function and the generic inside it, both targeted: one expansion of the exp
    (the attention's key loops, a loop and a loop inside it, are such targets)."""
    from torch_mlir.dialects import transform

    payload = parse(EXP)
    apply(payload, lambda root: expand_fast_exp(transform.MergeHandlesOp(
        [match(root, "func.func"), match(root, "linalg.generic")]).result))
    body = str(payload)
    assert "math.exp" not in body and body.count("math.fma") == 10
