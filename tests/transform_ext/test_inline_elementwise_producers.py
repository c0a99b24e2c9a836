"""inline_elementwise_producers: a producer read by two ops is computed in both (FileCheck,
numbers against torch), the witness keeps a loop's bounds and restricts the producers to its
shape, and a consumer that is not a linalg.generic is refused."""

import torch
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.filter_ops import filter_reductions
from transform_ext.inline_elementwise_producers import inline_elementwise_producers
from transform_ext.trace_to_argument import trace_to_argument
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

INLINE = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x8xf32>, %m: tensor<4xf32>) -> (tensor<4xf32>, tensor<4x8xf32>) {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4x8xf32>
  %d = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<4x8xf32>, tensor<4xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %s = arith.subf %a, %b : f32
    linalg.yield %s : f32
  } -> tensor<4x8xf32>
  %e1 = tensor.empty() : tensor<4xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %sum = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%d : tensor<4x8xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %t = math.exp %a : f32
    %s = arith.addf %t, %o : f32
    linalg.yield %s : f32
  } -> tensor<4xf32>
  %grad = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%d : tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %t = arith.mulf %a, %a : f32
    linalg.yield %t : f32
  } -> tensor<4x8xf32>
  return %sum, %grad : tensor<4xf32>, tensor<4x8xf32>
}
"""


def test_a_producer_read_by_two_ops_is_inlined_into_both():
    payload = parse(INLINE)
    apply(payload, lambda root: inline_elementwise_producers(match(root, "linalg.generic")))
    check(str(payload), """
        CHECK-LABEL: func.func @main
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}} ins(%arg0, %arg1
        CHECK:   ^bb0(%[[X:.*]]: f32, %[[M:.*]]: f32, %{{.*}}: f32):
        CHECK:   %[[D:.*]] = arith.subf %[[X]], %[[M]]
        CHECK:   math.exp %[[D]]
        CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel"]{{.*}} ins(%arg0, %arg1
        CHECK:   %[[D2:.*]] = arith.subf
        CHECK:   arith.mulf %[[D2]], %[[D2]]
    """)
    assert str(payload).count("linalg.generic") == 2
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
    s, grad = run_module(payload, [x, m])
    torch.testing.assert_close(s, (x - m[:, None]).exp().sum(1))
    torch.testing.assert_close(grad, (x - m[:, None]) ** 2)


# the row sum of a one-hot: the only [4, 8] operand is an iota of the class index; after
# inlining nothing bounds the class loop but the witness (the logits)
ONE_HOT_SUM = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x8xf32>, %y: tensor<4xi64>) -> (tensor<4xf32>, tensor<4xf32>) {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %e = tensor.empty() : tensor<4x8xi64>
  %iota = linalg.generic {indexing_maps = [#id], iterator_types = ["parallel", "parallel"]}
      outs(%e : tensor<4x8xi64>) {
  ^bb0(%o: i64):
    %j = linalg.index 1 : index
    %ji = arith.index_cast %j : index to i64
    linalg.yield %ji : i64
  } -> tensor<4x8xi64>
  %e1 = tensor.empty() : tensor<4xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %s = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}
      ins(%iota, %y : tensor<4x8xi64>, tensor<4xi64>) outs(%z : tensor<4xf32>) {
  ^bb0(%c: i64, %t: i64, %o: f32):
    %one = arith.constant 1.0 : f32
    %hit = arith.cmpi eq, %c, %t : i64
    %v = arith.select %hit, %one, %zero : f32
    %r = arith.addf %v, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %m, %s : tensor<4xf32>, tensor<4xf32>
}
"""


def _with_logits_witness(root):
    generics = match(match(root, "func.func"), "linalg.generic")
    logits = trace_to_argument(filter_reductions(generics, combiner="max"), 0)
    inline_elementwise_producers(generics, witness=logits)


def test_the_witness_keeps_the_bounds_of_a_loop_only_the_producer_had():
    payload = parse(ONE_HOT_SUM)
    apply(payload, _with_logits_witness)
    check(str(payload), """
        CHECK: func.func @main(%[[X:[^:]*]]: tensor<4x8xf32>, %[[Y:[^:]*]]: tensor<4xi64>)
        CHECK-NOT: -> tensor<4x8xi64>
        CHECK: linalg.generic {{.*}} ins(%[[Y]], %[[X]] : tensor<4xi64>, tensor<4x8xf32>)
        CHECK:   linalg.index 1
        CHECK:   arith.cmpi eq
    """)
    x, y = torch.randn(4, 8), torch.tensor([0, 7, 3, 5])
    m, s = run_module(payload, [x, y])
    torch.testing.assert_close(m, x.amax(1))
    torch.testing.assert_close(s, torch.ones(4))


def test_without_a_witness_an_empty_tensor_keeps_the_bounds():
    payload = parse(ONE_HOT_SUM)
    apply(payload, lambda root: inline_elementwise_producers(match(root, "linalg.generic")))
    check(str(payload), """
        CHECK-NOT: -> tensor<4x8xi64>
        CHECK: arith.maximumf
        CHECK: %[[B:.*]] = tensor.empty() : tensor<4x8xi64>
        CHECK-NEXT: linalg.generic {{.*}} ins(%arg1, %[[B]] : tensor<4xi64>, tensor<4x8xi64>)
    """)


def test_the_witness_restricts_the_producers_to_its_shape():
    """x - m is [4, 8]: with a [4] witness it is not inlined."""
    payload = parse(INLINE)

    def body(root):
        generics = match(root, "linalg.generic")
        first = transform.SplitHandleOp([transform.AnyOpType.get()] * 3, generics).results[0]
        inline_elementwise_producers(generics, witness=trace_to_argument(first, 1))  # %m

    apply(payload, body)
    assert str(payload).count("linalg.generic") == 3


def test_a_consumer_that_is_not_a_generic_is_refused():
    payload = parse(INLINE)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: inline_elementwise_producers(
        match(root, ["linalg.generic", "linalg.fill"])))
    assert "transform_ext.inline_elementwise_producers: linalg.fill at" in message
    assert "not a linalg.generic" in message
    assert str(payload) == before


