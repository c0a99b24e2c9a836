"""carry_collapsed_loop_tensors: IR (FileCheck), numerics before/after on the CPU, loops
left alone, rejection (message and unchanged payload)."""

import torch

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module
from transform_ext.carry_collapsed_loop_tensors import carry_collapsed_loop_tensors

# a [1, 8] row sum over the 4 rows of x, carried as [1, 8] but read and written as [8]
ROW_SUM = """
func.func @main(%x: tensor<4x8xf32>, %init: tensor<1x8xf32>) -> tensor<1x8xf32> {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c4 = arith.constant 4 : index
  %p = arith.constant 0.0 : f32
  %r = scf.for %i = %c0 to %c4 step %c1 iter_args(%a = %init) -> (tensor<1x8xf32>) {
    %c = tensor.collapse_shape %a [[0, 1]] : tensor<1x8xf32> into tensor<8xf32>
    %acc = vector.transfer_read %c[%c0], %p {in_bounds = [true]} : tensor<8xf32>, vector<8xf32>
    %row = vector.transfer_read %x[%i, %c0], %p {in_bounds = [true]} : tensor<4x8xf32>, vector<8xf32>
    %s = arith.addf %acc, %row : vector<8xf32>
    %y = vector.transfer_write %s, %c[%c0] {in_bounds = [true]} : vector<8xf32>, tensor<8xf32>
    %e = tensor.expand_shape %y [[0, 1]] output_shape [1, 8] : tensor<8xf32> into tensor<1x8xf32>
    scf.yield %e : tensor<1x8xf32>
  }
  return %r : tensor<1x8xf32>
}
"""


def _carry(payload, names="func.func"):
    apply(payload, lambda root: carry_collapsed_loop_tensors(match(root, names)))


def test_the_tile_is_carried_collapsed():
    payload = parse(ROW_SUM)
    _carry(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: %[[INIT:.*]] = tensor.collapse_shape %arg1 {{\\[\\[}}0, 1]] : tensor<1x8xf32> into tensor<8xf32>
        CHECK: %[[R:.*]] = scf.for {{.*}} iter_args(%[[A:.*]] = %[[INIT]]) -> (tensor<8xf32>)
        CHECK-NOT: tensor.collapse_shape
        CHECK: vector.transfer_read %[[A]]
        CHECK: %[[Y:.*]] = vector.transfer_write {{.*}}, %[[A]]
        CHECK: scf.yield %[[Y]] : tensor<8xf32>
        CHECK: %[[W:.*]] = tensor.expand_shape %[[R]] {{\\[\\[}}0, 1]] output_shape [1, 8] : tensor<8xf32> into tensor<1x8xf32>
        CHECK: return %[[W]] : tensor<1x8xf32>
    """)


def test_same_result_before_and_after():
    x, init = torch.randn(4, 8), torch.randn(1, 8)
    before = run_module(parse(ROW_SUM), [x, init])
    payload = parse(ROW_SUM)
    _carry(payload)
    after = run_module(payload, [x, init])
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[0], init + x.sum(0, keepdim=True))


def test_an_iter_arg_read_whole_is_left_alone():
    text = ROW_SUM.replace("%acc = vector.transfer_read %c[%c0], %p {in_bounds = [true]} : tensor<8xf32>, vector<8xf32>",
                           "%acc2 = vector.transfer_read %a[%c0, %c0], %p {in_bounds = [true, true]} : tensor<1x8xf32>, vector<1x8xf32>\n"
                           "    %acc = vector.shape_cast %acc2 : vector<1x8xf32> to vector<8xf32>")
    payload = parse(text)
    before = str(payload)
    _carry(payload)
    assert str(payload) == before


def test_rejects_a_target_loop_without_a_collapsed_iter_arg():
    text = ROW_SUM.replace("scf.yield %e : tensor<1x8xf32>", "scf.yield %a : tensor<1x8xf32>")
    payload = parse(text)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: carry_collapsed_loop_tensors(match(root, "scf.for")))
    assert "transform_ext.carry_collapsed_loop_tensors: scf.for" in message
    assert "no tensor iter_arg is read only through tensor.collapse_shape" in message
    assert str(payload) == before
