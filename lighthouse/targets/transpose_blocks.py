"""Vector transposes of 32-bit elements in 16 x 16 blocks, and of 16-bit elements in 32-bit
pairs, before the CPU lowering.

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

A 16-bit transpose of [2B, 2B] (32 x 32: each row one 64-byte cache line, the vector tile of a
16-bit transposing op) moves its elements in 32-bit pairs (`transposes_of_row_pairs`): rows
2k and 2k + 1 interleaved by 128-bit lanes (x86's unpack of low and high words) are B words
each, W_lo[k, j] = (x[2k, c_lo(j)], x[2k + 1, c_lo(j)]) and W_hi likewise, with
c_lo(j) = 8 (j div 4) + j mod 4 and c_hi(j) = c_lo(j) + 4; each B x B word block is
transposed by shuffles of its rows (`_transposed_rows`: a vector.transpose of a block built
from rows was folded into one move per element), and its row j, read as 2B 16-bit
elements, is row c(j) of the result:

    T(x)[c(j), 2k + p] = x[2k + p, c(j)]

Each stage is one x86 shuffle per row (unpacks of words, dwords and qwords, selections of
128-bit lanes): 160 for 1024 elements, where a 16 x 16 tile of 16-bit elements took about
100 for 256 (two-source word permutes among them) and read and wrote half cache lines.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, ub, vector

BLOCK = 16
MAX_EXTENT = 64


def _plain_transpose(op: ir.Operation, width: int = 32) -> tuple[int, int] | None:
    """(M, N) of a transpose of `width`-bit elements that swaps the two non-unit dims of its
    source [.., M, .., N, ..] (unit dims anywhere), else None."""
    source = ir.VectorType(op.operands[0].type)
    if getattr(source.element_type, "width", None) != width:
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
                return _zeros(ir.VectorType.get([rows, cols], element))

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


def _zeros(t: ir.VectorType) -> ir.Value:
    element = t.element_type
    return arith.ConstantOp(t, ir.DenseElementsAttr.get_splat(
        t, ir.FloatAttr.get(element, 0.0) if isinstance(element, ir.FloatType)
        else ir.IntegerAttr.get(element, 0))).result


def _pair_columns(high: bool) -> list[int]:
    """c_lo / c_hi (module docstring): the columns whose pairs an unpack of low (high) words
    of two 2B-lane rows holds, in word order."""
    return [8 * (j // 4) + j % 4 + (4 if high else 0) for j in range(BLOCK)]


def _unpack_mask(high: bool) -> list[int]:
    """vector.shuffle mask of two 2B-lane rows a, b: per 128-bit lane, its low (high) four
    elements of a and b interleaved (x86 vpunpcklwd / vpunpckhwd)."""
    return [i for c in _pair_columns(high) for i in (c, 2 * BLOCK + c)]


def _lane_mask(pick) -> list[int]:
    """Shuffle mask of two 16-word rows a, b (b's words numbered 16-31) whose word 4L + i,
    in 128-bit lane L, is pick(L, i)."""
    return [pick(lane, i) for lane in range(4) for i in range(4)]


def _transposed_rows(rows: list[ir.Value]) -> list[ir.Value]:
    """The rows of the transpose of the 16 x 16 words `rows` (16 vector<16xi32>), in four
    stages of 16 two-row shuffles, each one x86 instruction: 32-bit unpacks, 64-bit unpacks
    (then lane L of u[4i + j] is column 4L + j of rows 4i..4i+3), and two selections of
    128-bit lanes (vshufi32x4)."""
    def shuffle(a, b, pick):
        return vector.ShuffleOp(a, b, _lane_mask(pick)).result

    lo32 = lambda lane, i: 4 * lane + i // 2 + (16 if i % 2 else 0)
    hi32 = lambda lane, i: lo32(lane, i) + 2
    lo64 = lambda lane, i: 4 * lane + i % 2 + (16 if i >= 2 else 0)
    hi64 = lambda lane, i: lo64(lane, i) + 2
    t = [shuffle(rows[2 * k], rows[2 * k + 1], hi32 if h else lo32)
         for k in range(8) for h in (0, 1)]
    u = []
    for g in range(4):
        a, b, c, d = t[4 * g:4 * g + 4]
        u += [shuffle(a, c, lo64), shuffle(a, c, hi64), shuffle(b, d, lo64), shuffle(b, d, hi64)]

    def lanes(x, y, first, second):
        """[x.first, x.second, y.first, y.second] in 128-bit lanes."""
        return shuffle(x, y, lambda lane, i: 16 * (lane // 2) + 4 * (first, second)[lane % 2] + i)

    out = [None] * BLOCK
    for j in range(4):
        va, vb = lanes(u[j], u[4 + j], 0, 1), lanes(u[j], u[4 + j], 2, 3)
        wa, wb = lanes(u[8 + j], u[12 + j], 0, 1), lanes(u[8 + j], u[12 + j], 2, 3)
        for lane, (v, w, first) in enumerate([(va, wa, 0), (va, wa, 1), (vb, wb, 0), (vb, wb, 1)]):
            out[4 * lane + j] = lanes(v, w, first, first + 2)
    return out


def transposes_of_row_pairs(payload: ir.Module) -> int:
    """Rewrite each 2-D 16-bit transpose of [2B, 2B] as row pairs transposed as words
    (module docstring); returns the number rewritten."""
    side = 2 * BLOCK
    targets = []

    def leading_units(t: ir.VectorType) -> int | None:
        shape = list(t.shape)
        return len(shape) - 2 if shape[-2:] == [side, side] and all(
            n == 1 for n in shape[:-2]) else None

    def visit(op):
        if op.name == "vector.transpose" and _plain_transpose(op, 16) == (side, side) \
                and leading_units(ir.VectorType(op.operands[0].type)) is not None:
            targets.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    i32 = ir.IntegerType.get_signless(32, payload.context)
    for op in targets:
        element = ir.VectorType(op.operands[0].type).element_type
        row_t = ir.VectorType.get([side], element)
        word_row_t = ir.VectorType.get([BLOCK], i32)
        lead = [0] * leading_units(ir.VectorType(op.operands[0].type))
        with ir.InsertionPoint(op), op.location:
            x = op.operands[0]
            rows = [vector.ExtractOp(x, [], lead + [r]).result for r in range(side)]
            out = ub.PoisonOp(op.results[0].type).result
            for high in (False, True):
                words = [vector.BitCastOp(word_row_t, vector.ShuffleOp(
                    rows[2 * k], rows[2 * k + 1], _unpack_mask(high)).result).result
                    for k in range(BLOCK)]
                for c, row in zip(_pair_columns(high), _transposed_rows(words)):
                    out = vector.InsertOp(vector.BitCastOp(row_t, row).result, out, [],
                                          lead + [c]).result
        op.results[0].replace_all_uses_with(out)
        op.erase()
    return len(targets)
