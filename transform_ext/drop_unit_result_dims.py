"""drop_unit_result_dims: a linalg.generic that writes unit dims of its results through
constant indices (a keepdim reduction: y[n, c, 0, 0] = sum_{h, w} x[n, c, h, w]) writes them
without those dims, each expanded back after:

    Y_i = expand_shape(G'(collapse_shape(I_1), ..)_i)

with G' the op whose output maps drop the constant results (the loops that indexed nothing
else stay reductions); a result without such dims is written as it was. Exact: the same
elements. The tiling and vectorization of linalg take the projected-permutation output maps
that are left (a merged variance's sums of x and x^2 then fuse into their readers' tiles).

Targets: linalg.generic ops on tensors with at least one output whose map holds constant 0
results (on unit dims) beside at least one dim, every output map made of dims and such
constants; otherwise a silenceable failure naming the op, nothing rewritten.
Result: the rewritten generics. The target handle is consumed.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, build_generic, clone_body, fail, i64_array,
                     payload_ops, reassociation_attr)
from .dialect import TransformExt

NAME = "transform_ext.drop_unit_result_dims"


def kept_result_dims(op: ir.Operation) -> list[list[int]]:
    """Per result of a legal target, its dims indexed by a loop; Illegal otherwise."""
    if op.name != "linalg.generic" or not len(op.results):
        raise Illegal(op, "is not a linalg.generic with results")
    ls = loop_structure(op)
    kept_of, dropping = [], False
    for i, result in enumerate(op.results):
        shape = list(result.type.shape)
        kept = []
        for d, e in enumerate(ls.output_map(i).results):
            if isinstance(e, ir.AffineDimExpr):
                kept.append(d)
            elif not (isinstance(e, ir.AffineConstantExpr) and e.value == 0 and shape[d] == 1):
                raise Illegal(op, f"indexes its result {i} by {e}")
        if not kept:
            raise Illegal(op, f"writes its result {i} by constant indices only")
        dropping |= len(kept) < len(shape)
        kept_of.append(kept)
    if not dropping:
        raise Illegal(op, "writes no unit dim by a constant index")
    return kept_of


def _groups(rank: int, kept: list[int]) -> list[list[int]]:
    """Reassociation of the result onto its kept dims: each kept dim with the unit dims
    after it (the leading unit dims with the first)."""
    groups = []
    for i, d in enumerate(kept):
        end = kept[i + 1] if i + 1 < len(kept) else rank
        groups.append(list(range(0 if i == 0 else d, end)))
    return groups


def _rewrite(op: ir.Operation, kept_of: list[list[int]], rewriter) -> ir.Operation:
    ls = loop_structure(op)
    inits, out_maps = [], []
    with ir.InsertionPoint(op), op.location:
        for i, kept in enumerate(kept_of):
            result_type, init = op.results[i].type, op.operands[ls.num_inputs + i]
            shape = list(result_type.shape)
            out_map = ls.output_map(i)
            if len(kept) < len(shape):
                small = ir.RankedTensorType.get([shape[d] for d in kept], result_type.element_type)
                init = tensor.CollapseShapeOp(small, init, reassociation_attr(_groups(len(shape), kept))).result
                out_map = ir.AffineMap.get(out_map.n_dims, 0, [out_map.results[d] for d in kept])
            inits.append(init)
            out_maps.append(out_map)
        block = op.regions[0].blocks[0]

        def body(args):
            return clone_body(op, dict(zip(block.arguments, args)))

        new = build_generic(list(op.operands)[:ls.num_inputs], inits,
                            ls.maps[:ls.num_inputs] + out_maps, ls.iterators, body, name_from=op)
        results = []
        for i, kept in enumerate(kept_of):
            result_type = op.results[i].type
            shape = list(result_type.shape)
            results.append(new.results[i] if len(kept) == len(shape) else tensor.ExpandShapeOp(
                result_type, new.results[i], reassociation_attr(_groups(len(shape), kept)), [],
                i64_array(shape)).result)
    rewriter.replace_op(op, results)
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
