"""The kernels of a cross-entropy loss on a GPU: where each top-level linalg op of a function
runs (schedules/cross_entropy/xegpu.py).

Of the linalg ops directly in a function's block:
  host    result-less ops (the target checks, asserting in their bodies): stay on the host;
  rows    ops with a result that is not a rank-0 tensor (over the rows): the row kernel;
  before  ops whose results are all rank-0 and that the row kernel reads (through such ops):
          a one-workgroup kernel before it;
  after   the other rank-0 ops: a one-workgroup kernel after it.
A linalg.fill goes by that rule while it is shared (`fills_by_readers=False`, as
split_shared_fills sees it); once every fill is read by one kernel only, it belongs to the
kernel of its readers (a fill nothing in a kernel reads goes by the rule).
"""

from __future__ import annotations

from torch_mlir import ir

from ..common import block_ops, defining_op, iterator_kinds, result_users
from .structure import is_linalg_op

KERNELS = ("host", "before", "rows", "after")


def _rank(value: ir.Value) -> int:
    return value.type.rank if isinstance(value.type, ir.ShapedType) else -1


def needed_by(readers: list, candidates: list) -> list:
    """The ops of `candidates` whose results `readers` read through their operands, directly
    or through other candidates; in `candidates`' order."""
    needed = []
    pending = list(readers)
    while pending:
        op = pending.pop()
        for v in op.operands:
            p = defining_op(v)
            if p is not None and p in candidates and p not in needed:
                needed.append(p)
                pending.append(p)
    return [op for op in candidates if op in needed]


def kernel_groups(block: ir.Block, fills_by_readers: bool = True) -> dict:
    """{op: kernel name} for the linalg ops of `block` (module docstring)."""
    ops = [op for op in block_ops(block) if is_linalg_op(op)]
    group, scalar = {}, []
    for op in ops:
        if not len(op.results):
            group[op] = "host"
        elif all(_rank(r) == 0 for r in op.results):
            scalar.append(op)
        else:
            group[op] = "rows"
    needed = needed_by([op for op in ops if group.get(op) == "rows"], scalar)
    for op in scalar:
        group[op] = "before" if op in needed else "after"
    if fills_by_readers:
        for op in ops:
            if op.name == "linalg.fill":
                kernels = {group[u] for u in result_users(op) if u in group}
                if len(kernels) == 1:
                    group[op] = kernels.pop()
    return group


def grouped(block: ir.Block, kernel: str, groups: dict | None = None) -> list[ir.Operation]:
    """The ops of `kernel` in block order."""
    groups = kernel_groups(block) if groups is None else groups
    return [op for op in block_ops(block) if groups.get(op) == kernel]


def is_row_sum(op: ir.Operation) -> bool:
    """A reduction over the rows to rank 0: a linalg.generic of the before or after kernel
    with a reduction loop."""
    return op.name == "linalg.generic" and "reduction" in iterator_kinds(op)


def row_sums(block: ir.Block, groups: dict | None = None) -> list[ir.Operation]:
    """The reductions over the rows of the before kernel, then those of the after kernel
    (block order within each)."""
    groups = kernel_groups(block) if groups is None else groups
    return [op for kernel in ("before", "after") for op in grouped(block, kernel, groups)
            if is_row_sum(op)]
