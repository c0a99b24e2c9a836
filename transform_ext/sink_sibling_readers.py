"""sink_sibling_readers: the ops before a root that do not feed it but read what it reads are
moved after it, in their order.

With F the ops of the root's block the root reads, transitively (its operands and those of
the ops in its body), the ops before the root are scanned in order: an op not in F moves
when it reads an op that moves, or when it has results and reads an op of F (a sibling
reader: the per-row loss next to the gradient, both reading m and l). Result-less ops (the
target bounds checks) stay unless they read a moved op. Every value keeps its definition
before its uses (a moved op reads ops before the root that stay, F and moved ops earlier in
the order; nothing left before the root reads a moved op), so the program computes the
same values. Why: tiling the root into a forall that fuses F then hands F's results
(m, l) to the siblings after it, instead of leaving copies of F outside.

Target: one op in a block; else a silenceable failure. Only the op order changes; the
handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import (Illegal, RewritesTargets, Success, block_ops, body_of, defining_op, fail,
                     payload_ops)
from .dialect import TransformExt

NAME = "transform_ext.sink_sibling_readers"


def sibling_readers(root: ir.Operation) -> list[ir.Operation]:
    """The ops to move after `root`, in block order (see the module docstring)."""
    ops = block_ops(root.block)
    position = {op: i for i, op in enumerate(ops)}
    feeds = set()
    pending = [root]
    while pending:
        op = pending.pop()
        for inner in [op] + ([o.operation for o in body_of(op).operations] if op.regions else []):
            for v in inner.operands:
                p = defining_op(v)
                if p is not None and p in position and p not in feeds:
                    feeds.add(p)
                    pending.append(p)
    moving = []
    for op in ops[:position[root]]:
        if op in feeds:
            continue
        producers = [p for p in map(defining_op, op.operands) if p is not None]
        if any(p in moving for p in producers) or (
                len(op.results) and any(p in feeds for p in producers)):
            moving.append(op)
    return moving


class SinkSiblingReadersOp(TransformExt.Operation, name="sink_sibling_readers"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    if len(targets) != 1:
                        raise Illegal(targets[0] if targets else op.operation,
                                      f"the target must be one op, got {len(targets)}")
                    if targets[0].block is None:
                        raise Illegal(targets[0], "it is not in a block")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                after = targets[0]
                for moved in sibling_readers(targets[0]):
                    moved.move_after(after)
                    after = moved
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def sink_sibling_readers(target: ir.Value) -> SinkSiblingReadersOp:
    """Move the sibling readers of `target` after it (see the module docstring)."""
    return SinkSiblingReadersOp(target)


__all__ = ["SinkSiblingReadersOp", "sink_sibling_readers", "sibling_readers"]
