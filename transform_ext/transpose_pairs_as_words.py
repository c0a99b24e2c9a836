"""transpose_pairs_as_words: a vector.transpose of 16-bit pairs that keeps each pair whole is
a 2-D transpose of 32-bit words.

    %t = vector.transpose %v, [1, 0, 2] : vector<R x C x 2 x bf16> to vector<C x R x 2 x bf16>
  ->  %w = vector.bitcast (vector.shape_cast %v : vector<R x 2C x bf16>) : vector<R x C x i32>
      %t = vector.shape_cast (vector.bitcast (vector.transpose %w, [1, 0]) : vector<C x 2R x bf16>)
             : vector<C x R x 2 x bf16>

Exact: the bits move as they are (a pair is the word it bitcasts to). Legal for a transpose
of a vector with 16-bit elements (bf16, f16, i16) whose innermost dim has extent 2 and stays
innermost, and whose other dims of extent > 1 are two, swapped (unit dims anywhere). The
2-D word transpose then lowers like any other (one shuffle, or the 16 x 16 scheme), where
the 3-D one became one extract and insert per pair. (A bf16 matmul packs its A panel, k in
pairs innermost, so: [MR, k pairs, 2] -> [k pairs, MR, 2].)

Rewritten: every legal vector.transpose nested in the targets (the others are left as they
are); nothing is illegal but a target that is not a func.func (a silenceable failure,
nothing rewritten). The transposes are replaced; the handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform, vector

from .common import RewritesTargets, ops_named, rewrite_functions
from .dialect import TransformExt

NAME = "transform_ext.transpose_pairs_as_words"


def swapped_dims(op: ir.Operation):
    """(R, C), the extents of the two dims of a legal transpose (see the module docstring)
    in source order, else None."""
    source_t = ir.VectorType(op.operands[0].type)
    shape = list(source_t.shape)
    element = source_t.element_type
    if not (isinstance(element, (ir.BF16Type, ir.F16Type)) or
            (isinstance(element, ir.IntegerType) and ir.IntegerType(element).width == 16)):
        return None
    perm = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    rank = len(shape)
    if rank < 3 or shape[-1] != 2 or perm[-1] != rank - 1 or source_t.scalable:
        return None
    wide = [d for d in range(rank - 1) if shape[d] != 1]
    moved = [d for d in perm[:-1] if shape[d] != 1]
    if len(wide) != 2 or moved != wide[::-1]:
        return None
    return shape[wide[0]], shape[wide[1]]


def rewrite(op: ir.Operation, rows: int, cols: int, rewriter) -> None:
    """Replace the transpose by the word transpose (the module docstring)."""
    element = ir.VectorType(op.operands[0].type).element_type
    i32 = ir.IntegerType.get_signless(32)
    with ir.InsertionPoint(op), op.location:
        halves = vector.shape_cast(ir.VectorType.get([rows, 2 * cols], element), op.operands[0])
        words = vector.bitcast(ir.VectorType.get([rows, cols], i32), halves)
        moved = vector.transpose(ir.VectorType.get([cols, rows], i32), words, [1, 0])
        back = vector.bitcast(ir.VectorType.get([cols, 2 * rows], element), moved)
        result = vector.shape_cast(op.results[0].type, back)
    rewriter.replace_op(op, [result])


def rewrite_in(root: ir.Operation, rewriter) -> int:
    """Rewrite the legal transposes under `root`; returns how many."""
    found = [(t, dims) for t in ops_named(root, "vector.transpose") if (dims := swapped_dims(t))]
    for t, (rows, cols) in found:
        rewrite(t, rows, cols, rewriter)
    return len(found)


class TransposePairsAsWordsOp(TransformExt.Operation, name="transpose_pairs_as_words"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return rewrite_functions(NAME, op, rewriter, state, rewrite_in)

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def transpose_pairs_as_words(func: ir.Value) -> TransposePairsAsWordsOp:
    """Transpose the whole 16-bit pairs of the functions of `func` as 32-bit words."""
    return TransposePairsAsWordsOp(func)


__all__ = ["TransposePairsAsWordsOp", "rewrite_in", "swapped_dims", "transpose_pairs_as_words"]
