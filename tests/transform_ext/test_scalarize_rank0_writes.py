"""scalarize_rank0_writes: a 0-d vector written to a rank-0 buffer becomes vector.extract +
memref.store, a 4-wide write stays (FileCheck); a 0-d write into a tensor is refused."""

from schedules.common import match
from transform_ext.scalarize_rank0_writes import scalarize_rank0_writes
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

WRITES = """
func.func @main(%m: memref<f32>, %v: memref<4xf32>) {
  %c0 = arith.constant 0 : index
  %s = arith.constant dense<1.0> : vector<f32>
  %w = arith.constant dense<2.0> : vector<4xf32>
  vector.transfer_write %s, %m[] : vector<f32>, memref<f32>
  vector.transfer_write %w, %v[%c0] {in_bounds = [true]} : vector<4xf32>, memref<4xf32>
  return
}
"""


def test_a_rank0_write_is_a_scalar_store():
    payload = parse(WRITES)
    apply(payload, lambda root: scalarize_rank0_writes(match(root, "func.func")))
    check(str(payload), """
        CHECK: func.func @main(%[[M:.*]]: memref<f32>, %[[V:.*]]: memref<4xf32>)
        CHECK: %[[S:.*]] = vector.extract %{{.*}}[] : f32 from vector<f32>
        CHECK-NEXT: memref.store %[[S]], %[[M]][] : memref<f32>
        CHECK-NEXT: vector.transfer_write %{{.*}}, %[[V]][%{{.*}}] {in_bounds = [true]} : vector<4xf32>, memref<4xf32>
    """)
    assert str(payload).count("vector.transfer_write") == 1


def test_rejects_a_rank0_write_into_a_tensor():
    payload = parse("""
        func.func @main(%t: tensor<f32>) -> tensor<f32> {
          %s = arith.constant dense<1.0> : vector<f32>
          %r = vector.transfer_write %s, %t[] : vector<f32>, tensor<f32>
          return %r : tensor<f32>
        }
    """)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: scalarize_rank0_writes(match(root, "func.func")))
    assert "transform_ext.scalarize_rank0_writes: vector.transfer_write" in message
    assert "writes a 0-d vector into tensor<f32>" in message
    assert str(payload) == before
