"""allocs_to_device: IR (FileCheck), allocs left alone, rejections (message and unchanged
payload). No numerics here (device memory): tests/lighthouse/test_xegpu*.py lower every
payload with inter-kernel buffers to SPIR-V that validates."""

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from transform_ext.allocs_to_device import allocs_to_device

# two static buffers between kernels, a dynamic one and one in a loop
BUFFERS = """
func.func @main(%x: memref<4x8xf32>, %out: memref<4x8xf32>, %n: index) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %a = memref.alloc() {alignment = 64 : i64} : memref<4x8xf32>
  %b = memref.alloc() : memref<8xf32>
  %d = memref.alloc(%n) : memref<?xf32>
  linalg.exp ins(%x : memref<4x8xf32>) outs(%a : memref<4x8xf32>)
  linalg.exp ins(%a : memref<4x8xf32>) outs(%out : memref<4x8xf32>)
  scf.for %i = %c0 to %n step %c1 {
    %l = memref.alloc() : memref<2xf32>
  }
  return
}
"""


def test_function_level_static_buffers_live_in_device_memory():
    payload = parse(BUFFERS)
    apply(payload, lambda root: allocs_to_device(match(root, "func.func")))
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK: %[[A:.*]] = gpu.alloc () : memref<4x8xf32>
        CHECK-NEXT: %[[B:.*]] = gpu.alloc () : memref<8xf32>
        CHECK-NEXT: %[[D:.*]] = memref.alloc(%arg2) : memref<?xf32>
        CHECK-NEXT: linalg.exp ins(%arg0 : memref<4x8xf32>) outs(%[[A]] : memref<4x8xf32>)
        CHECK-NEXT: linalg.exp ins(%[[A]] : memref<4x8xf32>) outs(%arg1 : memref<4x8xf32>)
        CHECK: scf.for
        CHECK-NEXT: memref.alloc() : memref<2xf32>
        CHECK: gpu.dealloc %[[A]] : memref<4x8xf32>
        CHECK-NEXT: gpu.dealloc %[[B]] : memref<8xf32>
        CHECK-NEXT: return
    """)


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(BUFFERS)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: allocs_to_device(match(root, "memref.alloc")))
    assert "transform_ext.allocs_to_device: memref.alloc" in message
    assert "not a func.func" in message
    assert str(payload) == before


def test_rejects_a_function_of_several_blocks():
    payload = parse("""
        func.func @main(%x: memref<4xf32>) {
          %a = memref.alloc() : memref<4xf32>
          cf.br ^bb1
        ^bb1:
          return
        }
    """)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: allocs_to_device(match(root, "func.func")))
    assert "transform_ext.allocs_to_device: func.func" in message
    assert "a body of 2 blocks (one expected)" in message
    assert str(payload) == before
