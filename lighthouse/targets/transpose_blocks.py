"""Vector transposes of 32-bit elements in 16 x 16 blocks, before the CPU lowering.

The lowering turns a 16 x 16 vector.transpose into shuffles of whole registers
(`Shuffle16x16`); any other shape into one shuffle of all its lanes, which LLVM emits
element by element (a convolution's 11 x 32 register tile transposed back to channels-first
became 32 scatters: 10% of KernelBench 50's time). A 2-D transpose (up to unit dims)
[M, N] -> [N, M] with 8 < M, N <= 64 is rewritten here as: the source zero-padded to
[Mp, Np] (multiples of 16), each 16 x 16 block transposed into its place in an [Np, Mp]
result, whose [N, M] corner is the value (both extents above 8: an 8 x 8 tile, AVX2's
lanes, would do four times the work padded):

    T(x)[j, i] = x[i, j]  for i < M, j < N   (the padding is never read)

Every element is moved as before; the rewrite is exact.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, vector

BLOCK = 16
MAX_EXTENT = 64


def _plain_transpose(op: ir.Operation) -> tuple[int, int] | None:
    """(M, N) of a transpose of 32-bit elements that swaps the two non-unit dims of its
    source [.., M, .., N, ..] (unit dims anywhere), else None."""
    source = ir.VectorType(op.operands[0].type)
    if getattr(source.element_type, "width", None) != 32:
        return None
    shape = list(source.shape)
    big = [d for d, n in enumerate(shape) if n != 1]
    if len(big) != 2:
        return None
    perm = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    moved = [d for d in perm if shape[d] != 1]
    if moved != big[::-1]:
        return None
    return shape[big[0]], shape[big[1]]


def transposes_in_16x16_blocks(payload: ir.Module) -> int:
    """Rewrite each 2-D transpose of 32-bit elements (module docstring) of extents in
    (8, 64] that is not already 16 x 16; returns the number rewritten."""
    targets = []

    def visit(op):
        if op.name == "vector.transpose":
            mn = _plain_transpose(op)
            if mn is not None and mn != (BLOCK, BLOCK) and max(mn) <= MAX_EXTENT \
                    and min(mn) > BLOCK // 2:
                targets.append((op, mn))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    for op, (m, n) in targets:
        element = ir.VectorType(op.operands[0].type).element_type
        mp, np_ = -(-m // BLOCK) * BLOCK, -(-n // BLOCK) * BLOCK
        with ir.InsertionPoint(op), op.location:
            def zeros(rows, cols):
                t = ir.VectorType.get([rows, cols], element)
                return arith.ConstantOp(t, ir.DenseElementsAttr.get_splat(
                    t, ir.FloatAttr.get(element, 0.0) if isinstance(element, ir.FloatType)
                    else ir.IntegerAttr.get(element, 0))).result

            flat = vector.ShapeCastOp(ir.VectorType.get([m, n], element), op.operands[0]).result
            padded = vector.InsertStridedSliceOp(flat, zeros(mp, np_), [0, 0], [1, 1]).result
            out = zeros(np_, mp)
            block = ir.VectorType.get([BLOCK, BLOCK], element)
            for i in range(0, mp, BLOCK):
                for j in range(0, np_, BLOCK):
                    piece = vector.ExtractStridedSliceOp(block, padded, [i, j], [BLOCK, BLOCK],
                                                         [1, 1]).result
                    flipped = vector.TransposeOp(block, piece, [1, 0]).result
                    out = vector.InsertStridedSliceOp(flipped, out, [j, i], [1, 1]).result
            corner = vector.ExtractStridedSliceOp(ir.VectorType.get([n, m], element), out,
                                                  [0, 0], [n, m], [1, 1]).result
            value = vector.ShapeCastOp(op.results[0].type, corner).result
        op.results[0].replace_all_uses_with(value)
        op.erase()
    return len(targets)
