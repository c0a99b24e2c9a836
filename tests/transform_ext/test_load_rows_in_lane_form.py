"""load_rows_in_lane_form: the row ops read the targets y through a [4, 16] lane gather
reduced by max over the lanes (FileCheck, same numbers on the CPU); ops outside the targets
(the host check) and the [4, 16] logits are left alone; a target that is not in a
function is refused."""

import torch
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.load_rows_in_lane_form import load_rows_in_lane_form
from transform_ext.match_loss_kernels import match_loss_kernels
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.loss_payloads import LOSS, loss_inputs, loss_reference
from tests.transform_ext.numeric import run_module


def test_the_row_ops_read_the_targets_in_lane_form():
    payload = parse(LOSS)
    apply(payload, lambda root: transform.AnnotateOp(load_rows_in_lane_form(
        match_loss_kernels(match(root, "func.func")).rows, rows=4, lanes=16), "lanes"))
    check(str(payload), """
        CHECK: %[[LANES:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel", "parallel"]} outs(%{{.*}} : tensor<4x16xi64>) attrs =  {lanes}
        CHECK: %[[ROW:[0-9]+]] = linalg.index 0
        CHECK: tensor.extract %arg1[%[[ROW]]] : tensor<4xi64>
        CHECK: %[[MIN:.*]] = arith.constant -9223372036854775808 : i64
        CHECK: %[[INIT:[0-9]+]] = linalg.fill ins(%[[MIN]] : i64)
        CHECK: %[[Y:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel", "reduction"]} ins(%[[LANES]] : tensor<4x16xi64>) outs(%[[INIT]] : tensor<4xi64>)
        CHECK: arith.maxsi
        CHECK: linalg.generic {{.*}} ins(%[[Y]] : tensor<4xi64>)
        CHECK: linalg.generic {{.*}} ins(%{{.*}}, %[[Y]] : tensor<4xi8>, tensor<4xi64>)
    """)
    assert str(payload).count("tensor.extract %arg1") == 1
    x, y = loss_inputs()
    got = run_module(payload, [x, y])
    want = loss_reference(x, y)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_rejects_a_target_outside_a_function_body():
    payload = parse(LOSS)
    message = apply_expect_failure(payload, lambda root: load_rows_in_lane_form(
        match(root, "func.func"), rows=4, lanes=16))
    assert "transform_ext.load_rows_in_lane_form: func.func" in message
    assert "not in a func.func" in message