def test_whole_leaves_a_producer_that_another_op_also_reads():
    """With whole, the sum does not inline x - m (the elementwise op outside the handle
    reads it too: it would be computed twice and still stored); both in the handle do."""
    payload = parse(INLINE)
    apply(payload, lambda root: inline_elementwise_producers(
        filter_reductions(match(root, "linalg.generic")), whole=True))
    assert str(payload).count("linalg.generic") == 3 and "lh.inline_reader" not in str(payload)
    payload = parse(INLINE)
    apply(payload, lambda root: inline_elementwise_producers(match(root, "linalg.generic"),
                                                             whole=True))
    assert str(payload).count("linalg.generic") == 2 and "lh.inline_reader" not in str(payload)
    x, m = torch.randn(4, 8), torch.randn(4)
    got = run_module(payload, [x, m])
    torch.testing.assert_close(got[0], (x - m[:, None]).exp().sum(1))
    torch.testing.assert_close(got[1], (x - m[:, None]).square())


STRIDED = """
#in = affine_map<(d0, d1) -> (d0 * 2 + d1)>
#w = affine_map<(d0, d1) -> (d1)>
#out = affine_map<(d0, d1) -> (d0)>
#id = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<9xf32>, %w: tensor<3xf32>) -> tensor<4xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<3xf32>
  %w2 = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%w : tensor<3xf32>) outs(%e : tensor<3xf32>) {
  ^bb0(%a: f32, %o: f32):
    %t = arith.mulf %a, %a : f32
    linalg.yield %t : f32
  } -> tensor<3xf32>
  %e1 = tensor.empty() : tensor<4xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %y = linalg.generic {indexing_maps = [#in, #w, #out], iterator_types = ["parallel", "reduction"]}
      ins(%x, %w2 : tensor<9xf32>, tensor<3xf32>) outs(%z : tensor<4xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %p = arith.mulf %a, %b : f32
    %s = arith.addf %p, %o : f32
    linalg.yield %s : f32
  } -> tensor<4xf32>
  return %y : tensor<4xf32>
}
"""


def test_a_consumer_with_a_strided_map_is_left_as_it_is():
    """A 1-D convolution reads x through d0 * 2 + d1, which the rebuilt maps cannot
    express: the consumer keeps its producer (it used to crash the rewrite)."""
    payload = parse(STRIDED)
    apply(payload, lambda root: inline_elementwise_producers(match(root, "linalg.generic")))
    assert str(payload).count("linalg.generic") == 2
    x, w = torch.randn(9), torch.randn(3)
    got = run_module(payload, [x, w])[0]
    want = torch.stack([(x[2 * i:2 * i + 3] * w * w).sum() for i in range(4)])
    torch.testing.assert_close(got, want)
