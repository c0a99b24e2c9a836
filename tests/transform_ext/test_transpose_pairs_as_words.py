"""transpose_pairs_as_words: the IR (FileCheck) of the transposes it rewrites (an A panel's
[MR, pairs, 2] -> [pairs, MR, 2], with unit dims) and of those it leaves (the pair moved,
32-bit elements, three wide dims, no pair innermost); the numerics of the lowered rewrite."""

import ctypes

import numpy as np
import pytest
from torch_mlir import ir
from torch_mlir.runtime import get_ranked_memref_descriptor

from lighthouse.targets.cpu import lower_to_llvm
from schedules.common import match
from transform_ext.transpose_pairs_as_words import transpose_pairs_as_words
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse

TRANSPOSE = """
func.func @f(%v: vector<{src}x{t}>) -> vector<{dst}x{t}> {{
  %r = vector.transpose %v, [{perm}] : vector<{src}x{t}> to vector<{dst}x{t}>
  return %r : vector<{dst}x{t}>
}}
"""


def transpose(src, perm, t="bf16"):
    dst = [src[p] for p in perm]
    return TRANSPOSE.format(src="x".join(map(str, src)), dst="x".join(map(str, dst)), t=t,
                            perm=", ".join(map(str, perm)))


def rewritten(text: str) -> ir.Module:
    payload = parse(text)
    apply(payload, lambda root: transpose_pairs_as_words(match(root, "func.func")))
    return payload


def test_a_panel_of_pairs_is_a_transpose_of_words():
    check(rewritten(transpose([8, 16, 2], [1, 0, 2])), """
        CHECK: %[[H:.*]] = vector.shape_cast %arg0 : vector<8x16x2xbf16> to vector<8x32xbf16>
        CHECK: %[[W:.*]] = vector.bitcast %[[H]] : vector<8x32xbf16> to vector<8x16xi32>
        CHECK: %[[T:.*]] = vector.transpose %[[W]], [1, 0] : vector<8x16xi32> to vector<16x8xi32>
        CHECK: %[[B:.*]] = vector.bitcast %[[T]] : vector<16x8xi32> to vector<16x16xbf16>
        CHECK: vector.shape_cast %[[B]] : vector<16x16xbf16> to vector<16x8x2xbf16>
        CHECK-NOT: vector.transpose {{.*}}bf16
    """)


def test_unit_dims_go_with_the_shape_casts():
    check(rewritten(transpose([1, 8, 1, 4, 2], [0, 3, 2, 1, 4], t="f16")), """
        CHECK: vector.shape_cast %arg0 : vector<1x8x1x4x2xf16> to vector<8x8xf16>
        CHECK: vector.transpose {{.*}}, [1, 0] : vector<8x4xi32> to vector<4x8xi32>
        CHECK: vector.shape_cast {{.*}} : vector<4x16xf16> to vector<1x4x1x8x2xf16>
    """)


@pytest.mark.parametrize("src,perm,t", [
    ([2, 8, 16], [0, 2, 1], "bf16"),      # the pair's dim moves
    ([8, 16, 2], [1, 0, 2], "f32"),       # 32-bit elements
    ([4, 8, 16, 2], [2, 1, 0, 3], "bf16"),  # three wide dims
    ([8, 16, 4], [1, 0, 2], "bf16"),      # quads, not pairs
], ids=["pair_moved", "f32", "three_dims", "quads"])
def test_other_transposes_are_left_alone(src, perm, t):
    payload = parse(transpose(src, perm, t))
    before = str(payload)
    apply(payload, lambda root: transpose_pairs_as_words(match(root, "func.func")))
    assert str(payload) == before


def test_a_target_that_is_not_a_function_fails():
    payload = parse(transpose([8, 16, 2], [1, 0, 2]))
    message = apply_expect_failure(payload, lambda root: transpose_pairs_as_words(
        match(root, "vector.transpose")))
    assert "not a func.func" in message


@pytest.mark.parametrize("rows,cols", [(8, 8), (8, 16), (3, 5)])
def test_lowered_transpose_moves_every_pair(rows, cols):
    """[rows, cols, 2] i16 bits -> [cols, rows, 2], lowered as the matmul lowers it (one
    shuffle of words) and run: out[c, r, p] == in[r, c, p]."""
    from torch_mlir.dialects import transform
    from torch_mlir.dialects.transform import vector as tvec
    from torch_mlir.execution_engine import ExecutionEngine

    n = rows * cols * 2
    text = f"""
    func.func @f(%A: memref<{n}xbf16>, %B: memref<{n}xbf16>) attributes {{llvm.emit_c_interface}} {{
      %c0 = arith.constant 0 : index
      %flat = vector.load %A[%c0] : memref<{n}xbf16>, vector<{n}xbf16>
      %v = vector.shape_cast %flat : vector<{n}xbf16> to vector<{rows}x{cols}x2xbf16>
      %t = vector.transpose %v, [1, 0, 2] : vector<{rows}x{cols}x2xbf16> to vector<{cols}x{rows}x2xbf16>
      %out = vector.shape_cast %t : vector<{cols}x{rows}x2xbf16> to vector<{n}xbf16>
      vector.store %out, %B[%c0] : memref<{n}xbf16>, vector<{n}xbf16>
      return
    }}
    """

    def body(root):
        func = match(root, "func.func")
        transpose_pairs_as_words(func)
        with ir.InsertionPoint(transform.ApplyPatternsOp(func).patterns):
            tvec.ApplyLowerTransposePatternsOp(lowering_strategy=tvec.VectorTransposeLowering.Shuffle1D)
        with ir.InsertionPoint(transform.ApplyPatternsOp(func).patterns):
            tvec.ApplyLowerShapeCastPatternsOp()
            tvec.ApplyLowerBitCastPatternsOp()

    payload = parse(text)
    apply(payload, body)
    assert "vector.transpose" not in str(payload)
    with payload.context, ir.Location.unknown():
        lower_to_llvm(payload, threads=1)
    engine = ExecutionEngine(payload, opt_level=2)
    a = np.arange(n, dtype=np.int16) + 1
    b = np.zeros(n, np.int16)
    args = [ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(x))) for x in (a, b)]
    engine.invoke("f", *args)
    np.testing.assert_array_equal(b.reshape(cols, rows, 2), a.reshape(rows, cols, 2).transpose(1, 0, 2))
