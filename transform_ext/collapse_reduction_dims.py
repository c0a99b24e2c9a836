"""collapse_reduction_dims: the reduction loops a contraction reads as one contiguous group
of every operand become one loop over the operands collapsed along that group.

upstream's linalg-fuse-elementwise-ops folds a tensor.collapse_shape into the op reading it
by expanding the op's loops: a linear layer after a flatten, x.flatten(1) @ W^T over
x [N, C, H, W], becomes a contraction with three reduction loops (c, h, w) reading x whole
and W^T expanded to [C, H, W, F], which no contraction schedule takes. This undoes it. For a
linalg.generic with reduction loops r_1 .. r_n (n >= 2) that every operand reading any of
them reads as consecutive results r_1, .., r_n in that order, the output reading none:

    Y[p] = sum_{r_1 .. r_n} f(X_i[.., r_1, .., r_n, ..]) = sum_r f(X'_i[.., r, ..])

with r = (..(r_1 R_2 + r_2) R_3 + ..) + r_n of extent R_1 .. R_n and X'_i = X_i collapsed
along the group (tensor.collapse_shape: static, contiguous tensors). Exact: the same terms in
the same order. An operand that is a single-use linalg.transpose T of X whose permutation
keeps the group consecutive and in order in X is collapsed before the transpose (T' of X
collapsed: a collapse of an expand_shape of the same group then folds away), so the
transposed weight of a linear layer stays a transpose the matmul packing folds.

Targets: every linalg.generic nested in (or equal to) the target ops whose group two inputs
read at least (a contraction); ops without such a group (or with a linalg.index in the body, or non-dim map results) are left alone. Never
fails; the result handle holds the targets.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .analysis.structure import dim_positions, loop_structure
from .common import (ReplacesTargets, Success, build_generic, clone_body, defining_op, payload_ops,
                     reassociation_attr, walk_ops)
from .dialect import TransformExt


def reduction_group(op: ir.Operation) -> list[int] | None:
    """The loops r_1 .. r_n (module docstring) of `op`, read by two inputs at least (a
    contraction, not a reduction of one tensor), None when it has no such group."""
    ls = loop_structure(op)
    reductions = list(ls.reduction_dims)
    if len(reductions) < 2 or len(op.results) != 1 or not ls.is_static:
        return None
    if any(inner.operation.name == "linalg.index" for inner in op.regions[0].blocks[0].operations):
        return None
    group, readers = None, 0
    for i, amap in enumerate(ls.maps):
        positions = dim_positions(amap)
        if any(p is None for p in positions):
            return None
        used = [p for p in positions if p in reductions]
        if i >= ls.num_inputs:
            if used:
                return None
            continue
        if not used:
            continue
        first = positions.index(used[0])
        if positions[first: first + len(reductions)] != used or len(used) != len(reductions):
            return None
        if group is None:
            group = used
        elif used != group:
            return None
        readers += 1
    return group if readers >= 2 else None


def group_reassociation(rank: int, first: int, n: int) -> list[list[int]]:
    return [[d] for d in range(first)] + [list(range(first, first + n))] + \
        [[d] for d in range(first + n, rank)]


def _collapsed_shape(shape: list[int], first: int, n: int) -> list[int]:
    size = 1
    for s in shape[first: first + n]:
        size *= s
    return shape[:first] + [size] + shape[first + n:]


def _collapse(value: ir.Value, first: int, n: int) -> ir.Value:
    """`value` collapsed along dims first .. first + n - 1."""
    t = value.type
    shape = _collapsed_shape(list(t.shape), first, n)
    out = ir.RankedTensorType.get(shape, t.element_type)
    return tensor.CollapseShapeOp(out, value,
                                  reassociation_attr(group_reassociation(len(t.shape), first, n))).result


def _transposed_group(value: ir.Value, first: int, n: int):
    """(transpose, its input's first dim of the group) when `value` is a single-use
    linalg.transpose whose permutation keeps dims first .. first + n - 1 consecutive and in
    order in its input, else None."""
    producer = defining_op(value)
    if producer is None or producer.name != "linalg.transpose" or len(list(value.uses)) != 1:
        return None
    perm = list(ir.DenseI64ArrayAttr(producer.attributes["permutation"]))
    sources = perm[first: first + n]
    if sources != list(range(sources[0], sources[0] + n)):
        return None
    return producer, sources[0]


def collapsed_operand(value: ir.Value, first: int, n: int, replaced: list) -> ir.Value:
    """`value` collapsed along the group, through a transpose when `_transposed_group` (the
    transpose appended to `replaced`)."""
    found = _transposed_group(value, first, n)
    if found is None:
        return _collapse(value, first, n)
    transpose, source_first = found
    replaced.append(transpose)
    perm = list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"]))
    x = _collapse(transpose.operands[0], source_first, n)
    # the transpose over the collapsed input: input dims after the group shift by n - 1
    def shifted(d):
        return d if d <= source_first else d - (n - 1)
    new_perm = [shifted(d) for d in perm[:first]] + [source_first] + \
        [shifted(d) for d in perm[first + n:]]
    shape = _collapsed_shape(list(value.type.shape), first, n)
    init = tensor.EmptyOp(shape, value.type.element_type).result
    return linalg.transpose(x, outs=[init], permutation=new_perm).results[0]


def collapsed_generic(op: ir.Operation, group: list[int]) -> tuple[ir.Operation, list[ir.Operation]]:
    """A linalg.generic computing `op` with the loops of `group` (consecutive in every
    operand reading them) collapsed into its first one, built before `op`: the operands
    collapsed along the group (an input through a single-use transpose, `collapsed_operand`),
    and the transposes now read by `op` alone, for the caller to erase."""
    ls = loop_structure(op)
    n = len(group)
    kept = [d for d in range(ls.num_loops) if d not in group[1:]]
    new_dim = {d: i for i, d in enumerate(kept)}
    operands, maps, transposes = [], [], []
    with ir.InsertionPoint(op), op.location:
        for i, amap in enumerate(ls.maps):
            positions = dim_positions(amap)
            value = op.operands[i]
            if group[0] in positions:
                first = positions.index(group[0])
                value = collapsed_operand(value, first, n, transposes if i < ls.num_inputs else [])
                positions = positions[:first + 1] + positions[first + n:]
            maps.append(ir.AffineMap.get(len(kept), 0,
                                         [ir.AffineDimExpr.get(new_dim[p]) for p in positions]))
            operands.append(value)
        block = op.regions[0].blocks[0]

        def body(args):
            return clone_body(op, dict(zip(block.arguments, args)))

        new = build_generic(operands[:ls.num_inputs], operands[ls.num_inputs:], maps,
                            [ls.iterators[d] for d in kept], body, name_from=op)
    return new.operation, transposes


def _rewrite(op: ir.Operation, group: list[int], rewriter) -> ir.Operation:
    """The op with the group collapsed into its first loop."""
    new, transposes = collapsed_generic(op, group)
    rewriter.replace_op(op, new)
    for transpose in transposes:  # read by `op` alone
        rewriter.erase_op(transpose)
    return new


class CollapseReductionDimsOp(TransformExt.Operation, name="collapse_reduction_dims"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                out = []
                for target in targets:
                    replaced = target
                    for generic in walk_ops(target, lambda o: o.name == "linalg.generic"):
                        group = reduction_group(generic)
                        if group is not None:
                            new = _rewrite(generic, group, rewriter)
                            if generic == target:
                                replaced = new
                    out.append(replaced)
                results.set_ops(op.result, out)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def collapse_reduction_dims(target: ir.Value) -> ir.Value:
    """Collapse the contiguous reduction groups of the linalg.generic ops in `target`;
    returns the targets."""
    return CollapseReductionDimsOp(target).result
