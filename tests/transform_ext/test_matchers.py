"""filter_ops and walk_producers: which ops they select (tagged with transform.annotate and
FileChecked), that they leave the payload unchanged, and walk_producers' rejections."""

from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.filter_ops import (filter_by_name, filter_contractions, filter_elementwise,
                                      filter_ops, filter_reductions)
from transform_ext.walk_producers import RESHAPES, walk_producers
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

# The ops of an imported attention after cleanup: a batch matmul between reshapes, a max
# reduction that also computes an unused argmax, exp, a sum, an AND reduction over i8-stored
# bools, a select, a plain copy.
GRAPH = """
#id = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#row = affine_map<(d0, d1, d2) -> (d0, d1)>
func.func @main(%q: tensor<1x2x4x8xf32>, %k: tensor<2x8x4xf32>) -> (tensor<2x4x4xf32>, tensor<2x4xi64>, tensor<2x4xf32>, tensor<2x4xi8>) {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %c0 = arith.constant 0 : i64
  %one = arith.constant 1 : i8
  %qc = tensor.collapse_shape %q [[0, 1], [2], [3]] : tensor<1x2x4x8xf32> into tensor<2x4x8xf32>
  %e = tensor.empty() : tensor<2x4x4xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<2x4x4xf32>) -> tensor<2x4x4xf32>
  %s = linalg.batch_matmul ins(%qc, %k : tensor<2x4x8xf32>, tensor<2x8x4xf32>) outs(%f : tensor<2x4x4xf32>) -> tensor<2x4x4xf32>
  %re = tensor.empty() : tensor<2x4xf32>
  %mi = linalg.fill ins(%ninf : f32) outs(%re : tensor<2x4xf32>) -> tensor<2x4xf32>
  %ie = tensor.empty() : tensor<2x4xi64>
  %ii = linalg.fill ins(%c0 : i64) outs(%ie : tensor<2x4xi64>) -> tensor<2x4xi64>
  %m:2 = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%s : tensor<2x4x4xf32>) outs(%mi, %ii : tensor<2x4xf32>, tensor<2x4xi64>) {
  ^bb0(%in: f32, %acc: f32, %idx: i64):
    %i = linalg.index 2 : index
    %ic = arith.index_cast %i : index to i64
    %0 = arith.maximumf %in, %acc : f32
    %1 = arith.cmpf ogt, %in, %acc : f32
    %2 = arith.select %1, %ic, %idx : i64
    linalg.yield %0, %2 : f32, i64
  } -> (tensor<2x4xf32>, tensor<2x4xi64>)
  %mx = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%s : tensor<2x4x4xf32>) outs(%mi : tensor<2x4xf32>) {
  ^bb0(%in: f32, %acc: f32):
    %0 = arith.maxnumf %acc, %in : f32
    linalg.yield %0 : f32
  } -> tensor<2x4xf32>
  %ex = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%s, %mx : tensor<2x4x4xf32>, tensor<2x4xf32>) outs(%e : tensor<2x4x4xf32>) {
  ^bb0(%in: f32, %m0: f32, %out: f32):
    %0 = arith.subf %in, %m0 : f32
    %1 = math.exp %0 : f32
    linalg.yield %1 : f32
  } -> tensor<2x4x4xf32>
  %zi = linalg.fill ins(%zero : f32) outs(%re : tensor<2x4xf32>) -> tensor<2x4xf32>
  %sum = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%ex : tensor<2x4x4xf32>) outs(%zi : tensor<2x4xf32>) {
  ^bb0(%in: f32, %acc: f32):
    %0 = arith.addf %in, %acc : f32
    linalg.yield %0 : f32
  } -> tensor<2x4xf32>
  %be = tensor.empty() : tensor<2x4x4xi8>
  %isinf = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%s : tensor<2x4x4xf32>) outs(%be : tensor<2x4x4xi8>) {
  ^bb0(%in: f32, %out: i8):
    %0 = arith.cmpf oeq, %in, %ninf : f32
    %1 = arith.extui %0 : i1 to i8
    linalg.yield %1 : i8
  } -> tensor<2x4x4xi8>
  %ae = tensor.empty() : tensor<2x4xi8>
  %ai = linalg.fill ins(%one : i8) outs(%ae : tensor<2x4xi8>) -> tensor<2x4xi8>
  %all = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%isinf : tensor<2x4x4xi8>) outs(%ai : tensor<2x4xi8>) {
  ^bb0(%in: i8, %acc: i8):
    %0 = arith.trunci %in : i8 to i1
    %1 = arith.trunci %acc : i8 to i1
    %2 = arith.andi %0, %1 : i1
    %3 = arith.extui %2 : i1 to i8
    linalg.yield %3 : i8
  } -> tensor<2x4xi8>
  return %ex, %m#1, %sum, %all : tensor<2x4x4xf32>, tensor<2x4xi64>, tensor<2x4xf32>, tensor<2x4xi8>
}
"""


