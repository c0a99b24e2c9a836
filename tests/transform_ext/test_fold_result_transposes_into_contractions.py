"""fold_result_transposes_into_contractions: C = A B read only through a transpose that moves
its innermost dim becomes one contraction writing C^T, its inputs ordered so that the first
one holds the result's rows; other transposes and contractions stay."""

import pytest
import torch

from schedules.common import match
from transform_ext.fold_result_transposes_into_contractions import fold_result_transposes_into_contractions
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

# D = (A B)^T over a batch: A [B, M, K], B [B, K, N], C [B, M, N], D = C.permute({perm})
BATCHED = """
func.func @main(%a: tensor<2x5x7xf32>, %b: tensor<2x7x3xf32>) -> tensor<{d_shape}xf32> {{
  %zero = arith.constant {init} : f32
  %e = tensor.empty() : tensor<2x5x3xf32>
  %c0 = linalg.fill ins(%zero : f32) outs(%e : tensor<2x5x3xf32>) -> tensor<2x5x3xf32>
  %c = linalg.batch_matmul ins(%a, %b : tensor<2x5x7xf32>, tensor<2x7x3xf32>) outs(%c0 : tensor<2x5x3xf32>) -> tensor<2x5x3xf32>
  %t = tensor.empty() : tensor<{d_shape}xf32>
  %d = linalg.transpose ins(%c : tensor<2x5x3xf32>) outs(%t : tensor<{d_shape}xf32>) permutation = [{perm}]
  return {returned} : {returned_types}
}}
"""


def _batched(perm, init="0.0", second_use=False):
    shape = [[2, 5, 3][p] for p in perm]
    d_shape = "x".join(map(str, shape))
    returned = "%d, %c" if second_use else "%d"
    types = f"tensor<{d_shape}xf32>, tensor<2x5x3xf32>" if second_use else f"tensor<{d_shape}xf32>"
    text = BATCHED.format(d_shape=d_shape, perm=", ".join(map(str, perm)), init=init,
                          returned=returned, returned_types=types)
    if second_use:
        text = text.replace(") -> tensor<2x3x5xf32> {", ") -> (tensor<2x3x5xf32>, tensor<2x5x3xf32>) {")
    return text


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 5, 7, generator=g), torch.randn(2, 7, 3, generator=g)]


def _fold(text):
    payload = parse(text)
    apply(payload, lambda root: fold_result_transposes_into_contractions(match(root, "func.func")))
    payload.operation.verify()
    return payload


def test_a_transposed_batched_product_is_computed_transposed_with_its_inputs_swapped():
    payload = _fold(_batched([0, 2, 1]))
    check(payload, """
        CHECK-DAG:   #[[B:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d3, d1)>
        CHECK-DAG:   #[[A:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>
        CHECK-DAG:   #[[DM:.*]] = affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>
        CHECK-LABEL: func.func @main
        CHECK:       %[[INIT:.*]] = linalg.transpose ins(%{{.*}} : tensor<2x5x3xf32>) outs(%{{.*}} : tensor<2x3x5xf32>) permutation = [0, 2, 1]
        CHECK:       %[[D:.*]] = linalg.generic {indexing_maps = [#[[B]], #[[A]], #[[DM]]], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
        CHECK-SAME:  ins(%arg1, %arg0 : tensor<2x7x3xf32>, tensor<2x5x7xf32>) outs(%[[INIT]] : tensor<2x3x5xf32>)
        CHECK-NEXT:  ^bb0(%[[IB:.*]]: f32, %[[IA:.*]]: f32, %[[O:.*]]: f32):
        CHECK-NEXT:    %[[P:.*]] = arith.mulf %[[IA]], %[[IB]] : f32
        CHECK-NEXT:    arith.addf %[[O]], %[[P]] : f32
        CHECK-NOT:   linalg.batch_matmul
        CHECK:       return %[[D]]
    """)
    a, b = _inputs()
    (after,) = run_module(payload, [a, b])
    (before,) = run_module(parse(_batched([0, 2, 1])), [a, b])
    torch.testing.assert_close(after, (a @ b).transpose(1, 2))
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_a_nonzero_initial_value_is_transposed_along():
    text = _batched([0, 2, 1], init="1.5")
    payload = _fold(text)
    assert "linalg.batch_matmul" not in str(payload)
    a, b = _inputs()
    (after,) = run_module(payload, [a, b])
    torch.testing.assert_close(after, (a @ b + 1.5).transpose(1, 2))


@pytest.mark.parametrize("perm, why", [
    ([1, 0, 2], "the lanes stay"),              # folds into the unpack as it is
    ([2, 0, 1], "the batch dim is not outer"),  # D[n, b, m]
])
def test_other_transposes_stay(perm, why):
    payload = _fold(_batched(perm))
    text = str(payload)
    assert "linalg.batch_matmul" in text and "linalg.transpose" in text, why


def test_a_product_read_twice_stays():
    payload = _fold(_batched([0, 2, 1], second_use=True))
    text = str(payload)
    assert "linalg.batch_matmul" in text and "linalg.transpose" in text
