"""clamp_gather_indices: IR (FileCheck) for an unchecked, a checked and a guarded read and
reads at loop indices (left alone). The numerics (torch's values in range, a KernelError
out of range) are covered end to end by tests/schedules/test_gathers.py and
tests/lighthouse/test_runtime_checks.py."""

from schedules.common import match
from transform_ext.clamp_gather_indices import clamp_gather_indices
from tests.transform_ext.helpers import apply, check, parse

READS = """
#v = affine_map<(d0) -> (d0)>
func.func @main(%x: tensor<10x3xf32>, %i: tensor<4xi64>) -> (tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) {
  %c0 = arith.constant 0 : index
  %c2 = arith.constant 2 : index
  %c0i = arith.constant 0 : i64
  %ignore = arith.constant -100 : i64
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4xf32>
  %plain = linalg.generic {indexing_maps = [#v, #v], iterator_types = ["parallel"]}
      ins(%i : tensor<4xi64>) outs(%e : tensor<4xf32>) {
  ^bb0(%in: i64, %o: f32):
    %k = arith.index_cast %in : i64 to index
    %r = tensor.extract %x[%k, %c2] : tensor<10x3xf32>
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %checked = linalg.generic {indexing_maps = [#v, #v], iterator_types = ["parallel"]}
      ins(%i : tensor<4xi64>) outs(%e : tensor<4xf32>) {
  ^bb0(%in: i64, %o: f32):
    %ok = arith.cmpi sge, %in, %c0i : i64
    cf.assert %ok, "torch's own check"
    %k = arith.index_cast %in : i64 to index
    %r = tensor.extract %x[%k, %c0] : tensor<10x3xf32>
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %guarded = linalg.generic {indexing_maps = [#v, #v], iterator_types = ["parallel"]}
      ins(%i : tensor<4xi64>) outs(%e : tensor<4xf32>) {
  ^bb0(%in: i64, %o: f32):
    %keep = arith.cmpi ne, %in, %ignore : i64
    %k = arith.index_cast %in : i64 to index
    %r = tensor.extract %x[%k, %c0] : tensor<10x3xf32>
    %s = arith.select %keep, %r, %zero : f32
    linalg.yield %s : f32
  } -> tensor<4xf32>
  %looped = linalg.generic {indexing_maps = [#v], iterator_types = ["parallel"]} outs(%e : tensor<4xf32>) {
  ^bb0(%o: f32):
    %j = linalg.index 0 : index
    %j2 = arith.addi %j, %c2 : index
    %r = tensor.extract %x[%j2, %c0] : tensor<10x3xf32>
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %plain, %checked, %guarded, %looped : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>, tensor<4xf32>
}
"""


def test_data_dependent_reads_are_clamped_and_unchecked_ones_asserted():
    payload = parse(READS)
    apply(payload, lambda root: clamp_gather_indices(match(root, "func.func")))
    payload.operation.verify()
    check(payload, """
        CHECK: linalg.generic
        CHECK: %[[K:.*]] = arith.index_cast
        CHECK-DAG: %[[LO:.*]] = arith.constant 0 : index
        CHECK-DAG: %[[HI:.*]] = arith.constant 9 : index
        CHECK: arith.cmpi sge, %[[K]], %[[LO]]
        CHECK: arith.cmpi sle, %[[K]], %[[HI]]
        CHECK: arith.andi
        CHECK: cf.assert {{.*}} "index out of range: dimension 0 of a 10x3 tensor has size 10"
        CHECK: %[[C:.*]] = arith.maxsi %[[K]], %[[LO]]
        CHECK: %[[D:.*]] = arith.minsi %[[C]], %[[HI]]
        CHECK: tensor.extract %{{.*}}[%[[D]], %{{.*}}] : tensor<10x3xf32>
        CHECK: linalg.generic
        CHECK: cf.assert {{.*}} "torch's own check"
        CHECK-NOT: cf.assert
        CHECK: arith.minsi
        CHECK-NEXT: tensor.extract
        CHECK: linalg.generic
        CHECK-NOT: cf.assert
        CHECK: arith.minsi
        CHECK-NEXT: tensor.extract
        CHECK: linalg.generic
        CHECK-NOT: arith.minsi
        CHECK: return
    """)


def test_nothing_outside_linalg_bodies_changes():
    payload = parse("""
        func.func @main(%x: tensor<10xf32>, %k: index) -> f32 {
          %r = tensor.extract %x[%k] : tensor<10xf32>
          return %r : f32
        }
    """)
    before = str(payload)
    apply(payload, lambda root: clamp_gather_indices(match(root, "func.func")))
    assert str(payload) == before
