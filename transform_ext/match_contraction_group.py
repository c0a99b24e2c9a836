"""match_contraction_group: the ops of a function's next contraction kernel, to tile together.

A contraction kernel (group) is built around a contraction C = A x B among the linalg ops
directly in a function's body:
  fill      the linalg.fill of C's init, when C is its one reader;
  prologue  for each of A and B, the chain of widening ops it is read from (a one-input,
            all-parallel linalg.generic whose body is one arith.extf, or a linalg.transpose),
            each read by its consumer only; closest to C first;
  epilogue  the chain of single readers of C's result that are elementwise (static, all
            parallel, one result of C's rank), not in a prologue and not in an earlier group;
            in execution order;
  side      the elementwise producers of the epilogue's other inputs that only the epilogue
            reads (a bias widened to f32).
Groups are formed in the order of their contractions (an earlier group's ops are taken); a
group's root is its last epilogue op, or C without epilogue.
Matched, for each target (a function): the group whose root comes first in the body - the
kernel to tile next when the kernels are tiled in root order: `root`; `epilogue`, the
epilogue ops before the root, latest first; `side`; `contraction` (C, the root itself
without epilogue); `fill` (no op or one); `prologue` (A's chain, then B's). A target without
a contraction is a silenceable failure naming it. Read-only.
"""

from dataclasses import dataclass, field

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import (Illegal, MatchesPayload, Success, block_ops, defining_op, fail, payload_ops,
                     users)
from .dialect import TransformExt

NAME = "transform_ext.match_contraction_group"


@dataclass
class ContractionOps:
    """The payload ops of one contraction kernel (see the module docstring)."""

    contraction: ir.Operation
    fill: ir.Operation | None
    prologue: list[ir.Operation] = field(default_factory=list)   # closest to C first
    epilogue: list[ir.Operation] = field(default_factory=list)   # in execution order
    side: list[ir.Operation] = field(default_factory=list)       # producers of epilogue inputs

    @property
    def root(self) -> ir.Operation:
        return self.epilogue[-1] if self.epilogue else self.contraction

    def ops(self) -> list[ir.Operation]:
        return ([self.contraction] + ([self.fill] if self.fill else []) + self.prologue
                + self.epilogue + self.side)


def linalg_producer(value: ir.Value) -> ir.Operation | None:
    """The linalg op defining `value`, or None."""
    op = defining_op(value)
    return op if op is not None and is_linalg_op(op) else None


def is_widening(op: ir.Operation) -> bool:
    """A one-input, all-parallel generic whose body is a single arith.extf, or a transpose."""
    if op.name == "linalg.transpose":
        return True
    if op.name != "linalg.generic" or len(op.results) != 1 or len(op.operands) != 2:
        return False
    ls = loop_structure(op)
    if ls.reduction_dims or not ls.is_elementwise:
        return False
    body = [o.operation.name for o in op.regions[0].blocks[0].operations]
    return body == ["arith.extf", "linalg.yield"]


def _is_elementwise(op: ir.Operation) -> bool:
    if op.name == "linalg.fill" or not is_linalg_op(op) or len(op.results) != 1:
        return False
    ls = loop_structure(op)
    return ls.is_static and not ls.reduction_dims and ls.is_elementwise


def contraction_groups(func: ir.Operation) -> list[ContractionOps]:
    """The contraction kernels of `func`'s top-level linalg ops, in contraction order."""
    ops = [o for o in block_ops(func) if is_linalg_op(o)]
    contractions = [o for o in ops if o.name != "linalg.fill" and loop_structure(o).is_contraction]
    groups = []
    taken: set = set()
    prologue_of: dict = {}
    for c in contractions:
        group = ContractionOps(c, None)
        init = c.operands[len(c.operands) - 1]
        fill = linalg_producer(init)
        if fill is not None and fill.name == "linalg.fill" and len(users(init)) == 1:
            group.fill = fill
        for operand in list(c.operands)[:len(c.operands) - 1]:
            p = linalg_producer(operand)
            while p is not None and is_widening(p) and len(users(p.results[0])) == 1:
                group.prologue.append(p)
                prologue_of[p] = c
                p = linalg_producer(p.operands[0])
        groups.append(group)
    for group in groups:
        value = group.contraction.results[0]
        out_rank = len(ir.ShapedType(value.type).shape)
        while True:
            readers = users(value)
            if len(readers) != 1:
                break
            u = readers[0]
            if not _is_elementwise(u) or u in prologue_of or u in taken:
                break
            if len(ir.ShapedType(u.results[0].type).shape) != out_rank:
                break
            group.epilogue.append(u)
            value = u.results[0]
        for e in group.epilogue:
            for operand in list(e.operands)[:len(e.operands) - 1]:
                p = linalg_producer(operand)
                if (p is not None and p not in group.epilogue and p is not group.contraction
                        and _is_elementwise(p) and len(users(p.results[0])) == 1):
                    group.side.append(p)
        taken.update(group.ops())
    return groups


def next_contraction_group(func: ir.Operation) -> ContractionOps:
    """The group of `func` whose root comes first in its body; Illegal without a group."""
    groups = contraction_groups(func)
    if not groups:
        raise Illegal(func, "no contraction among the linalg ops of its body")
    order = block_ops(func)
    return min(groups, key=lambda g: order.index(g.root))


class MatchContractionGroupOp(TransformExt.Operation, name="match_contraction_group"):
    target: ext.Operand[transform.AnyOpType]
    root: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    epilogue: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    side: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    contraction: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    fill: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    prologue: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                groups = []
                try:
                    for target in payload_ops(state, op.target):
                        groups.append(next_contraction_group(target))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.root, [g.root for g in groups])
                results.set_ops(op.epilogue, [o for g in groups for o in reversed(g.epilogue[:-1])])
                results.set_ops(op.side, [o for g in groups for o in g.side])
                results.set_ops(op.contraction, [g.contraction for g in groups])
                results.set_ops(op.fill, [g.fill for g in groups if g.fill is not None])
                results.set_ops(op.prologue, [o for g in groups for o in g.prologue])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_contraction_group(func: ir.Value) -> tuple[ir.Value, ...]:
    """Handles (root, epilogue, side, contraction, fill, prologue) to the next contraction
    kernel of each function of `func` (see the module docstring)."""
    op = MatchContractionGroupOp(func)
    return op.root, op.epilogue, op.side, op.contraction, op.fill, op.prologue


__all__ = ["ContractionOps", "MatchContractionGroupOp", "contraction_groups", "is_widening",
           "linalg_producer", "match_contraction_group", "next_contraction_group"]
