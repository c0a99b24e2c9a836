"""split_shared_fills: a linalg.fill read by ops of several loss kernels is cloned per kernel.

    transform_ext.split_shared_fills %func

With the kernels of a cross-entropy loss (transform_ext/analysis/loss_kernels.py, fills by
the rank rule), every use of a top-level linalg.fill F by an op of another kernel than F's
own reads a clone of F made for that use (inserted right after F, so the last use's clone
comes first). A fill computes the same value wherever it is: the rewrite is exact, and each
kernel then computes its own initial values (a shared zero init of the count and of the loss
sum) instead of reading another kernel's. Fills read by their own kernel only, and every
other op, are left alone. Targets: func.func ops (else a silenceable failure naming the
op); the handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.loss_kernels import kernel_groups
from .common import RewritesTargets, block_ops, rewrite_functions, user_op
from .dialect import TransformExt

NAME = "transform_ext.split_shared_fills"


def split_fills(block: ir.Block) -> None:
    groups = kernel_groups(block, fills_by_readers=False)
    for fill in [op for op in block_ops(block) if op.name == "linalg.fill" and op in groups]:
        own = groups[fill]
        for use in list(fill.results[0].uses):
            user = user_op(use)
            kernel = groups.get(user)
            if kernel is None or kernel == own:
                continue
            with ir.InsertionPoint.after(fill), fill.location:
                clone = fill.clone()
            user.operands[use.operand_number] = clone.results[0]


class SplitSharedFillsOp(TransformExt.Operation, name="split_shared_fills"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return rewrite_functions(NAME, op, rewriter, state,
                                     lambda func, _: split_fills(func.regions[0].blocks[0]))

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def split_shared_fills(func: ir.Value) -> SplitSharedFillsOp:
    """Clone the fills of `func` read by other kernels than their own (module docstring)."""
    return SplitSharedFillsOp(func)


__all__ = ["SplitSharedFillsOp", "split_shared_fills", "split_fills"]
