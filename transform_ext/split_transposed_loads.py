"""split_transposed_loads: a 2-D block load read both transposed (through vector.transpose)
and as it is gets a twin for its transposed readers.

    %t = xegpu.load_nd %desc[%i, %j] : vector<R x C x T>
    %a = vector.transpose %t, [1, 0]          (a DPAS operand read transposed)
    ... %t ...                                (a DPAS operand read as stored)
  =>
    %t = xegpu.load_nd %desc[%i, %j]
    %t2 = xegpu.load_nd %desc[%i, %j]
    %a = vector.transpose %t2, [1, 0]
    ... %t ...

The same tile, read twice (the attention backward reads K, Q and dO tiles both ways: Q K^T
and dS K, or Q^T and Q), so that each load can carry its own layout: a transposed 2-D block
read for the one, a plain (VNNI) read for the other; conversion across lanes in registers
has no XeGPU lowering. Exact: both loads read the same memory, which nothing writes in
between (the twin is placed right after the load).

Legal for a load when it is an xegpu.load_nd with a 2-D result read by at least one
vector.transpose and one other op. Rewritten: every xegpu.load_nd nested in (or equal to)
the targets that is legal; the others are left alone. The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import RewritesTargets, Success, ops_named, payload_ops, user_op
from .dialect import TransformExt

NAME = "transform_ext.split_transposed_loads"


def transposed_and_plain_uses(load: ir.Operation) -> tuple[list, list]:
    """(the uses of `load`'s result by vector.transpose, the other uses)."""
    transposed, plain = [], []
    for use in load.results[0].uses:
        (transposed if user_op(use).name == "vector.transpose" else plain).append(use)
    return transposed, plain


def split(load: ir.Operation) -> bool:
    """Give the transposed readers of `load` a twin load; False when it is not legal."""
    if load.name != "xegpu.load_nd" or ir.VectorType(load.results[0].type).rank != 2:
        return False
    transposed, plain = transposed_and_plain_uses(load)
    if not transposed or not plain:
        return False
    twin = load.clone(ip=ir.InsertionPoint.after(load))
    for use in transposed:
        user_op(use).operands[use.operand_number] = twin.results[0]
    return True


class SplitTransposedLoadsOp(TransformExt.Operation, name="split_transposed_loads"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for target in payload_ops(state, op.target):
                    for load in ops_named(target, "xegpu.load_nd"):
                        split(load)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def split_transposed_loads(target: ir.Value) -> SplitTransposedLoadsOp:
    """Give the transposed readers of the loads in `target` loads of their own."""
    return SplitTransposedLoadsOp(target)


__all__ = ["SplitTransposedLoadsOp", "split", "split_transposed_loads",
           "transposed_and_plain_uses"]
