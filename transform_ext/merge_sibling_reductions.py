"""merge_sibling_reductions: reductions of the same loops that read the same tensor become
one multi-result linalg.generic, which reads it once.

R_1..R_n, linalg.generics on tensors in one block with a reduction loop, equal static loop
ranges and iterator types, each sharing an input (a value read through the same map, whose
elements its body uses) with another, become the merge_elementwise form
    G(inputs of all, each (value, map) once) -> (results of R_1, .., results of R_n)
with each R_i's output maps and body (its bodies one after the other): every result is
combined from the same values in the same order, so the rewrite is exact. The sums
s1 = sum x and s2 = sum x^2 of a one-pass variance (lighthouse.ingress's var_mean) then
take one sweep over x instead of two. G sits at the last R_i's place.

Groups are formed in block order: a reduction joins the first group it shares an input
with when nothing from the group's first member up to it reads a member's result (it
itself included), so every value G reads is defined before it and every reader of a
result comes after it. A reduction that joins no group starts one; groups of one stay.
Targets: func.func ops (the handle is consumed and returned, common.RewritesNestedOps);
any other target op is a silenceable failure, nothing rewritten.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import loop_structure
from .common import (Illegal, RewritesNestedOps, Success, fail, iterator_kinds, payload_ops)
from .dialect import TransformExt
from .merge_elementwise import merge

NAME = "transform_ext.merge_sibling_reductions"


def _is_reduction(op: ir.Operation) -> bool:
    return (op.name == "linalg.generic" and len(op.results) > 0
            and "reduction" in iterator_kinds(op) and loop_structure(op).is_static
            and all(isinstance(r.type, ir.RankedTensorType) for r in op.results))


def _reads(op: ir.Operation) -> set[tuple]:
    """The (value, map) pairs whose elements the body uses (an input that only bounds the
    loops, as the x of a count sum_c (-1), is read by nothing: read_reduction_constants
    handles such a reduction alone)."""
    view = op.opview
    args = op.regions[0].blocks[0].arguments
    return {(v, str(m.value)) for i, (v, m) in enumerate(zip(view.inputs, list(view.indexing_maps)))
            if any(True for _ in args[i].uses)}


def _ancestor_in(op, block: ir.Block) -> ir.Operation | None:
    """`op` or the op holding it that lies in `block` (None: none does)."""
    op = getattr(op, "operation", op)
    while op.block != block:
        parent = op.parent
        if parent is None:
            return None
        op = getattr(parent, "operation", parent)
    return op


def _joins(group: list[ir.Operation], op: ir.Operation) -> bool:
    """May `op` (after every member in its block) be computed together with `group`?"""
    first = group[0]
    if (loop_structure(op).ranges != loop_structure(first).ranges
            or iterator_kinds(op) != iterator_kinds(first)
            or not any(_reads(op) & _reads(member) for member in group)):
        return False
    for member in group:
        for result in member.results:
            for use in result.uses:
                user = _ancestor_in(use.owner, op.block)
                if user is None or user == op or not op.is_before_in_block(user):
                    return False
    return True


def sibling_groups(func: ir.Operation) -> list[list[ir.Operation]]:
    """The groups of two or more reductions to merge, per block in block order."""
    by_block: dict = {}

    def visit(op):
        op = op.operation
        if _is_reduction(op):
            by_block.setdefault(op.block, []).append(op)
        return ir.WalkResult.ADVANCE

    func.walk(visit)
    groups = []
    for ops in by_block.values():
        block_groups: list[list[ir.Operation]] = []
        for op in ops:
            group = next((g for g in block_groups if _joins(g, op)), None)
            if group is None:
                block_groups.append([op])
            else:
                group.append(op)
        groups.extend(g for g in block_groups if len(g) > 1)
    return groups


class MergeSiblingReductionsOp(TransformExt.Operation, name="merge_sibling_reductions"):
    target: ext.Operand[transform.AnyOpType]
    transformed: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a func.func")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for func in targets:
                    for group in sibling_groups(func):
                        merge(group)
                results.set_ops(op.transformed, targets)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesNestedOps


def merge_sibling_reductions(func: ir.Value) -> ir.Value:
    """Merge the sibling reductions in the functions of `func` (see the module docstring)."""
    return MergeSiblingReductionsOp(func).transformed


__all__ = ["MergeSiblingReductionsOp", "merge_sibling_reductions", "sibling_groups"]
