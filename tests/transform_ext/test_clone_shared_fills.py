"""clone_shared_fills: a zero init read by two contractions becomes one fill per reader
(FileCheck, same numbers); a fill with one reader stays alone; a target that is not a
function is refused."""

import torch

from schedules.common import match
from transform_ext.clone_shared_fills import clone_shared_fills
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

TWO_PRODUCTS = """
func.func @main(%a: tensor<8x8xf32>, %b: tensor<8x8xf32>, %c: tensor<8x8xf32>) -> (tensor<8x8xf32>, tensor<8x4xf32>) {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8x8xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<8x8xf32>) -> tensor<8x8xf32>
  %e4 = tensor.empty() : tensor<8x4xf32>
  %z4 = linalg.fill ins(%zero : f32) outs(%e4 : tensor<8x4xf32>) -> tensor<8x4xf32>
  %s = linalg.matmul ins(%a, %b : tensor<8x8xf32>, tensor<8x8xf32>) outs(%z : tensor<8x8xf32>) -> tensor<8x8xf32>
  %o = linalg.matmul ins(%s, %c : tensor<8x8xf32>, tensor<8x8xf32>) outs(%z : tensor<8x8xf32>) -> tensor<8x8xf32>
  %c4 = tensor.extract_slice %c[0, 0] [8, 4] [1, 1] : tensor<8x8xf32> to tensor<8x4xf32>
  %p = linalg.matmul ins(%a, %c4 : tensor<8x8xf32>, tensor<8x4xf32>) outs(%z4 : tensor<8x4xf32>) -> tensor<8x4xf32>
  %r = linalg.add ins(%o, %o : tensor<8x8xf32>, tensor<8x8xf32>) outs(%e : tensor<8x8xf32>) -> tensor<8x8xf32>
  return %r, %p : tensor<8x8xf32>, tensor<8x4xf32>
}
"""


def test_each_reader_of_a_shared_zero_gets_its_own():
    payload = parse(TWO_PRODUCTS)
    apply(payload, lambda root: clone_shared_fills(match(root, "func.func")))
    text = str(payload)
    check(text, """
        CHECK: %[[ONE:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%[[E:.*]] : tensor<8x8xf32>)
        CHECK-NEXT: %[[TWO:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%[[E]] : tensor<8x8xf32>)
        CHECK: %[[S:.*]] = linalg.matmul ins(%{{.*}}, %{{.*}} : {{.*}}) outs(%[[TWO]] :
        CHECK: linalg.matmul ins(%[[S]], %{{.*}} : {{.*}}) outs(%[[ONE]] :
    """)
    assert text.count("linalg.fill") == 3  # the [8, 4] one has one reader
    a, b, c = (torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    got = run_module(payload, [a, b, c])
    torch.testing.assert_close(got[0], 2 * (a @ b) @ c)
    torch.testing.assert_close(got[1], a @ c[:, :4])


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(TWO_PRODUCTS)
    message = apply_expect_failure(
        payload, lambda root: clone_shared_fills(match(root, "linalg.fill")))
    assert "transform_ext.clone_shared_fills: linalg.fill" in message
    assert "not a func.func" in message
