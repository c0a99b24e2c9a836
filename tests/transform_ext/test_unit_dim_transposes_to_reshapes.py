"""unit_dim_transposes_to_reshapes: a transpose that moves only unit dims becomes
collapse_shape + expand_shape (leading, inner and trailing unit dims; all dims unit); one
that reorders dims of other extents, or has dynamic dims, stays; KernelBench 11's einsum and
its neighbours (a second use, a transposed view, a real transpose after it, bf16) match
torch with no element-wise copy left after the matmul."""

import pytest
import torch

from lighthouse.compile import compile_kernel
from schedules.common import match
from tests.transform_ext.helpers import apply, check, parse
from transform_ext.unit_dim_transposes_to_reshapes import (unit_dim_transposes_to_reshapes,
                                                            unit_groups)

FUNCS = """
func.func @inner(%x: tensor<8x64x1x96xf32>, %o: tensor<8x64x96x1xf32>) -> tensor<8x64x96x1xf32> {
  %t = linalg.transpose ins(%x : tensor<8x64x1x96xf32>) outs(%o : tensor<8x64x96x1xf32>) permutation = [0, 1, 3, 2]
  return %t : tensor<8x64x96x1xf32>
}
func.func @leading(%x: tensor<1x5x1x7xf32>, %o: tensor<5x1x7x1xf32>) -> tensor<5x1x7x1xf32> {
  %t = linalg.transpose ins(%x : tensor<1x5x1x7xf32>) outs(%o : tensor<5x1x7x1xf32>) permutation = [1, 2, 3, 0]
  return %t : tensor<5x1x7x1xf32>
}
func.func @units(%x: tensor<1x1xf32>, %o: tensor<1x1xf32>) -> tensor<1x1xf32> {
  %t = linalg.transpose ins(%x : tensor<1x1xf32>) outs(%o : tensor<1x1xf32>) permutation = [1, 0]
  return %t : tensor<1x1xf32>
}
func.func @reorders(%x: tensor<5x1x7xf32>, %o: tensor<7x1x5xf32>) -> tensor<7x1x5xf32> {
  %t = linalg.transpose ins(%x : tensor<5x1x7xf32>) outs(%o : tensor<7x1x5xf32>) permutation = [2, 1, 0]
  return %t : tensor<7x1x5xf32>
}
func.func @dynamic(%x: tensor<?x1xf32>, %o: tensor<1x?xf32>) -> tensor<1x?xf32> {
  %t = linalg.transpose ins(%x : tensor<?x1xf32>) outs(%o : tensor<1x?xf32>) permutation = [1, 0]
  return %t : tensor<1x?xf32>
}
"""


def _rewritten() -> str:
    payload = parse(FUNCS)
    apply(payload, lambda root: unit_dim_transposes_to_reshapes(match(root, "func.func")))
    payload.operation.verify()
    return str(payload)


def test_unit_groups():
    assert unit_groups([8, 64, 1, 96]) == [[0], [1], [2, 3]]
    assert unit_groups([1, 5, 1, 7, 1]) == [[0, 1], [2, 3, 4]]
    assert unit_groups([1, 1]) == []
    assert unit_groups([3]) == [[0]]


def test_transposes_of_unit_dims_become_reshapes():
    check(_rewritten(), """
        CHECK-LABEL: func.func @inner
        CHECK-NOT:   linalg.transpose
        CHECK:       %[[F:.*]] = tensor.collapse_shape %{{.*}} {{\\[\\[}}0], [1], [2, 3]] : tensor<8x64x1x96xf32> into tensor<8x64x96xf32>
        CHECK:       %[[E:.*]] = tensor.expand_shape %[[F]] {{\\[\\[}}0], [1], [2, 3]] output_shape [8, 64, 96, 1] : tensor<8x64x96xf32> into tensor<8x64x96x1xf32>
        CHECK:       return %[[E]]
        CHECK-LABEL: func.func @leading
        CHECK:       tensor.collapse_shape %{{.*}} {{\\[\\[}}0, 1], [2, 3]] : tensor<1x5x1x7xf32> into tensor<5x7xf32>
        CHECK:       tensor.expand_shape %{{.*}} {{\\[\\[}}0], [1, 2, 3]] output_shape [5, 1, 7, 1] : tensor<5x7xf32> into tensor<5x1x7x1xf32>
        CHECK-LABEL: func.func @units
        CHECK:       tensor.collapse_shape %{{.*}} [] : tensor<1x1xf32> into tensor<f32>
        CHECK:       tensor.expand_shape %{{.*}} [] output_shape [1, 1] : tensor<f32> into tensor<1x1xf32>
        CHECK-LABEL: func.func @reorders
        CHECK:       linalg.transpose
        CHECK-LABEL: func.func @dynamic
        CHECK:       linalg.transpose
    """)


KERNEL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return {expr}
def get_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn({a}, generator=g){cast}, torch.randn({b}, generator=g){cast}]
def get_init_inputs():
    return []
"""

EINSUMS = {
    "einsum": ('torch.einsum("bijl,lk->bijk", a, b)', "2, 3, 5, 17", "17, 24", ""),
    "second_use": ('(lambda y: (y, y.sum(-1)))(torch.einsum("bijl,lk->bijk", a, b))',
                   "2, 3, 5, 17", "17, 24", ""),
    "transposed_view": ('torch.einsum("bijl,lk->bijk", a.transpose(2, 3), b)', "2, 3, 17, 5",
                        "17, 24", ""),
    "real_transpose_after": ('torch.einsum("bijl,lk->bijk", a, b).transpose(1, 3)',
                             "2, 3, 5, 17", "17, 24", ""),
    "unit_dims": ('torch.einsum("bijl,lk->bijk", a, b)', "1, 3, 1, 17", "17, 1", ""),
    "bf16": ('torch.einsum("bijl,lk->bijk", a, b)', "2, 3, 5, 16", "16, 32", ".to(torch.bfloat16)"),
}


@pytest.mark.parametrize("name", EINSUMS)
def test_einsums_match_torch(kernel_file, name):
    expr, a, b, cast = EINSUMS[name]
    compiled = compile_kernel(kernel_file(KERNEL.format(expr=expr, a=a, b=b, cast=cast)))
    for report in compiled.check():
        assert report.ok, str(report)


def test_the_einsum_writes_its_result_without_a_copy(kernel_file):
    expr, a, b, cast = EINSUMS["einsum"]
    compiled = compile_kernel(kernel_file(KERNEL.format(expr=expr, a=a, b=b, cast=cast)),
                              stop_after="bufferize")
    text = str(compiled.module)
    assert "memref.copy" not in text and "linalg.transpose" not in text
