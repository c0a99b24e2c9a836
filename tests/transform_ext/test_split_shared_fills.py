"""split_shared_fills: the zero shared by the count (before the row kernel) and the loss sum
(after it) gets a copy for the sum (FileCheck, same numbers); fills of one kernel stay; a
target that is not a function is refused."""

import torch

from schedules.common import match
from transform_ext.split_shared_fills import split_shared_fills
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.loss_payloads import LOSS, loss_inputs, loss_reference
from tests.transform_ext.numeric import run_module


def test_the_shared_zero_is_cloned_for_the_other_kernel():
    payload = parse(LOSS)
    apply(payload, lambda root: split_shared_fills(match(root, "func.func")))
    text = str(payload)
    check(text, """
        CHECK: %[[OWN:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%{{.*}} : tensor<f32>) -> tensor<f32>
        CHECK-NEXT: %[[COPY:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%{{.*}} : tensor<f32>) -> tensor<f32>
        CHECK: ins(%{{.*}} : tensor<4xi8>) outs(%[[OWN]] : tensor<f32>)
        CHECK: ins(%{{.*}} : tensor<4xf32>) outs(%[[COPY]] : tensor<f32>)
    """)
    assert text.count("linalg.fill") == 4          # the two [4] inits are not shared
    x, y = loss_inputs()
    got = run_module(payload, [x, y])
    want = loss_reference(x, y)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(LOSS)
    message = apply_expect_failure(
        payload, lambda root: split_shared_fills(match(root, "linalg.fill")))
    assert "transform_ext.split_shared_fills: linalg.fill" in message
    assert "not a func.func" in message
