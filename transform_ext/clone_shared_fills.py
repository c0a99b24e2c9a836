"""clone_shared_fills: each reader of a top-level linalg.fill gets a fill of its own.

    transform_ext.clone_shared_fills %func

In each target function, a linalg.fill of the function's body read by more than one operand
(CSE merges the zero inits of contractions of one shape: the scores and the output of an
attention with S = E) is cloned once per further use, each clone inserted right after the
fill and read by that use alone. A fill computes the same value wherever it is: the rewrite
is exact. Tiling then fuses each reader's init into that reader's tiles on its own: with one
fill shared by a root and a producer fused into the root's scf.forall, fuse_into_containing_op
hands the tiled fill to one of them and leaves the other reading the forall's uninitialized
shared output. Run it after the last CSE before such tiling. Targets: func.func ops (else a
silenceable failure naming the op); the handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import RewritesTargets, block_ops, rewrite_functions, user_op
from .dialect import TransformExt

NAME = "transform_ext.clone_shared_fills"


def clone_fills(block: ir.Block) -> None:
    for fill in [op for op in block_ops(block) if op.name == "linalg.fill"]:
        for use in list(fill.results[0].uses)[1:]:
            with ir.InsertionPoint.after(fill), fill.location:
                clone = fill.clone()
            user_op(use).operands[use.operand_number] = clone.results[0]


class CloneSharedFillsOp(TransformExt.Operation, name="clone_shared_fills"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            return rewrite_functions(NAME, op, rewriter, state,
                                     lambda func, _: clone_fills(func.regions[0].blocks[0]))

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def clone_shared_fills(func: ir.Value) -> CloneSharedFillsOp:
    """Give each reader of a shared fill of `func` its own fill (module docstring)."""
    return CloneSharedFillsOp(func)


__all__ = ["CloneSharedFillsOp", "clone_shared_fills", "clone_fills"]
