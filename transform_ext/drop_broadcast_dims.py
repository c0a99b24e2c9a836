"""drop_broadcast_dims: stop materializing copies along dims a value does not depend on.

A parallel loop dim l of a single-result linalg.generic P that no input map reads and no
`linalg.index l` observes only repeats the same values along l: P(..., i_l, ...) is the same
for every i_l. P is rebuilt without l (its result loses that dim) and every user reads the
smaller tensor through its map with that result position removed, which reads the same value
for every i_l as before. A rebuilt P that only copies its single input (identity maps, the
body yields the input) disappears: users read the input itself.

Grouped-query attention imports K and V repeated per query head of a group (a broadcast
generic, then K's transpose and scale); after this op the contractions read one copy per
key/value head.

Preconditions: P has a tensor result and no reduction dims; every user is a linalg op reading
P's result as an input through a map of plain loop dims or constants. Ops that do not
qualify are left alone (never a failure). The result handle holds the targets that remain.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .analysis.structure import dim_positions, loop_structure
from .common import (ReplacesTargets, Success, build_generic, clone_body, payload_ops, user_op,
                     users, walk_ops)
from .dialect import TransformExt


def broadcast_dims(op: ir.Operation) -> list[int]:
    """Parallel loop dims of `op` that no input map reads and no linalg.index observes."""
    if op.name != "linalg.generic" or len(op.results) != 1:
        return []
    ls = loop_structure(op)
    if ls.reduction_dims or not ls.is_static:
        return []
    read = set()
    for amap in ls.maps[: ls.num_inputs]:
        for expr in amap.results:
            for d in range(ls.num_loops):
                if _uses(expr, d):
                    read.add(d)
    for inner in op.regions[0].blocks[0].operations:
        if inner.operation.name == "linalg.index":
            read.add(ir.IntegerAttr(inner.operation.attributes["dim"]).value)
    out = dim_positions(ls.output_map(0))
    candidates = [d for d in range(ls.num_loops) if d not in read and d in out]
    if not list(op.results[0].uses):
        return []
    for use in op.results[0].uses:
        user = user_op(use)
        if not user.name.startswith("linalg.") or use.operand_number >= len(user.operands) - len(user.results):
            return []
        umap = loop_structure(user).maps[use.operand_number]
        if any(not isinstance(e, (ir.AffineDimExpr, ir.AffineConstantExpr)) for e in umap.results):
            return []
    return candidates


def _uses(expr, d: int) -> bool:
    if isinstance(expr, ir.AffineDimExpr):
        return expr.position == d
    return any(_uses(getattr(expr, side), d) for side in ("lhs", "rhs") if hasattr(expr, side))


def _drop(op: ir.Operation, dims: list[int], rewriter) -> ir.Operation | None:
    ls = loop_structure(op)
    keep = [d for d in range(ls.num_loops) if d not in dims]
    renumber = {d: i for i, d in enumerate(keep)}
    out_dims = dim_positions(ls.output_map(0))
    dropped_positions = [p for p, d in enumerate(out_dims) if d in dims]

    def shrink(amap):
        exprs = []
        for e in amap.results:
            if isinstance(e, ir.AffineDimExpr):
                exprs.append(ir.AffineDimExpr.get(renumber[e.position]))
            else:
                exprs.append(e)
        return ir.AffineMap.get(len(keep), 0, exprs)

    n_in = ls.num_inputs
    result_t = op.results[0].type
    shape = [s for p, s in enumerate(result_t.shape) if p not in dropped_positions]
    new_t = ir.RankedTensorType.get(shape, result_t.element_type)
    inputs = list(op.operands)[:n_in]
    in_maps = [shrink(m) for m in ls.maps[:n_in]]
    out_map = ir.AffineMap.get(len(keep), 0, [ir.AffineDimExpr.get(renumber[d]) for d in out_dims
                                              if d not in dims])
    kinds = [ls.iterators[d] for d in keep]
    with ir.InsertionPoint(op), op.location:
        empty = tensor.EmptyOp(shape, result_t.element_type).result
        block = op.regions[0].blocks[0]

        def body(args):
            mapping = {block.arguments[i]: args[i] for i in range(len(args))}
            return clone_body(op, mapping)

        new = build_generic(inputs, [empty], in_maps + [out_map], kinds, body, name_from=op)
    copy = _is_plain_copy(new.operation) and inputs[0].type == new_t
    replacement = inputs[0] if copy else new.results[0]
    for use in list(op.results[0].uses):
        user = user_op(use)
        _retarget(user, use.operand_number, dropped_positions, replacement)
    rewriter.erase_op(op)
    if copy:
        rewriter.erase_op(new.operation)
        return None
    return new.operation


def _is_plain_copy(op: ir.Operation) -> bool:
    ls = loop_structure(op)
    if ls.num_inputs != 1 or ls.maps[0] != ls.maps[1] or not ls.maps[0].is_permutation:
        return False
    if not all(isinstance(e, ir.AffineDimExpr) and e.position == i for i, e in enumerate(ls.maps[0].results)):
        return False
    block = op.regions[0].blocks[0]
    yielded = block.operations[len(block.operations) - 1].operands[0]
    return yielded == block.arguments[0]


def _retarget(user: ir.Operation, operand: int, dropped_positions: list[int], value: ir.Value) -> None:
    """`user` reads `value` (the input without the dropped dims) at operand `operand`."""
    maps = [m.value if isinstance(m, ir.AffineMapAttr) else m for m in user.opview.indexing_maps]
    old = maps[operand]
    exprs = [e for p, e in enumerate(old.results) if p not in dropped_positions]
    maps[operand] = ir.AffineMap.get(old.n_dims, old.n_symbols, exprs)
    user.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])
    user.operands[operand] = value


class DropBroadcastDimsOp(TransformExt.Operation, name="drop_broadcast_dims"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                kept = list(targets)
                while True:
                    found = None
                    for target in kept:
                        for g in walk_ops(target, lambda o: o.name == "linalg.generic"):
                            readers = users(g.results[0]) if len(g.results) else []
                            if readers and all(u.name == "linalg.generic" for u in readers):
                                dims = broadcast_dims(g)
                                if dims:
                                    found = (target, g, dims)
                                    break
                        if found:
                            break
                    if found is None:
                        break
                    target, g, dims = found
                    new = _drop(g, dims, rewriter)
                    if g == target:
                        kept = [t for t in kept if t != target] + ([new] if new is not None else [])
                results.set_ops(op.result, kept)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def drop_broadcast_dims(target: ir.Value) -> ir.Value:
    """Rebuild the generics in `target` without the dims their values do not depend on."""
    return DropBroadcastDimsOp(target).result
