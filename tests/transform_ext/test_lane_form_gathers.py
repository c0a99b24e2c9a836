"""lane_form_gathers: the target gather x[i, t_i] runs over [4, 16] with its class index
clamped into [0, 16), reduced by max over the lanes (FileCheck, same numbers on the CPU);
ops without a gather are left alone; a gather inside a loop over the classes is refused."""

import torch
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.lane_form_gathers import lane_form_gathers
from transform_ext.match_loss_kernels import match_loss_kernels
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.loss_payloads import LOSS, loss_inputs, loss_reference
from tests.transform_ext.numeric import run_module
from tests.transform_ext.test_hoist_row_gathers import WEIGHTED


def test_the_target_gather_in_lane_form():
    payload = parse(LOSS)
    apply(payload, lambda root: transform.AnnotateOp(lane_form_gathers(
        match_loss_kernels(match(root, "func.func")).rows, lanes=16), "lanes"))
    check(str(payload), """
        CHECK: %[[T:[0-9]+]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<4xi64>)
        CHECK: %[[LANES:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel", "parallel"]} ins(%[[T]] : tensor<4xi64>) outs(%{{.*}} : tensor<4x16xf32>) attrs =  {lanes}
        CHECK: %[[ROW:[0-9]+]] = linalg.index 0
        CHECK: %[[J:[0-9]+]] = arith.index_cast
        CHECK: %[[LOW:[0-9]+]] = arith.maxsi %[[J]], %{{.*}} : index
        CHECK: %[[C15:.*]] = arith.constant 15 : index
        CHECK: %[[IN:[0-9]+]] = arith.minsi %[[LOW]], %[[C15]] : index
        CHECK: tensor.extract %arg0[%[[ROW]], %[[IN]]] : tensor<4x16xf32>
        CHECK: %[[XT:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel", "reduction"]} ins(%[[LANES]] : tensor<4x16xf32>)
        CHECK: arith.maximumf
        CHECK: linalg.generic {{.*}} ins(%{{.*}}, %{{.*}}, %{{.*}}, %[[XT]] : tensor<4xi8>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>)
    """)
    assert str(payload).count("attrs =  {lanes}") == 1
    x, y = loss_inputs()
    got = run_module(payload, [x, y])
    want = loss_reference(x, y)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_rejects_a_gather_inside_a_loop_over_the_classes():
    payload = parse(WEIGHTED)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: lane_form_gathers(match(root, "linalg.generic"), lanes=16))
    assert "transform_ext.lane_form_gathers: linalg.generic" in message
    assert "gathers inside a loop over the classes" in message
    assert str(payload) == before
