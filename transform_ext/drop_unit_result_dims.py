"""drop_unit_result_dims: a linalg.generic that writes unit dims of its result through constant
indices (a keepdim reduction: y[n, c, 0, 0] = sum_{h, w} x[n, c, h, w]) writes the result
without them, expanded back after:

    Y = expand_shape(G'(collapse_shape(I)))

with G' the op whose output map drops the constant results (the loops that indexed nothing
else stay reductions). Exact: the same elements. The tiling and vectorization of linalg
take the projected-permutation output map that is left.

Targets: linalg.generic ops with one output whose map holds constant 0 results (on unit dims)
beside at least one dim; otherwise a silenceable failure naming the op, nothing rewritten.
Result: the rewritten generics. The target handle is consumed.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, build_generic, clone_body, fail, i64_array,
                     payload_ops, reassociation_attr)
from .dialect import TransformExt

NAME = "transform_ext.drop_unit_result_dims"


def kept_result_dims(op: ir.Operation) -> list[int]:
    """The result dims of a legal target indexed by a loop; Illegal otherwise."""
    if op.name != "linalg.generic" or len(op.results) != 1:
        raise Illegal(op, "is not a linalg.generic with one result")
    ls = loop_structure(op)
    shape = list(op.results[0].type.shape)
    kept, dropped = [], []
    for d, e in enumerate(ls.output_map(0).results):
        if isinstance(e, ir.AffineDimExpr):
            kept.append(d)
        elif isinstance(e, ir.AffineConstantExpr) and e.value == 0 \
                and shape[d] == 1:
            dropped.append(d)
        else:
            raise Illegal(op, f"indexes its result by {e}")
    if not dropped or not kept:
        raise Illegal(op, "writes no unit dim by a constant index (or only such dims)")
    return kept


def _groups(rank: int, kept: list[int]) -> list[list[int]]:
    """Reassociation of the result onto its kept dims: each kept dim with the unit dims
    after it (the leading unit dims with the first)."""
    groups = []
    for i, d in enumerate(kept):
        end = kept[i + 1] if i + 1 < len(kept) else rank
        groups.append(list(range(0 if i == 0 else d, end)))
    return groups


def _rewrite(op: ir.Operation, kept: list[int], rewriter) -> ir.Operation:
    ls = loop_structure(op)
    result_type = op.results[0].type
    shape = list(result_type.shape)
    groups = _groups(len(shape), kept)
    out_map = ls.output_map(0)
    new_out_map = ir.AffineMap.get(out_map.n_dims, 0, [out_map.results[d] for d in kept])
    with ir.InsertionPoint(op), op.location:
        small = ir.RankedTensorType.get([shape[d] for d in kept], result_type.element_type)
        init = tensor.CollapseShapeOp(small, op.operands[ls.num_inputs],
                                      reassociation_attr(groups)).result
        block = op.regions[0].blocks[0]

        def body(args):
            return clone_body(op, dict(zip(block.arguments, args)))

        new = build_generic(list(op.operands)[:ls.num_inputs], [init],
                            ls.maps[:ls.num_inputs] + [new_out_map], ls.iterators, body,
                            name_from=op)
        back = tensor.ExpandShapeOp(result_type, new.results[0], reassociation_attr(groups), [],
                                    i64_array(shape)).result
    rewriter.replace_op(op, [back])
    return new.operation


class DropUnitResultDimsOp(TransformExt.Operation, name="drop_unit_result_dims"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    kept = [kept_result_dims(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.result, [_rewrite(t, k, rewriter) for t, k in zip(targets, kept)])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def drop_unit_result_dims(target: ir.Value) -> ir.Value:
    """Write the unit result dims of the generics in `target` by an expand_shape after them;
    returns the rewritten generics."""
    return DropUnitResultDimsOp(target).result