def _tag(handle, name):
    transform.AnnotateOp(handle, name)


def test_filters_select_by_structure_and_name():
    payload = parse(GRAPH)
    before = str(payload)

    def body(root):
        ops = match(root, ["linalg.generic", "linalg.batch_matmul", "linalg.fill"])
        _tag(filter_reductions(ops), "reduction")
        _tag(filter_reductions(ops, "max"), "max")
        _tag(filter_reductions(ops, "add"), "add")
        _tag(filter_reductions(ops, "and"), "and")
        _tag(filter_contractions(ops), "contraction")
        _tag(filter_elementwise(ops), "elementwise")
        _tag(filter_by_name(ops, "linalg.fill"), "fill")
        _tag(filter_ops(ops, names=["linalg.generic"], structure="elementwise"), "elementwise_generic")

    apply(payload, body)
    check(payload, """
        CHECK: linalg.fill {elementwise, fill}
        CHECK-NEXT: linalg.batch_matmul {contraction} ins
        CHECK: linalg.fill {elementwise, fill}
        CHECK: linalg.fill {elementwise, fill}
        CHECK-NEXT: %{{.*}}:2 = linalg.generic {indexing_maps = {{.*}} outs(%{{.*}}, %{{.*}} : tensor<2x4xf32>, tensor<2x4xi64>) {{{$}}
        CHECK: linalg.generic {{.*}} attrs =  {max, reduction}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.maxnumf
        CHECK: linalg.generic {{.*}} attrs =  {elementwise, elementwise_generic}
        CHECK: math.exp
        CHECK: linalg.fill {elementwise, fill}
        CHECK-NEXT: linalg.generic {{.*}} attrs =  {add, reduction}
        CHECK: linalg.generic {{.*}} attrs =  {elementwise, elementwise_generic}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.cmpf oeq
        CHECK: linalg.fill {elementwise, fill}
        CHECK-NEXT: linalg.generic {{.*}} attrs =  {and, reduction}
    """)
    assert str(payload) != before


def test_filters_leave_the_payload_unchanged():
    payload = parse(GRAPH)
    before = str(payload)

    def body(root):
        ops = match(root, ["linalg.generic", "linalg.batch_matmul"])
        filter_reductions(ops, "min")
        filter_contractions(ops)
        filter_elementwise(ops)
        filter_by_name(ops, ["linalg.batch_matmul"])
        walk_producers(filter_contractions(ops), 2)

    apply(payload, body)
    assert str(payload) == before


def test_walk_producers_looks_through_reshapes():
    payload = parse(GRAPH)

    def body(root):
        mm = filter_contractions(match(root, "linalg.batch_matmul"))
        _tag(walk_producers(mm, 2), "init")
        sums = filter_reductions(match(root, "linalg.generic"), "add")
        _tag(walk_producers(sums, 0), "sum_input")
        _tag(walk_producers(walk_producers(sums, 0), 1), "max_of_exp")

    apply(payload, body)
    check(payload, """
        CHECK: linalg.fill {init} {{.*}} -> tensor<2x4x4xf32>
        CHECK: linalg.generic {{.*}}{max_of_exp}
        CHECK: linalg.generic {{.*}}{sum_input}
        CHECK-NEXT: ^bb0
        CHECK-NEXT: arith.subf
        CHECK-NEXT: math.exp
    """)


def test_walk_producers_rejects_block_arguments_and_missing_operands():
    payload = parse(GRAPH)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: walk_producers(
        match(root, "linalg.batch_matmul"), 0, look_through=RESHAPES))
    assert "transform_ext.walk_producers: linalg.batch_matmul" in message
    assert "operand 0 through tensor.collapse_shape is a block argument, not produced by an op" in message
    message = apply_expect_failure(payload, lambda root: walk_producers(
        match(root, "linalg.batch_matmul"), 3))
    assert "has 3 operands, no operand 3" in message
    assert str(payload) == before
