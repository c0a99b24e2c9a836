"""outline_into_forall: a row sum and the op reading it run in a forall of 2 iterations of 2
rows (operands sliced by rows, the fill's empty made anew, linalg.index 0 offset, the rank-0
input read once as a scalar, the result inserted by rows) or of one iteration (FileCheck;
the numbers: the end-to-end loss tests run such kernels on the CPU); rows that do not divide
and a kernel whose results nothing reads are refused."""

from torch_mlir import ir

from schedules.common import match
from transform_ext.outline_into_forall import outline_into_forall
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

ROWS = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#r = affine_map<(d0) -> (d0)>
#s = affine_map<(d0) -> ()>
func.func @main(%x: tensor<4x8xf32>, %n: tensor<f32>) -> tensor<4xf32> {
  %zero = arith.constant 0.0 : f32
  %e4 = tensor.empty() : tensor<4xf32>
  %s0 = linalg.fill ins(%zero : f32) outs(%e4 : tensor<4xf32>) -> tensor<4xf32>
  %sum = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%s0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %q = linalg.generic {indexing_maps = [#r, #s, #r], iterator_types = ["parallel"]}
      ins(%sum, %n : tensor<4xf32>, tensor<f32>) outs(%e4 : tensor<4xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %i = linalg.index 0 : index
    %ii = arith.index_cast %i : index to i64
    %f = arith.sitofp %ii : i64 to f32
    %d = arith.divf %a, %b : f32
    %r = arith.addf %d, %f : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %q : tensor<4xf32>
}
"""


def _outline(rows, total_rows=4, names=("linalg.fill", "linalg.generic")):
    def body(root):
        mapping = ir.ArrayAttr.get([ir.Attribute.parse("#gpu.block<x>")])
        outline_into_forall(match(match(root, "func.func"), list(names)), rows=rows,
                            total_rows=total_rows, mapping=mapping)
    return body


def test_two_workgroups_of_two_rows():
    payload = parse(ROWS)
    apply(payload, _outline(rows=2))
    check(str(payload), """
        CHECK: func.func @main(%[[X:[a-z0-9_]+]]: tensor<4x8xf32>, %[[N:[a-z0-9_]+]]: tensor<f32>)
        CHECK: %[[K:[a-z0-9_]+]] = scf.forall (%[[IV:[a-z0-9_]+]]) in (2) shared_outs(%[[DEST:[a-z0-9_]+]] = %{{.*}}) -> (tensor<4xf32>)
        CHECK-NEXT: %[[SCALAR:[a-z0-9_]+]] = tensor.extract %[[N]][] : tensor<f32>
        CHECK: %[[R0:[a-z0-9_]+]] = arith.muli %[[IV]], %{{.*}} : index
        CHECK: %[[E:[a-z0-9_]+]] = tensor.empty() : tensor<2xf32>
        CHECK: linalg.fill {{.*}} outs(%[[E]] : tensor<2xf32>)
        CHECK: tensor.extract_slice %[[X]][%[[R0]], 0] [2, 8] [1, 1] : tensor<4x8xf32> to tensor<2x8xf32>
        CHECK: %[[I:[a-z0-9_]+]] = linalg.index 0 : index
        CHECK-NEXT: %[[ROW:[a-z0-9_]+]] = arith.addi %[[I]], %[[R0]] : index
        CHECK-NEXT: arith.index_cast %[[ROW]]
        CHECK: arith.divf %{{.*}}, %[[SCALAR]] : f32
        CHECK: scf.forall.in_parallel
        CHECK-NEXT: tensor.parallel_insert_slice %{{.*}} into %[[DEST]][%[[R0]]] [2] [1] : tensor<2xf32> into tensor<4xf32>
        CHECK: {mapping = [#gpu.block<x>]}
        CHECK-NEXT: return %[[K]] : tensor<4xf32>
    """)


def test_one_workgroup():
    payload = parse(ROWS)
    apply(payload, _outline(rows=0))
    check(str(payload), """
        CHECK: scf.forall (%{{.*}}) in (1) shared_outs(%[[DEST:[a-z0-9_]+]] = %{{.*}}) -> (tensor<4xf32>)
        CHECK-NOT: tensor.extract_slice
        CHECK-NOT: arith.addi
        CHECK: tensor.parallel_insert_slice %{{.*}} into %[[DEST]][0] [4] [1] : tensor<4xf32> into tensor<4xf32>
    """)


def test_rejects_rows_that_do_not_divide_and_unused_kernels():
    payload = parse(ROWS)
    before = str(payload)
    message = apply_expect_failure(payload, _outline(rows=3))
    assert "transform_ext.outline_into_forall: linalg.fill" in message
    assert "4 rows are not a multiple of 3 per iteration" in message
    assert str(payload) == before
    message = apply_expect_failure(payload, _outline(rows=0, names=("func.return",)))
    assert "transform_ext.outline_into_forall: func.return" in message
    assert "not a linalg op" in message
    dead = parse(ROWS.replace("return %q : tensor<4xf32>", "return %e4 : tensor<4xf32>"))
    message = apply_expect_failure(dead, _outline(rows=2))
    assert "the kernel computes nothing used" in message


# ROWS' row sum, then a later op reading it (instead of the generic %q)
SUM_THEN_READER = ROWS.split("  %q = ")[0].replace(
    "-> tensor<4xf32> {", "-> (tensor<4xf32>, tensor<2xf32>) {") + """
  %head = tensor.extract_slice %sum[0] [2] [1] : tensor<4xf32> to tensor<2xf32>
  return %sum, %head : tensor<4xf32>, tensor<2xf32>
}
"""


def test_the_kernel_goes_before_a_later_reader():
    """A later op reading the kernel's result (another kernel, in a fused schedule) reads
    the forall's result: the forall is inserted before it, not before the terminator."""
    payload = parse(SUM_THEN_READER)
    apply(payload, _outline(rows=2))
    check(str(payload), """
        CHECK: %[[K:[a-z0-9_]+]] = scf.forall
        CHECK: {mapping = [#gpu.block<x>]}
        CHECK-NEXT: %[[HEAD:[a-z0-9_]+]] = tensor.extract_slice %[[K]][0] [2] [1]
        CHECK-NEXT: return %[[K]], %[[HEAD]]
    """)
