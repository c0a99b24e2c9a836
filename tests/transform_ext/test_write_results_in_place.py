"""write_results_in_place: IR (FileCheck) for expand and collapse chains, copies left alone,
rejection (message and unchanged payload). Numerics: the CPU target applies it after
bufferization (tests/lighthouse/test_cpu_lowering.py checks an attention result written
in place and a buffer returned twice against torch; tests/lighthouse/test_examples.py runs
every example), the XeGPU target likewise (tests/lighthouse/test_xegpu_attention.py: one
kernel, no scratch buffer)."""

from schedules.common import match
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from transform_ext.write_results_in_place import write_results_in_place

# exp(x) computed in a [4, 8] buffer and returned as [1, 4, 8]
EXPANDED = """
func.func @main(%x: memref<4x8xf32>, %out: memref<1x4x8xf32>) {
  %a = memref.alloc() {alignment = 64 : i64} : memref<4x8xf32>
  linalg.exp ins(%x : memref<4x8xf32>) outs(%a : memref<4x8xf32>)
  %e = memref.expand_shape %a [[0, 1], [2]] output_shape [1, 4, 8] : memref<4x8xf32> into memref<1x4x8xf32>
  memref.copy %e, %out : memref<1x4x8xf32> to memref<1x4x8xf32>
  return
}
"""


def _in_place(payload, names="func.func"):
    apply(payload, lambda root: write_results_in_place(match(root, names)))


def test_the_result_is_computed_in_a_collapsed_view_of_the_out_parameter():
    payload = parse(EXPANDED)
    _in_place(payload)
    check(payload, """
        CHECK-LABEL: func.func @main(%arg0: memref<4x8xf32>, %arg1: memref<1x4x8xf32>)
        CHECK-NEXT: %[[V:.*]] = memref.collapse_shape %arg1 {{\\[\\[}}0, 1], [2]] : memref<1x4x8xf32> into memref<4x8xf32>
        CHECK-NEXT: linalg.exp ins(%arg0 : memref<4x8xf32>) outs(%[[V]] : memref<4x8xf32>)
        CHECK-NEXT: return
    """)


def test_a_chain_of_reshapes_is_undone_in_reverse():
    payload = parse("""
        func.func @main(%x: memref<1x32xf32>, %out: memref<4x8xf32>) {
          %a = memref.alloc() : memref<1x32xf32>
          linalg.exp ins(%x : memref<1x32xf32>) outs(%a : memref<1x32xf32>)
          %c = memref.collapse_shape %a [[0, 1]] : memref<1x32xf32> into memref<32xf32>
          %e = memref.expand_shape %c [[0, 1]] output_shape [4, 8] : memref<32xf32> into memref<4x8xf32>
          memref.copy %e, %out : memref<4x8xf32> to memref<4x8xf32>
          return
        }
    """)
    _in_place(payload)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK-NEXT: %[[C:.*]] = memref.collapse_shape %arg1 {{\\[\\[}}0, 1]] : memref<4x8xf32> into memref<32xf32>
        CHECK-NEXT: %[[E:.*]] = memref.expand_shape %[[C]] {{\\[\\[}}0, 1]] output_shape [1, 32] : memref<32xf32> into memref<1x32xf32>
        CHECK-NEXT: linalg.exp ins(%arg0 : memref<1x32xf32>) outs(%[[E]] : memref<1x32xf32>)
        CHECK-NEXT: return
    """)


def test_a_buffer_used_after_the_copy_or_copied_into_is_left_alone():
    later_use = EXPANDED.replace("  return\n", "  linalg.exp ins(%x : memref<4x8xf32>) outs(%a : memref<4x8xf32>)\n  return\n")
    copied_into = EXPANDED.replace("  linalg.exp ins(%x : memref<4x8xf32>) outs(%a : memref<4x8xf32>)\n",
                                   "  memref.copy %x, %a : memref<4x8xf32> to memref<4x8xf32>\n")
    no_reshape = """
        func.func @main(%x: memref<4x8xf32>, %out: memref<4x8xf32>) {
          %a = memref.alloc() : memref<4x8xf32>
          linalg.exp ins(%x : memref<4x8xf32>) outs(%a : memref<4x8xf32>)
          memref.copy %a, %out : memref<4x8xf32> to memref<4x8xf32>
          return
        }
    """
    for text in (later_use, copied_into, no_reshape):
        payload = parse(text)
        before = str(payload)
        _in_place(payload)
        assert str(payload) == before


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(EXPANDED)
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: write_results_in_place(match(root, "memref.copy")))
    assert "transform_ext.write_results_in_place: memref.copy" in message
    assert "not a func.func" in message
    assert str(payload) == before
