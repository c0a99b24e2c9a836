"""lane_form_row_reductions: the count reads y in its body, the loss sum reads a [4, 16] f32
lane copy of the per-row losses, both over [4, 16] counting lane 0 only (FileCheck, same
numbers on the CPU); a reduction the row kernel reads that reads a per-row value itself is
refused."""

import torch

from schedules.common import match
from transform_ext.inline_argument_producers import inline_argument_producers
from transform_ext.lane_form_row_reductions import lane_form_row_reductions
from transform_ext.match_loss_kernels import match_loss_kernels
from transform_ext.split_shared_fills import split_shared_fills
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.loss_payloads import LOSS, loss_inputs, loss_reference
from tests.transform_ext.numeric import run_module


def _lane_form(root):
    func = match(root, "func.func")
    split_shared_fills(func)
    inline_argument_producers(match_loss_kernels(func).row_sums, gathers=True)
    lane_form_row_reductions(match_loss_kernels(func).row_sums, rows=4, lanes=16)


def test_the_row_sums_count_lane_zero_of_lane_tiles():
    payload = parse(LOSS)
    apply(payload, _lane_form)
    check(str(payload), """
        CHECK-DAG: #[[ID:.*]] = affine_map<(d0, d1) -> (d0, d1)>
        CHECK-DAG: #[[ROW:.*]] = affine_map<(d0, d1) -> (d0)>
        CHECK-DAG: #[[ALL:.*]] = affine_map<(d0, d1) -> ()>
        CHECK: %[[LOSS:[0-9]+]] = linalg.generic {{.*}} : tensor<4xi8>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>)
        CHECK: %[[COPY:[0-9a-z_]+]] = linalg.generic {indexing_maps = [#[[ROW]], #[[ID]]], iterator_types = ["parallel", "parallel"]} ins(%[[LOSS]] : tensor<4xf32>) outs(%{{.*}} : tensor<4x16xf32>)
        CHECK: %[[WITNESS:[0-9a-z_]+]] = tensor.empty() : tensor<4x16xi8>
        CHECK: %[[COUNT:[0-9a-z_]+]] = linalg.generic {indexing_maps = [#[[ID]], #[[ALL]]], iterator_types = ["reduction", "reduction"]} ins(%[[WITNESS]] : tensor<4x16xi8>)
        CHECK: %[[LANE:[0-9a-z_]+]] = linalg.index 1
        CHECK: %[[LANE0:[0-9a-z_]+]] = arith.cmpi eq, %[[LANE]], %{{.*}} : index
        CHECK: tensor.extract %arg1[%{{.*}}] : tensor<4xi64>
        CHECK: arith.uitofp
        CHECK: %[[NEG0:[0-9a-z_]+]] = arith.constant -0.000000e+00 : f32
        CHECK: arith.select %[[LANE0]], %{{.*}}, %[[NEG0]] : f32
        CHECK: %[[SUM:[0-9a-z_]+]] = linalg.generic {{.*}} iterator_types = ["reduction", "reduction"]} ins(%[[COPY]] : tensor<4x16xf32>)
        CHECK: arith.select
        CHECK: linalg.generic {{.*}} ins(%[[SUM]], %[[COUNT]] : tensor<f32>, tensor<f32>)
    """)
    x, y = loss_inputs()
    got = run_module(payload, [x, y])
    want = loss_reference(x, y)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


CYCLE = """
#r = affine_map<(d0) -> (d0)>
#s = affine_map<(d0) -> ()>
func.func @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %zero = arith.constant 0.0 : f32
  %e4 = tensor.empty() : tensor<4xf32>
  %e0 = tensor.empty() : tensor<f32>
  %a = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%x : tensor<4xf32>) outs(%e4 : tensor<4xf32>) {
  ^bb0(%v: f32, %o: f32):
    %n = arith.negf %v : f32
    linalg.yield %n : f32
  } -> tensor<4xf32>
  %s0 = linalg.fill ins(%zero : f32) outs(%e0 : tensor<f32>) -> tensor<f32>
  %s = linalg.generic {indexing_maps = [#r, #s], iterator_types = ["reduction"]}
      ins(%a : tensor<4xf32>) outs(%s0 : tensor<f32>) {
  ^bb0(%v: f32, %o: f32):
    %r = arith.addf %v, %o : f32
    linalg.yield %r : f32
  } -> tensor<f32>
  %b = linalg.generic {indexing_maps = [#r, #s, #r], iterator_types = ["parallel"]}
      ins(%a, %s : tensor<4xf32>, tensor<f32>) outs(%e4 : tensor<4xf32>) {
  ^bb0(%v: f32, %t: f32, %o: f32):
    %r = arith.divf %v, %t : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %b : tensor<4xf32>
}
"""


def test_rejects_a_sum_the_row_kernel_reads_that_reads_a_per_row_value():
    payload = parse(CYCLE)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: lane_form_row_reductions(
        match_loss_kernels(match(root, "func.func")).row_sums, rows=4, lanes=16))
    assert "transform_ext.lane_form_row_reductions: linalg.generic" in message
    assert "reads a per-row value the row kernel has not computed yet" in message
    assert str(payload) == before
