"""contraction_in_vnni_pairs: a bf16 contraction whose second factor is a transpose made
for it reads both factors in pairs of k, the layout of AMX's tdpbf16ps.

For each target C[m, n] += extf(A[m, k]) * extf(B[k, n]) (a linalg.generic on tensors, f32
C, bf16 A and B, one reduction dim k, K even) where A's k is its innermost axis and
B = transpose(X) with X[n, k]:

    A2[m, p, v] = A[m, 2p + v]               (tensor.expand_shape: A read in place)
    B2[p, n, v] = X[n, 2p + v]               (linalg.transpose of X expanded, permutation
                                              [1, 0, 2]: X's pairs of k kept together)
    C[m, n] += extf(A2[m, p, v]) * extf(B2[p, n, v])   over p < K/2, v < 2

The same products summed in another order (k split into p and v); the new loops are
(m, n, p, v). C and the op's other attributes (marks) stay. B's transpose stays when
something else reads it. `contraction_loops_to_amx_tiles` runs a bufferized 16-pair step
of the result on AMX tiles: A2 rows and B2 rows are 64-byte tile rows.

A target that is not such a contraction is a silenceable failure naming the reason (nothing
rewritten). The target handle is consumed; the result holds the new contractions.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, Success, build_generic, defining_op, fail, keep_attributes,
                     payload_ops, reassociation_attr, ReplacesTargets)
from .contraction_loops_to_amx_tiles import is_multiply_add
from .dialect import TransformExt

NAME = "transform_ext.contraction_in_vnni_pairs"


def _pair_operands(op: ir.Operation) -> tuple[int, int, ir.Value]:
    """(index of A, index of B, X) of a target the module docstring names; Illegal
    otherwise."""
    if op.name != "linalg.generic":
        raise Illegal(op, "not a linalg.generic")
    view = op.opview
    inputs, outputs = list(view.inputs), list(view.outputs)
    if len(inputs) != 2 or len(outputs) != 1 or not all(
            isinstance(v.type, ir.RankedTensorType) and v.type.has_static_shape
            for v in inputs + outputs):
        raise Illegal(op, "not two static tensor inputs and one output")
    types = [v.type.element_type for v in inputs + outputs]
    if not (all(isinstance(t, ir.BF16Type) for t in types[:2])
            and isinstance(types[2], ir.F32Type)):
        raise Illegal(op, "not bf16 factors into an f32 accumulator")
    if not is_multiply_add(op):
        raise Illegal(op, "its body is not C + extf(A) * extf(B)")
    ls = loop_structure(op)
    if len(ls.reduction_dims) != 1 or ls.num_loops != 3:
        raise Illegal(op, "not three loops with one reduction dim")
    k = ls.reduction_dims[0]
    maps = [dim_positions(m) for m in ls.maps]
    if any(None in m for m in maps) or len(maps[2]) != 2 or k in maps[2]:
        raise Illegal(op, "its indexing maps are not projected permutations onto C[m, n]")
    for a in (0, 1):
        b = 1 - a
        if len(maps[a]) == 2 and maps[a][1] == k and len(maps[b]) == 2 and maps[b][0] == k \
                and maps[a][0] == maps[2][0] and maps[b][1] == maps[2][1]:
            break
    else:
        raise Illegal(op, "its factors are not A[m, k] (k innermost) and B[k, n]")
    depth = inputs[a].type.shape[1]
    if depth % 2:
        raise Illegal(op, f"its depth {depth} is odd: no pairs")
    transpose = defining_op(inputs[b])
    if transpose is None or transpose.name != "linalg.transpose" or \
            list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"])) != [1, 0]:
        raise Illegal(op, "its B is not a transpose of X[n, k]")
    return a, b, transpose.operands[0]


def in_pairs(value: ir.Value) -> ir.Value:
    """`value` [.., K] as [.., K/2, 2] (tensor.expand_shape at the insertion point: read in
    place)."""
    shape = list(value.type.shape)
    rank = len(shape)
    result = ir.RankedTensorType.get(shape[:-1] + [shape[-1] // 2, 2], value.type.element_type)
    groups = [[i] for i in range(rank - 1)] + [[rank - 1, rank]]
    return tensor.ExpandShapeOp(result, value, reassociation_attr(groups), [],
                                list(result.shape)).result


def transposed_pairs(x: ir.Value) -> ir.Value:
    """X^T for X [N, K] as pairs [K/2, N, 2], P[p, n, v] = X[n, 2p + v] (at the insertion
    point): X's pairs kept together, the VNNI layout of X^T."""
    x2 = in_pairs(x)
    rows, pairs = x2.type.shape[0], x2.type.shape[1]
    empty = tensor.EmptyOp([pairs, rows, 2], x2.type.element_type).result
    return linalg.transpose(x2, outs=[empty], permutation=[1, 0, 2]).results[0]


def rewrite(op: ir.Operation, a: int, b: int, x: ir.Value, rewriter) -> ir.Operation:
    """The rewrite of the module docstring on one checked target; returns the new generic,
    whose loops are (m, n, p, v)."""
    transpose = defining_op(op.operands[b])
    with ir.InsertionPoint(transpose), transpose.location:
        b2 = transposed_pairs(x)
    with ir.InsertionPoint(op), op.location:
        a2 = in_pairs(op.operands[a])

        def amap(*dims):
            return ir.AffineMap.get(4, 0, [ir.AffineDimExpr.get(d) for d in dims], op.context)

        maps, inputs = [None, None, amap(0, 1)], [None, None]
        maps[a], maps[b] = amap(0, 2, 3), amap(2, 1, 3)
        inputs[a], inputs[b] = a2, b2
        f32 = ir.F32Type.get()

        def body(args):
            return [arith.addf(args[2], arith.mulf(arith.extf(f32, args[0]),
                                                   arith.extf(f32, args[1])))]

        new = build_generic(inputs, [op.operands[2]], maps,
                            ["parallel", "parallel", "reduction", "reduction"], body, name_from=op)
    keep_attributes(op, new)
    rewriter.replace_op(op, list(new.results))
    if not list(transpose.results[0].uses):
        rewriter.erase_op(transpose)
    return new


class ContractionInVnniPairsOp(TransformExt.Operation, name="contraction_in_vnni_pairs"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    plans = [(t, *_pair_operands(t)) for t in targets]
                except Illegal as illegal:
                    results.set_ops(op.result, [])
                    return fail(NAME, illegal)
                results.set_ops(op.result, [rewrite(*plan, rewriter) for plan in plans])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def contraction_in_vnni_pairs(contractions: ir.Value) -> ir.Value:
    """Each bf16 contraction of `contractions` reading a transpose made for it, in pairs of
    k (see the module docstring); returns the new contractions."""
    return ContractionInVnniPairsOp(contractions).result


__all__ = ["ContractionInVnniPairsOp", "contraction_in_vnni_pairs", "in_pairs",
           "transposed_pairs"]
