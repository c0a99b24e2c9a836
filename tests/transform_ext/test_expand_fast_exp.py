"""expand_fast_exp: the IR it produces (FileCheck), its accuracy and edge values against
torch's exp in f64, and the rejection of a targeted exp on vectors."""

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
    payload = parse(EXP)
    apply(payload, lambda root: expand_fast_exp(match(root, "func.func")))
    check(str(payload), """
        CHECK: ^bb0(%[[X:.*]]: f32, %{{.*}}: f32):
        CHECK: %[[LO:.*]] = arith.maximumf %[[X]], %{{.*}} : f32
        CHECK: %[[XC:.*]] = arith.minimumf %[[LO]], %{{.*}} : f32
        CHECK: %[[T:.*]] = arith.mulf %[[XC]], %{{.*}} : f32
        CHECK: %[[S:.*]] = arith.addf %[[T]], %{{.*}} : f32
        CHECK: %[[K:.*]] = arith.subf %[[S]], %{{.*}} : f32
        CHECK-COUNT-8: math.fma
        CHECK: %[[BITS:.*]] = arith.bitcast %[[S]] : f32 to i32
        CHECK: arith.shli %[[BITS]]
        CHECK: arith.cmpf olt, %[[X]]
        CHECK-NOT: fptosi
        CHECK-NOT: math.exp
    """)


def test_accuracy_and_edges():
    payload = parse(EXP)
    apply(payload, lambda root: expand_fast_exp(match(root, "func.func")))
    special = [-float("inf"), -1e4, -104.0, -87.0, -86.7, -86.6, -50.5, -20.25, -1e-3, -1e-30,
               0.0, 1e-30, 0.5, 1.0, 10.0, 88.0, 88.72, 88.73, 1e4, float("inf"), float("nan")]
    x = torch.cat([torch.tensor(special), torch.linspace(-86.6, 88.7, 64 - len(special))])
    (got,) = run_module(payload, [x])
    want = torch.exp(x.double())
    normal = (x > -86.6) & (x < 88.72)
    rel = ((got.double() - want) / want).abs()[normal]
    assert rel.max() < 2e-7
    assert (got[x < -86.64] == 0).all()             # flushed below 2^-125
    assert torch.isinf(got[x > 88.73]).all() and torch.isnan(got[x.isnan()]).all()
    assert got[x == 0].item() == 1.0


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
