"""match_row_kernel: the root of a function's next row kernel and its producer chain.

Among the linalg ops directly in a function's body outside its contraction kernels
(match_contraction_group's groups), the linalg.fill ops that one of them reads set aside,
a row root is an op whose results none of the others reads. For each target (a function),
matched: `root`, the first row root in the body - the kernel to tile next when the row
kernels are tiled in root order - and `chain`, the linalg ops of the body that the root
depends on (transitively through linalg ops), latest first: the order in which
FuseIntoContainingOp fuses them into the root's workgroup forall. A target without a row
root is a silenceable failure naming it. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import is_linalg_op
from .common import (Illegal, MatchesPayload, Success, block_ops, defining_op, fail, payload_ops,
                     result_users)
from .dialect import TransformExt
from .match_contraction_group import contraction_groups

NAME = "transform_ext.match_row_kernel"


def find_row_roots(func: ir.Operation, exclude: list[ir.Operation]) -> list[ir.Operation]:
    """Top-level linalg ops outside `exclude` whose results no other such op reads, in block
    order (the linalg.fill ops that such an op reads set aside)."""
    ops = [o for o in block_ops(func) if is_linalg_op(o) and o not in exclude]
    ops = [o for o in ops if o.name != "linalg.fill" or not any(r in ops for r in result_users(o))]
    return [op for op in ops if not any(r in ops for r in result_users(op))]


def producer_chain(root: ir.Operation) -> list[ir.Operation]:
    """Linalg ops `root` depends on in its block, latest first (fusion order)."""
    order = block_ops(root.parent)
    seen, stack = [], [root]
    while stack:
        op = stack.pop()
        for v in op.operands:
            owner = defining_op(v)
            if owner is not None and is_linalg_op(owner) and owner not in seen:
                seen.append(owner)
                stack.append(owner)
    return sorted(seen, key=order.index, reverse=True)


def next_row_kernel(func: ir.Operation) -> tuple[ir.Operation, list[ir.Operation]]:
    """(the first row root of `func`, its producer chain); Illegal without a row root."""
    groups = [o for g in contraction_groups(func) for o in g.ops()]
    roots = find_row_roots(func, exclude=groups)
    if not roots:
        raise Illegal(func, "no linalg op outside the contraction kernels that no other reads")
    return roots[0], producer_chain(roots[0])


class MatchRowKernelOp(TransformExt.Operation, name="match_row_kernel"):
    target: ext.Operand[transform.AnyOpType]
    root: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    chain: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                kernels = []
                try:
                    for target in payload_ops(state, op.target):
                        kernels.append(next_row_kernel(target))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.root, [root for root, _ in kernels])
                results.set_ops(op.chain, [o for _, chain in kernels for o in chain])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_row_kernel(func: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(the next row root, its producer chain latest first) of each function of `func` (see
    the module docstring)."""
    op = MatchRowKernelOp(func)
    return op.root, op.chain


__all__ = ["MatchRowKernelOp", "find_row_roots", "match_row_kernel", "next_row_kernel",
           "producer_chain"]
