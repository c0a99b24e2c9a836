"""Scalar bodies of linalg ops: which ops and block arguments a body value depends on."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch_mlir import ir

from ..common import defining_op


def producer_in(block: ir.Block, value: ir.Value) -> ir.Operation | None:
    """The op of `block` (directly in it) defining `value`, else None."""
    if isinstance(value, ir.BlockArgument):
        return None
    owner = defining_op(value)
    if owner is None or owner.parent is None:
        return None
    parent_block = owner.block
    return owner if parent_block == block else None


def block_arg_number(block: ir.Block, value: ir.Value) -> int | None:
    if isinstance(value, ir.BlockArgument) and value.owner == block:
        return value.arg_number
    return None


def strip_casts(block: ir.Block, value: ir.Value, names=("arith.extf",)) -> ir.Value:
    """Follow single-operand cast ops of `block` named in `names` back to their operand."""
    while True:
        op = producer_in(block, value)
        if op is None or op.name not in names:
            return value
        value = op.operands[0]


@dataclass
class Slice:
    """The part of a body that computes some values: its ops (in block order), the block
    arguments it reads (by number), and whether it reads `linalg.index`."""

    ops: list = field(default_factory=list)
    args: set = field(default_factory=set)
    reads_index: bool = False


def body_slice(block: ir.Block, values) -> Slice:
    """Backward slice of `values` inside `block` (values of nested regions included)."""
    seen_ops: list[ir.Operation] = []
    result = Slice()
    frontier = list(values)
    while frontier:
        v = frontier.pop()
        n = block_arg_number(block, v)
        if n is not None:
            result.args.add(n)
            continue
        op = producer_in(block, v)
        if op is None or op in seen_ops:
            continue
        seen_ops.append(op)
        frontier.extend(op.operands)

        def visit(inner):
            if inner.name == "linalg.index":
                result.reads_index = True
            frontier.extend(inner.operands)
            return ir.WalkResult.ADVANCE

        op.walk(visit)
    order = {op: i for i, op in enumerate(o.operation for o in block.operations)}
    result.ops = sorted(seen_ops, key=lambda o: order[o])
    return result
