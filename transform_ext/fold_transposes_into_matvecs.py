"""fold_transposes_into_matvecs: a matrix-vector (or vector-matrix) product reads the tensor
its operand was transposed from, in place.

A target is a contraction C = init + sum_k A x (any linalg op: linalg.matmul with n = 1 or
m = 1, matvec, vecmat, batch_matmul, a generic) whose m dims or n dims all have extent 1,
reading an input T = linalg.transpose(X, perm) through map M. It becomes a linalg.generic
reading X through M composed with the transpose (T[i..] = X[i_perm..]), its body, other
inputs, init and iterators kept:

    T = transpose(A [K, M], [1, 0]);  C[m] = sum_k T[m, k] x[k]   ->  C[m] = sum_k A[k, m] x[k]

The generic runs over the loop dims of extent > 1 only (when its result keeps one; a dot
product keeps its unit dims): operands with axes of unit loop dims are read through
tensor.collapse_shape views without them (rank 0 for one element), the result expanded back
(a.t() @ x with x [K, 1]: C[m, 0] becomes C'[m], the form of torch.mv(a.t(), x); its
[M, 1] accumulator had vectorized to M one-lane vectors, M scalar FMA chains).
The transposed copy is gone (erased when nothing else reads it): tiled per thread, the
copy of an [M, K] view of a [K, M] tensor read each element by a strided scalar gather.
What remains is one of the forms the generic schedule makes fast: k innermost in the
rows' operand (transform_ext.split_matvec_lanes) or the vector x matrix form, lanes along
the rows (A's contiguous dim). Exact: a transpose only moves elements, a unit dim holds one.
A short product (rows on both sides, at most `short_rows` on one, one k dim, at the top
level of its function: x @ W^T for a small batch) is folded too when both its inputs then
read k innermost (W [N, K] in place: the form split_matvec_lanes splits).

Targets: func.func ops; every linalg op nested in them that qualifies (`foldable_inputs`
non-empty: a static-shaped contraction on tensors with one result, m or n dims all of
extent 1 or a short product as above, an input made by linalg.transpose) is rewritten, the
others are left alone. A target that is not a func.func is a silenceable failure, nothing
rewritten. The handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .analysis.structure import dim_positions, is_linalg_op, loop_structure
from .common import (Illegal, RewritesTargets, Success, build_generic, clone_body, defining_op,
                     fail, payload_ops, reassociation_attr, walk_ops)
from .dialect import TransformExt
from .fold_casts_into_contractions import source_map

NAME = "transform_ext.fold_transposes_into_matvecs"


def foldable_inputs(op: ir.Operation, short_rows: int = 0) -> list[int]:
    """The inputs of `op` made by a linalg.transpose, when `op` is a mat-vec or a short
    product whose inputs all read k innermost once folded (see the module docstring);
    else []."""
    if not is_linalg_op(op) or len(op.results) != 1 or not linalg.isa_contraction_op(op):
        return []
    ls = loop_structure(op)
    if not ls.is_static or any(not isinstance(v.type, ir.RankedTensorType) for v in op.operands):
        return []
    transposed = [i for i in range(ls.num_inputs)
                  if (producer := defining_op(op.operands[i])) is not None
                  and producer.name == "linalg.transpose"]
    rows = ls.fewest_rows()
    if rows == 1:
        return transposed
    dims = ls.contraction_dims()
    if rows > short_rows or len(dims["k"]) != 1 or op.parent.name != "func.func":
        return []
    maps = [source_map(defining_op(op.operands[i]), ls.maps[i]) if i in transposed else ls.maps[i]
            for i in range(ls.num_inputs)]
    if any(dim_positions(m)[-1:] != dims["k"] for m in maps):
        return []
    return transposed


def _without_unit_dims(value: ir.Value, amap: ir.AffineMap, kept: list[int]):
    """`value` (read through `amap`) without its axes of unit loop dims (a collapse_shape
    view, each dropped axis merged into a neighbour), its map over the `kept` loops, and
    the reassociation groups of the collapse."""
    positions = dim_positions(amap)
    shape = list(ir.RankedTensorType(value.type).shape)
    axes = [a for a, p in enumerate(positions) if p in kept]
    groups = [[a] for a in axes]  # none: one element, collapsed to rank 0
    for a, p in enumerate(positions):
        if p not in kept and groups:
            owner = next((g for g in reversed(groups) if g[0] < a), groups[0])
            owner.append(a)
    groups = [sorted(g) for g in groups]
    new_map = ir.AffineMap.get(len(kept), 0, [ir.AffineDimExpr.get(kept.index(positions[a]))
                                               for a in axes])
    if len(axes) == len(shape):
        return value, new_map, groups
    t = ir.RankedTensorType(value.type)
    collapsed = tensor.CollapseShapeOp(
        ir.RankedTensorType.get([shape[a] for a in axes], t.element_type), value,
        reassociation_attr(groups)).result
    return collapsed, new_map, groups


def fold(op: ir.Operation, inputs: list[int], rewriter) -> list[ir.Operation]:
    """Replace `op` by a linalg.generic reading the sources of its transposed `inputs`,
    over its loop dims of extent > 1; returns those transposes."""
    ls = loop_structure(op)
    values = list(op.operands[:ls.num_inputs])
    maps = list(ls.maps)
    transposes = []
    for i in inputs:
        producer = defining_op(values[i])
        maps[i] = source_map(producer, maps[i])
        values[i] = producer.operands[0]
        transposes.append(producer)
    init = op.operands[ls.num_inputs]
    kept = [d for d, extent in enumerate(ls.ranges) if extent != 1]
    drop = 0 < len(kept) < ls.num_loops and all(None not in dim_positions(m) for m in maps) \
        and any(d in kept for d in dim_positions(ls.output_map(0)))
    block = op.regions[0].blocks[0]
    with ir.InsertionPoint(op), op.location:
        iterators = ls.iterators
        if drop:
            operands = [_without_unit_dims(v, m, kept) for v, m in zip(values + [init], maps)]
            values, maps = [v for v, _, _ in operands[:-1]], [m for _, m, _ in operands]
            init, out_groups = operands[-1][0], operands[-1][2]
            iterators = [ls.iterators[d] for d in kept]
        new = build_generic(values, [init], maps, iterators,
                            lambda args: clone_body(op, dict(zip(block.arguments, args))))
        result = new.result
        if drop and result.type != op.results[0].type:
            out_type = ir.RankedTensorType(op.results[0].type)
            result = tensor.ExpandShapeOp(out_type, result, reassociation_attr(out_groups), [],
                                          list(out_type.shape)).result
    rewriter.replace_op(op, [result])
    return transposes


class FoldTransposesIntoMatvecsOp(TransformExt.Operation, name="fold_transposes_into_matvecs"):
    target: ext.Operand[transform.AnyOpType]
    short_rows: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                short_rows = ir.IntegerAttr(op.short_rows).value
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a func.func")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    for candidate in walk_ops(target,
                                              lambda o: bool(foldable_inputs(o, short_rows))):
                        for transpose in fold(candidate, foldable_inputs(candidate, short_rows),
                                              rewriter):
                            if not any(list(r.uses) for r in transpose.results):
                                rewriter.erase_op(transpose)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fold_transposes_into_matvecs(target: ir.Value,
                                 short_rows: int = 0) -> FoldTransposesIntoMatvecsOp:
    """Fold the transposes read by the mat-vecs, and by the products of at most `short_rows`
    rows on one side, in the functions of `target` into their indexing maps (see the
    module docstring)."""
    return FoldTransposesIntoMatvecsOp(
        target, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), short_rows))


__all__ = ["FoldTransposesIntoMatvecsOp", "fold_transposes_into_matvecs", "foldable_inputs"]
