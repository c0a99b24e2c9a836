"""fold_gathers_through_elementwise: IR (FileCheck) and numbers (against torch) of a gather
from a log_softmax and from a reshape of one, and the rejection of a target without a body."""

import torch

from schedules.common import match, run_passes
from transform_ext.fold_gathers_through_elementwise import fold_gathers_through_elementwise
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

LOG_SOFTMAX_GATHER = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#r = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4x8xf32>, %m: tensor<4xf32>, %l: tensor<4xf32>, %y: tensor<4xi64>) -> tensor<4xf32> {
  %e = tensor.empty() : tensor<4x8xf32>
  %lp = linalg.generic {indexing_maps = [#id, #row, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m, %l : tensor<4x8xf32>, tensor<4xf32>, tensor<4xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %g = math.log %c : f32
    %s = arith.subf %d, %g : f32
    linalg.yield %s : f32
  } -> tensor<4x8xf32>
  %e1 = tensor.empty() : tensor<4xf32>
  %g = linalg.generic {indexing_maps = [#r, #r], iterator_types = ["parallel"]}
      ins(%y : tensor<4xi64>) outs(%e1 : tensor<4xf32>) {
  ^bb0(%t: i64, %o: f32):
    %i = linalg.index 0 : index
    %j = arith.index_cast %t : i64 to index
    %v = tensor.extract %lp[%i, %j] : tensor<4x8xf32>
    linalg.yield %v : f32
  } -> tensor<4xf32>
  return %g : tensor<4xf32>
}
"""


def want(x, m, l, y):
    return (x - m[:, None] - l.log()[:, None]).gather(1, y[:, None])[:, 0]


def inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(4, 8, generator=g), torch.randn(4, generator=g),
            torch.rand(4, generator=g) + 1, torch.tensor([0, 7, 3, 5]))


def test_a_gather_from_log_softmax_reads_the_logits():
    """logp[i, y_i] = x[i, y_i] - m[i] - log l[i]: logp is no longer read and dies."""
    payload = parse(LOG_SOFTMAX_GATHER)
    apply(payload, lambda root: fold_gathers_through_elementwise(match(root, "func.func")))
    run_passes(payload, "canonicalize, cse")
    check(str(payload), """
        CHECK: func.func @main(%[[X:[^:]*]]: tensor<4x8xf32>, %[[M:[^:]*]]: tensor<4xf32>, %[[L:[^:]*]]: tensor<4xf32>
        CHECK-NOT: tensor<4x8xf32> = linalg.generic
        CHECK: ^bb0(%[[T:.*]]: i64, %{{.*}}: f32):
        CHECK: %[[I:.*]] = linalg.index 0
        CHECK: %[[J:.*]] = arith.index_cast %[[T]]
        CHECK: %[[XV:.*]] = tensor.extract %[[X]][%[[I]], %[[J]]] : tensor<4x8xf32>
        CHECK: %[[MV:.*]] = tensor.extract %[[M]][%[[I]]] : tensor<4xf32>
        CHECK: %[[LV:.*]] = tensor.extract %[[L]][%[[I]]] : tensor<4xf32>
        CHECK: %[[D:.*]] = arith.subf %[[XV]], %[[MV]]
        CHECK: %[[G:.*]] = math.log %[[LV]]
        CHECK: arith.subf %[[D]], %[[G]]
    """)
    (got,) = run_module(payload, list(inputs()))
    torch.testing.assert_close(got, want(*inputs()))


def test_a_gather_through_expand_shape_linearizes_its_indices():
    """E = expand_shape(logp) [4, 8] -> [4, 2, 4]: E[i, a, b] = logp[i, 4 a + b]."""
    text = LOG_SOFTMAX_GATHER.replace(
        "%e1 = tensor.empty() : tensor<4xf32>",
        "%ex = tensor.expand_shape %lp [[0], [1, 2]] output_shape [4, 2, 4] : tensor<4x8xf32> into tensor<4x2x4xf32>\n"
        "  %e1 = tensor.empty() : tensor<4xf32>").replace(
        "%v = tensor.extract %lp[%i, %j] : tensor<4x8xf32>",
        "%c4 = arith.constant 4 : index\n"
        "    %a = arith.divui %j, %c4 : index\n    %b = arith.remui %j, %c4 : index\n"
        "    %v = tensor.extract %ex[%i, %a, %b] : tensor<4x2x4xf32>")
    payload = parse(text)
    apply(payload, lambda root: fold_gathers_through_elementwise(match(root, "func.func")))
    run_passes(payload, "canonicalize, cse")
    check(str(payload), """
        CHECK-NOT: tensor.expand_shape
        CHECK: arith.muli %{{.*}}, %c4
        CHECK: tensor.extract %arg0[%{{.*}}, %{{.*}}] : tensor<4x8xf32>
    """)
    (got,) = run_module(payload, list(inputs()))
    torch.testing.assert_close(got, want(*inputs()))


def test_a_target_without_a_body_is_refused():
    payload = parse(LOG_SOFTMAX_GATHER)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: fold_gathers_through_elementwise(match(root, "tensor.empty")))
    assert "transform_ext.fold_gathers_through_elementwise: tensor.empty at" in message
    assert "it has no body" in message
    assert str(payload) == before
