"""fold_key_transpose: keys-major scores read K in place of K^T, scales moved to Q^T.

For each target S^T = K Q^T (a scores contraction stored keys-major, see
store_scores_keys_major) whose K operand is

    K^T = c_k transpose(K)       (through a tensor.collapse_shape; c_k a constant or absent)

read by S^T only: S^T reads K itself, its indexing map's last two results swapped. c_k, and
a constant scale of the scores themselves (c_s S or S / c_s, when that is S's only reader,
which then goes: a hand-written `q @ k^T / sqrt(d)`), move to Q^T:

    S^T[j, i] = sum_d (c_k K[j, d]) Q^T[d, i] c_s = sum_d K[j, d] ((c_k c_s) Q^T[d, i])

Q^T is scaled by its producer's f32 scale constant when it has one, else by an elementwise
generic computing x * (c_k c_s) in f32 (rounded back to x's type). Exact up to the rounding
of the products (exact when the scales are powers of two, as 1/sqrt(d) for d = 4^n).

A target whose K operand is not such a transpose is left unchanged. A target that is not a
linalg.generic contraction with one key and one depth dim is a silenceable failure naming
it (nothing rewritten). In-place: the target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, tensor, transform

from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, RewritesTargets, Success, build_generic, defining_op, fail,
                     payload_ops, reassociation_attr)
from .dialect import TransformExt
from .store_scores_keys_major import is_generic, set_map, swap_last_two, transposed_type, uses

NAME = "transform_ext.fold_key_transpose"


def _scale_constant(op) -> tuple[ir.Operation, int, str] | None:
    """For an elementwise generic whose body is `in * c`, `c * in` or `in / c` with c a
    float constant of the argument's type: (the mulf/divf, the operand position of c,
    "mul" or "div"); None otherwise."""
    if not is_generic(op) or len(op.results) != 1 or not loop_structure(op).is_elementwise \
            or loop_structure(op).num_inputs != 1:
        return None
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    if len(ops) != 2 or ops[0].name not in ("arith.mulf", "arith.divf") or \
            ops[1].operands[0] != ops[0].results[0]:
        return None
    scale = ops[0]
    positions = (0, 1) if scale.name == "arith.mulf" else (1,)
    for pos in positions:
        c = defining_op(scale.operands[pos])
        if c is not None and c.name == "arith.constant" and \
                scale.operands[1 - pos] == body.arguments[0]:
            return scale, pos, "mul" if scale.name == "arith.mulf" else "div"
    return None


def _factor_of(found) -> float:
    """The multiplier a _scale_constant applies: c, or 1 / c for a division."""
    scale, pos, kind = found
    c = ir.FloatAttr(defining_op(scale.operands[pos]).attributes["value"]).value
    return c if kind == "mul" else 1.0 / c


def _key_source(value: ir.Value):
    """(K, reassociation groups or None, the scale of K^T) when `value` is
    [c *] [collapse_shape] transpose(K) with the last two dims swapped; None otherwise."""
    factor = 1.0
    scale = defining_op(value)
    found = _scale_constant(scale) if scale is not None else None
    if found is not None:
        factor = _factor_of(found)
        value = scale.operands[0]
    groups = None
    reshape = defining_op(value)
    if reshape is not None and reshape.name == "tensor.collapse_shape":
        groups = [[ir.IntegerAttr(i).value for i in g] for g in reshape.attributes["reassociation"]]
        value = reshape.operands[0]
        if groups[-2:] != [[value.type.rank - 2], [value.type.rank - 1]]:
            return None
    transpose = defining_op(value)
    if transpose is None or transpose.name != "linalg.transpose":
        return None
    perm = list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"]))
    rank = len(perm)
    if perm != list(range(rank - 2)) + [rank - 1, rank - 2]:
        return None
    return transpose.operands[0], groups, factor


def check(scores: ir.Operation) -> None:
    """Raise Illegal unless `scores` is a linalg.generic contraction with one key (n) and
    one depth (k) dim."""
    if not is_generic(scores) or not loop_structure(scores).is_contraction:
        raise Illegal(scores, "not a linalg.generic contraction")
    dims = loop_structure(scores).contraction_dims()
    if len(dims["n"]) != 1 or len(dims["k"]) != 1:
        raise Illegal(scores, "not one key and one depth dim")


def fold(scores: ir.Operation, rewriter) -> None:
    """The rewrite of the module docstring on one checked target (a no-op when its K
    operand is not a single-use scaled transpose)."""
    ls = loop_structure(scores)
    dims = ls.contraction_dims()
    key, depth = dims["n"][0], dims["k"][0]
    k_index = next((i for i in range(ls.num_inputs)
                    if dim_positions(ls.maps[i])[-2:] == [depth, key]), None)
    q_index = next((i for i in range(ls.num_inputs) if i != k_index), None)
    if k_index is None or q_index is None or len(list(scores.operands[k_index].uses)) != 1:
        return
    source = _key_source(scores.operands[k_index])
    if source is None:
        return
    k, groups, factor = source
    score_scale = None
    readers = uses(scores.results[0])
    if len(readers) == 1:
        reader = readers[0][0]
        found = _scale_constant(reader)
        if found is not None and loop_structure(reader).maps[0] == \
                loop_structure(reader).output_map(0) and reader.results[0].type == scores.results[0].type:
            score_scale = reader
            factor *= _factor_of(found)
    if groups is not None:
        with ir.InsertionPoint(scores), scores.location:
            shape = list(transposed_type(scores.operands[k_index].type).shape)
            k = tensor.CollapseShapeOp(ir.RankedTensorType.get(shape, k.type.element_type), k,
                                       reassociation_attr(groups)).result
    scores.operands[k_index] = k
    set_map(scores, k_index, swap_last_two(ls.maps[k_index]))
    if score_scale is not None:
        rewriter.replace_op(score_scale, [scores.results[0]])
    if factor != 1.0:
        _scale_operand(scores, q_index, factor)


def _scale_operand(op: ir.Operation, index: int, factor: float) -> None:
    """Operand `index` of `op` (read by `op` only) multiplied by `factor`: in its producer's
    f32 scale constant when it has one, else by an elementwise generic computing
    x * factor in f32 (rounded back to x's type)."""
    value = op.operands[index]
    producer = defining_op(value)
    found = _scale_constant(producer) if producer is not None else None
    f32 = ir.F32Type.get()
    if found is not None and found[0].results[0].type == f32:
        scale, pos, kind = found
        new = _factor_of(found) * factor
        with ir.InsertionPoint(scale), scale.location:
            scale.operands[pos] = arith.ConstantOp(f32, ir.FloatAttr.get(
                f32, new if kind == "mul" else 1.0 / new)).result
        return
    t = value.type
    etype = t.element_type
    identity = ir.AffineMap.get_identity(t.rank)

    def body(args):
        x = args[0] if etype == f32 else arith.extf(f32, args[0])
        y = arith.mulf(x, arith.ConstantOp(f32, ir.FloatAttr.get(f32, factor)).result)
        return [y if etype == f32 else arith.truncf(etype, y)]

    with ir.InsertionPoint(op), op.location:
        empty = tensor.EmptyOp(list(t.shape), etype).result
        scaled = build_generic([value], [empty], [identity, identity], ["parallel"] * t.rank, body)
    op.operands[index] = scaled.results[0]


class FoldKeyTransposeOp(TransformExt.Operation, name="fold_key_transpose"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        check(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    fold(target, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fold_key_transpose(scores: ir.Value) -> None:
    """Read K in place of K^T in each keys-major scores contraction of `scores`, moving the
    constant scales to Q^T (see the module docstring)."""
    FoldKeyTransposeOp(scores)


__all__ = ["FoldKeyTransposeOp", "fold_key_transpose"]
