"""collapse_contraction_parallel_dims: the parallel loops of a contraction that its operands
read as one contiguous group become one loop, its operands and result collapsed along it.

Reshape propagation (linalg's fold-by-expansion, transform_ext.fold_reshape_ops_by_expansion)
turns a linear layer over [B, S, D], imported as x.view(B S, D) @ W^T, into a contraction
over the loops (b, s, n, k): two m loops, which no matmul schedule takes. This undoes it. For
a contraction (a linalg.generic linalg recognizes as one) and a group of its parallel loops
p_1 .. p_n (n >= 2) that every operand reading any of them reads as consecutive results in
that order, the output among them:

    Y[.., p_1, .., p_n, ..] = sum_k f(X_i[.., p_1, .., p_n, ..], ..)
    Y = expand(Y'),  Y'[.., p, ..] = sum_k f(X'_i[.., p, ..], ..)

with p = (..(p_1 P_2 + p_2) P_3 + ..) + p_n and X'_i, the init of Y' the operands collapsed
along the group (tensor.collapse_shape: static, contiguous tensors; a single-use transpose
of an input collapsed before it, as collapse_reduction_dims does). Exact: each element is
the same sum of the same terms in the same order. Groups are found loop by loop, outermost
first: the m loops (read by the output and one input), the n loops, the batch loops (read
by all three) each form their own.

Targets: every contraction linalg.generic nested in (or equal to) the target ops; ops with a
linalg.index in the body, non-dim map results, dynamic shapes or no such group are left
alone. Never fails; the result handle holds the targets.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .analysis.structure import dim_positions, loop_structure
from .collapse_reduction_dims import collapsed_generic, group_reassociation
from .common import ReplacesTargets, Success, payload_ops, reassociation_attr, walk_ops
from .dialect import TransformExt


def parallel_group(op: ir.Operation) -> list[int] | None:
    """The first group p_1 .. p_n (module docstring) of contraction `op`, or None."""
    ls = loop_structure(op)
    if not ls.is_contraction or not ls.is_static or len(op.results) != 1:
        return None
    if any(inner.operation.name == "linalg.index" for inner in op.regions[0].blocks[0].operations):
        return None
    positions = [dim_positions(m) for m in ls.maps]
    if any(p is None for ps in positions for p in ps):
        return None
    output = positions[ls.num_inputs]
    readers = {d: frozenset(i for i, ps in enumerate(positions) if d in ps) for d in output}
    start = 0
    while start < len(output):
        end = start + 1
        while end < len(output) and readers[output[end]] == readers[output[start]]:
            end += 1
        group = output[start:end]
        if len(group) >= 2 and all(_reads_in_order(positions[i], group)
                                   for i in readers[group[0]]):
            return group
        start = end
    return None


def _reads_in_order(positions: list[int], group: list[int]) -> bool:
    first = positions.index(group[0])
    return positions[first: first + len(group)] == group


def _rewrite(op: ir.Operation, group: list[int], rewriter) -> ir.Operation:
    """The op with the group collapsed into its first loop, its result expanded back."""
    new, transposes = collapsed_generic(op, group)
    ls = loop_structure(op)
    first = dim_positions(ls.output_map(0)).index(group[0])
    result_t = op.results[0].type
    shape = list(result_t.shape)
    with ir.InsertionPoint(op), op.location:
        expanded = tensor.ExpandShapeOp(
            result_t, new.results[0], reassociation_attr(group_reassociation(len(shape), first, len(group))),
            [], ir.DenseI64ArrayAttr.get(shape)).result
    rewriter.replace_op(op, [expanded])
    for transpose in transposes:  # read by `op` alone
        rewriter.erase_op(transpose)
    return new


class CollapseContractionParallelDimsOp(TransformExt.Operation,
                                        name="collapse_contraction_parallel_dims"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                out = []
                for target in payload_ops(state, op.target):
                    replaced = target
                    for generic in walk_ops(target, lambda o: o.name == "linalg.generic"):
                        current = generic
                        while (group := parallel_group(current)) is not None:
                            current = _rewrite(current, group, rewriter)
                        if generic == target:
                            replaced = current
                    out.append(replaced)
                results.set_ops(op.result, out)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def collapse_contraction_parallel_dims(target: ir.Value) -> ir.Value:
    """Collapse the contiguous parallel groups of the contractions in `target`; returns the
    targets."""
    return CollapseContractionParallelDimsOp(target).result


__all__ = ["CollapseContractionParallelDimsOp", "collapse_contraction_parallel_dims",
           "parallel_group"]
