"""trim_unread_pooling_tails: a pooling with one output position along an image dim reads
only its window there; the unread tail is sliced off (FileCheck, and the generalized,
unit-dim-folded op verifies); poolings that read the whole dim stay. The fuzz finding
(a max pool of one window of 4 over a row of 5 after a batched product, where the matmul
schedule failed and fell back) is taken by the matmul family and matches torch, forward
and backward."""

import pytest

from lighthouse.compile import compile_kernel
from schedules.common import match
from tests.transform_ext.helpers import apply, check, parse
from transform_ext.trim_unread_pooling_tails import trim_unread_pooling_tails

FUNCS = """
func.func @one_window(%x: tensor<5x3x1x5xf32>, %o: tensor<5x3x1x1xf32>) -> tensor<5x3x1x1xf32> {
  %w = tensor.empty() : tensor<1x4xf32>
  %y = linalg.pooling_nchw_max {dilations = dense<1> : tensor<2xi64>, strides = dense<[1, 3]> : tensor<2xi64>}
      ins(%x, %w : tensor<5x3x1x5xf32>, tensor<1x4xf32>) outs(%o : tensor<5x3x1x1xf32>) -> tensor<5x3x1x1xf32>
  return %y : tensor<5x3x1x1xf32>
}
func.func @dilated(%x: tensor<2x9x7x4xf32>, %o: tensor<2x1x3x4xf32>) -> tensor<2x1x3x4xf32> {
  %w = tensor.empty() : tensor<3x3xf32>
  %y = linalg.pooling_nhwc_sum {dilations = dense<[2, 1]> : tensor<2xi64>, strides = dense<[4, 2]> : tensor<2xi64>}
      ins(%x, %w : tensor<2x9x7x4xf32>, tensor<3x3xf32>) outs(%o : tensor<2x1x3x4xf32>) -> tensor<2x1x3x4xf32>
  return %y : tensor<2x1x3x4xf32>
}
func.func @whole(%x: tensor<5x3x1x4xf32>, %o: tensor<5x3x1x1xf32>) -> tensor<5x3x1x1xf32> {
  %w = tensor.empty() : tensor<1x4xf32>
  %y = linalg.pooling_nchw_max {dilations = dense<1> : tensor<2xi64>, strides = dense<[1, 3]> : tensor<2xi64>}
      ins(%x, %w : tensor<5x3x1x4xf32>, tensor<1x4xf32>) outs(%o : tensor<5x3x1x1xf32>) -> tensor<5x3x1x1xf32>
  return %y : tensor<5x3x1x1xf32>
}
func.func @windows(%x: tensor<5x3x1x8xf32>, %o: tensor<5x3x1x2xf32>) -> tensor<5x3x1x2xf32> {
  %w = tensor.empty() : tensor<1x4xf32>
  %y = linalg.pooling_nchw_max {dilations = dense<1> : tensor<2xi64>, strides = dense<[1, 3]> : tensor<2xi64>}
      ins(%x, %w : tensor<5x3x1x8xf32>, tensor<1x4xf32>) outs(%o : tensor<5x3x1x2xf32>) -> tensor<5x3x1x2xf32>
  return %y : tensor<5x3x1x2xf32>
}
"""


def test_the_unread_tail_of_a_one_window_dim_is_sliced_off():
    """One output position of a window of 4 over 5 columns reads columns 0-3; a window
    of 3 dilated by 2 over 9 rows reads rows 0-4; a dim of several windows (its read
    keeps the stride term, so the folded op verifies as it is) or one the window covers
    stays whole."""
    payload = parse(FUNCS)
    apply(payload, lambda root: trim_unread_pooling_tails(match(root, "func.func")))
    assert payload.operation.verify()
    check(str(payload), """
        CHECK-LABEL: func.func @one_window
        CHECK: %[[S:.*]] = tensor.extract_slice %{{.*}}[0, 0, 0, 0] [5, 3, 1, 4] [1, 1, 1, 1] : tensor<5x3x1x5xf32> to tensor<5x3x1x4xf32>
        CHECK: linalg.pooling_nchw_max {{.*}} ins(%[[S]], %{{.*}} : tensor<5x3x1x4xf32>, tensor<1x4xf32>)
        CHECK-LABEL: func.func @dilated
        CHECK: %[[D:.*]] = tensor.extract_slice %{{.*}}[0, 0, 0, 0] [2, 5, 7, 4] [1, 1, 1, 1]
        CHECK: linalg.pooling_nhwc_sum {{.*}} ins(%[[D]], %{{.*}} : tensor<2x5x7x4xf32>, tensor<3x3xf32>)
        CHECK-LABEL: func.func @whole
        CHECK-NOT: tensor.extract_slice
        CHECK-LABEL: func.func @windows
        CHECK-NOT: tensor.extract_slice
        CHECK: return
    """)


POOL_AFTER_PRODUCT = """
import torch
import torch.nn.functional as F
DTYPE = torch.{dtype}
class Model(torch.nn.Module):
    def forward(self, x0, x1):
        y0 = x0 @ x1.transpose(-2, -1)
        return F.max_pool1d(y0, 4, 3)
def get_inputs():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 3, 33, generator=g).to(DTYPE).expand(5, 3, 33)
    x1 = (torch.randn(1, 5, 33, generator=g) * 0.174).to(DTYPE).expand(5, 5, 33)
    return [x0, x1]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("backward", [False, True])
def test_a_max_pool_of_one_window_after_a_batched_product(kernel_file, dtype, backward):
    """The fuzz finding: the matmul family takes it (no fallback note) and the result, or
    the gradients, match torch."""
    path = kernel_file(POOL_AFTER_PRODUCT.format(dtype=dtype))
    compiled = compile_kernel(path, backward=backward)
    assert compiled.family.name == "matmul" and not compiled.notes, compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)
