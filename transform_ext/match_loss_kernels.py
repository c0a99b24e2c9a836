"""match_loss_kernels: the top-level linalg ops of a cross-entropy loss by the kernel they run in.

    %host, %before, %rows, %after, %row_sums = transform_ext.match_loss_kernels %func

For the linalg ops directly in each target function's block (transform_ext/analysis/
loss_kernels.py): `host` the result-less target checks, `rows` the ops over the rows (a
result of rank >= 1: the row kernel), `before` the ops with rank-0 results the row kernel
reads (through such ops), `after` the other rank-0 ops; a linalg.fill read by one kernel
only belongs to it. `row_sums` are the reductions over the rows to rank 0 (linalg.generic
ops of before, then after, with a reduction loop). Each result lists its ops in block
order, functions in target order. A target that is not a func.func is a silenceable
failure naming it. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.loss_kernels import grouped, kernel_groups, row_sums
from .common import Illegal, MatchesPayload, Success, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.match_loss_kernels"


class MatchLossKernelsOp(TransformExt.Operation, name="match_loss_kernels"):
    target: ext.Operand[transform.AnyOpType]
    host: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    before: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    rows: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    after: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    row_sums: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for t in targets:
                        if t.name != "func.func":
                            raise Illegal(t, "not a func.func")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                found = {name: [] for name in ("host", "before", "rows", "after", "row_sums")}
                for t in targets:
                    block = t.regions[0].blocks[0]
                    groups = kernel_groups(block)
                    for name in ("host", "before", "rows", "after"):
                        found[name] += grouped(block, name, groups)
                    found["row_sums"] += row_sums(block, groups)
                for name, ops in found.items():
                    results.set_ops(getattr(op, name), ops)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_loss_kernels(func: ir.Value) -> MatchLossKernelsOp:
    """The op; its results `host`, `before`, `rows`, `after`, `row_sums` (module docstring)."""
    return MatchLossKernelsOp(func)


__all__ = ["MatchLossKernelsOp", "match_loss_kernels"]
