"""interchange_lane_dims_innermost: IR (FileCheck) of a transposing copy whose lanes move to
the last loop, generics already lane-last left alone, rejection of a targeted dynamic
generic; numerics through the generic schedule against torch."""

import torch

from schedules.common import match
from transform_ext.interchange_lane_dims_innermost import interchange_lane_dims_innermost
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# y[j, i] = x[i, j] + 1 over loops (i, j): the output (the largest operand on a tie) is
# innermost along i, loop 0
TRANSPOSE = """
#x = affine_map<(d0, d1) -> (d0, d1)>
#y = affine_map<(d0, d1) -> (d1, d0)>
func.func @main(%x: tensor<48x80xf32>) -> tensor<80x48xf32> {
  %one = arith.constant 1.0 : f32
  %e = tensor.empty() : tensor<80x48xf32>
  %r = linalg.generic {indexing_maps = [#x, #y], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<48x80xf32>) outs(%e : tensor<80x48xf32>) {
  ^bb0(%a: f32, %out: f32):
    %s = arith.addf %a, %one : f32
    linalg.yield %s : f32
  } -> tensor<80x48xf32>
  return %r : tensor<80x48xf32>
}
"""


def test_the_lane_dim_becomes_the_last_loop():
    payload = parse(TRANSPOSE)
    apply(payload, lambda root: interchange_lane_dims_innermost(match(root, "func.func")))
    check(payload, """
        CHECK-DAG: #[[X:.*]] = affine_map<(d0, d1) -> (d1, d0)>
        CHECK-DAG: #[[Y:.*]] = affine_map<(d0, d1) -> (d0, d1)>
        CHECK: linalg.generic {indexing_maps = [#[[X]], #[[Y]]], iterator_types = ["parallel", "parallel"]} ins(%{{.*}} : tensor<48x80xf32>) outs(%{{.*}} : tensor<80x48xf32>)
        CHECK: arith.addf
    """)


def test_a_generic_whose_lanes_are_last_is_left_alone():
    payload = parse(TRANSPOSE)
    apply(payload, lambda root: interchange_lane_dims_innermost(match(root, "func.func")))
    once = str(payload)
    apply(payload, lambda root: interchange_lane_dims_innermost(match(root, "func.func")))
    assert str(payload) == once


def test_the_transposing_copy_matches_torch():
    x = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))
    got = run_module(parse(TRANSPOSE), [x])[0]
    assert torch.equal(got, x.t() + 1.0)


def test_rejects_a_targeted_generic_with_dynamic_loops():
    payload = parse("""
        #id = affine_map<(d0, d1) -> (d0, d1)>
        func.func @main(%x: tensor<?x8xf32>, %e: tensor<?x8xf32>) -> tensor<?x8xf32> {
          %r = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
              ins(%x : tensor<?x8xf32>) outs(%e : tensor<?x8xf32>) {
          ^bb0(%a: f32, %out: f32):
            linalg.yield %a : f32
          } -> tensor<?x8xf32>
          return %r : tensor<?x8xf32>
        }""")
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: interchange_lane_dims_innermost(match(root, "linalg.generic")))
    assert "transform_ext.interchange_lane_dims_innermost: linalg.generic at" in message
    assert "dynamic loop ranges" in message
    assert str(payload) == before
