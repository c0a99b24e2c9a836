"""The payload rewrites the cross-entropy schedule is built from, each on a small payload:
the IR it produces (FileCheck) and the numbers it computes (against torch)."""

import torch
from torch_mlir import ir

from schedules.class_reductions import split_affine_reduction, split_class_reduction
from schedules.common import run_passes
from tests.transform_ext.helpers import check, parse
from tests.transform_ext.numeric import run_module


def _func(payload):
    return next(op.operation for op in payload.body.operations if op.operation.name == "func.func")


def _ops(payload, name="linalg.generic"):
    return [op.operation for op in _func(payload).regions[0].blocks[0].operations
            if op.operation.name == name]


SMOOTHING = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#col = affine_map<(d0, d1) -> (d1)>
func.func @main(%x: tensor<4x8xf32>, %m: tensor<4xf32>, %ll: tensor<4xf32>, %w: tensor<8xf32>) -> tensor<4xf32> {
  %zero = arith.constant 0.0 : f32
  %e1 = tensor.empty() : tensor<4xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %s = linalg.generic {indexing_maps = [#id, #row, #row, #col, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x, %m, %ll, %w : tensor<4x8xf32>, tensor<4xf32>, tensor<4xf32>, tensor<8xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32, %v: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %lp = arith.subf %d, %c : f32
    %t = arith.mulf %lp, %v : f32
    %n = arith.negf %t : f32
    %r = arith.addf %n, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %s : tensor<4xf32>
}
"""


def test_affine_class_sum_is_split_into_sums_that_do_not_read_the_row_values():
    """-sum_c w_c (x_c - m - ll) = -sum_c w_c x_c + m sum_c w_c + ll sum_c w_c."""
    payload = parse(SMOOTHING)
    args = list(_func(payload).regions[0].blocks[0].arguments)
    atoms = {args[1], args[2]}
    with payload.context, ir.Location.unknown():
        assert split_affine_reduction(_ops(payload)[0], lambda v: v in atoms)
    run_passes(payload, "canonicalize, cse")
    reductions = [op for op in _ops(payload) if "reduction" in str(op.attributes["iterator_types"])]
    for op in reductions:
        assert all(v not in atoms for v in op.operands)
    x, m, ll, w = torch.randn(4, 8) * 10, torch.randn(4), torch.rand(4), torch.rand(8)
    want = -((x - m[:, None] - ll[:, None]) * w).sum(1)
    (got,) = run_module(payload, [x, m, ll, w])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_non_affine_sum_is_left_alone():
    payload = parse(SMOOTHING.replace("%t = arith.mulf %lp, %v : f32", "%t = arith.mulf %lp, %lp : f32"))
    args = list(_func(payload).regions[0].blocks[0].arguments)
    with payload.context, ir.Location.unknown():
        assert not split_affine_reduction(_ops(payload)[0], lambda v: v in (args[1], args[2]))
    assert len(_ops(payload)) == 1


def test_sum_over_rows_and_classes_is_split_per_row():
    payload = parse("""
    #id = affine_map<(d0, d1) -> (d0, d1)>
    #all = affine_map<(d0, d1) -> ()>
    func.func @main(%x: tensor<4x8xf32>) -> tensor<f32> {
      %zero = arith.constant 1.5 : f32
      %e = tensor.empty() : tensor<f32>
      %z = linalg.fill ins(%zero : f32) outs(%e : tensor<f32>) -> tensor<f32>
      %s = linalg.generic {indexing_maps = [#id, #all], iterator_types = ["reduction", "reduction"]}
          ins(%x : tensor<4x8xf32>) outs(%z : tensor<f32>) {
      ^bb0(%a: f32, %o: f32):
        %r = arith.addf %a, %o : f32
        linalg.yield %r : f32
      } -> tensor<f32>
      return %s : tensor<f32>
    }
    """)
    with payload.context, ir.Location.unknown():
        assert split_class_reduction(_ops(payload)[0], 1)
    check(str(payload), """
        CHECK: iterator_types = ["parallel", "reduction"]
        CHECK: iterator_types = ["reduction"]
    """)
    x = torch.randn(4, 8)
    (got,) = run_module(payload, [x])
    torch.testing.assert_close(got, x.sum() + 1.5)
