"""split_assertions: IR (FileCheck) of the split, nested unsplittable generics left alone,
rejection of a targeted one; the gather kernels through the whole pipeline are in
tests/lighthouse (KernelError on a bad index)."""

from schedules.common import match
from transform_ext.split_assertions import split_assertions
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

GATHER = """
#rows = affine_map<(d0, d1) -> (d0)>
#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @main(%t: tensor<4xi64>, %table: tensor<10x8xf32>) -> tensor<4x8xf32> {
  %e = tensor.empty() : tensor<4x8xf32>
  %r = linalg.generic {indexing_maps = [#rows, #id], iterator_types = ["parallel", "parallel"]}
      ins(%t : tensor<4xi64>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%ti: i64, %out: f32):
    %c10 = arith.constant 10 : i64
    %ok = arith.cmpi slt, %ti, %c10 : i64
    cf.assert %ok, "index out of range"
    %i = arith.index_cast %ti : i64 to index
    %j = linalg.index 1 : index
    %x = tensor.extract %table[%i, %j] : tensor<10x8xf32>
    linalg.yield %x : f32
  } -> tensor<4x8xf32>
  return %r : tensor<4x8xf32>
}
"""


def test_the_checks_run_over_the_loops_the_inputs_index():
    """The check loops over the rows only (the columns are the output's alone); the op that
    gathers keeps everything but the cf.assert."""
    payload = parse(GATHER)
    apply(payload, lambda root: split_assertions(match(root, "func.func")))
    check(payload, """
        CHECK-DAG: #[[ROW:.*]] = affine_map<(d0) -> (d0)>
        CHECK: func.func @main(%[[T:.*]]: tensor<4xi64>, %{{.*}}: tensor<10x8xf32>)
        CHECK: linalg.generic {indexing_maps = [#[[ROW]]], iterator_types = ["parallel"]} ins(%[[T]] : tensor<4xi64>) {
        CHECK-NEXT: ^bb0(%[[TI:.*]]: i64):
        CHECK: %[[OK:.*]] = arith.cmpi slt, %[[TI]]
        CHECK-NEXT: cf.assert %[[OK]], "index out of range"
        CHECK-NEXT: linalg.yield
        CHECK: %[[R:.*]] = linalg.generic {{.*}} ins(%[[T]] : tensor<4xi64>) outs(%{{.*}} : tensor<4x8xf32>)
        CHECK-NOT: cf.assert
        CHECK: tensor.extract
        CHECK: return %[[R]]
    """)


READS_ITS_INIT = """
#id = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<4xf32>, %init: tensor<4xf32>) -> tensor<4xf32> {
  %r = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]}
      ins(%x : tensor<4xf32>) outs(%init : tensor<4xf32>) {
  ^bb0(%a: f32, %out: f32):
    %zero = arith.constant 0.0 : f32
    %ok = arith.cmpf oge, %out, %zero : f32
    cf.assert %ok, "negative accumulator"
    %s = arith.addf %a, %out : f32
    linalg.yield %s : f32
  } -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"""


def test_a_nested_generic_whose_checks_read_its_init_is_left_alone():
    payload = parse(READS_ITS_INIT)
    before = str(payload)
    apply(payload, lambda root: split_assertions(match(root, "func.func")))
    assert str(payload) == before


def test_rejects_a_targeted_generic_whose_checks_read_its_init():
    payload = parse(READS_ITS_INIT)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: split_assertions(match(root, "linalg.generic")))
    assert "transform_ext.split_assertions: linalg.generic at" in message
    assert "its assertions read the accumulator" in message
    assert str(payload) == before
