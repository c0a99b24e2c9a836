"""Shared pieces of transform_ext ops: failures, payload access, body surgery.

Conventions every op follows (see ../DESIGN.md):
- `apply` checks legality on every payload op first; if any is illegal it reports a
  silenceable failure whose message names the payload op and the reason, and rewrites
  nothing. Only then does it rewrite, through the rewriter.
- Inside `apply` no context is active: wrap work in `with op.context:` and build with
  `ir.InsertionPoint(payload_op)` and `payload_op.location` (never read `rewriter.ip`).
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import transform

Success = transform.DiagnosedSilenceableFailure.Success
SilenceableFailure = transform.DiagnosedSilenceableFailure.SilenceableFailure


class Illegal(Exception):
    """Raised by legality checks: `payload` is the op at fault, the message the reason."""

    def __init__(self, payload, reason: str):
        super().__init__(reason)
        self.payload = payload
        self.reason = reason


def describe(op) -> str:
    """'linalg.generic at loc(...)' for messages."""
    op = getattr(op, "operation", op)
    return f"{op.name} at {op.location}"


def fail(transform_op_name: str, illegal: Illegal):
    """Emit the failure message at the payload op and return a silenceable failure."""
    payload = getattr(illegal.payload, "operation", illegal.payload)
    payload.location.emit_error(f"{transform_op_name}: {describe(payload)}: {illegal.reason}")
    return SilenceableFailure


def is_linalg(op) -> bool:
    op = getattr(op, "operation", op)
    return op.name.startswith("linalg.") and op.name not in ("linalg.yield", "linalg.index")


def walk_ops(root, predicate) -> list[ir.Operation]:
    """Ops under `root` (root included) satisfying `predicate`, in pre-order."""
    found = []

    def visit(op):
        if predicate(op):
            found.append(op)
        return ir.WalkResult.ADVANCE

    getattr(root, "operation", root).walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def defining_op(value: ir.Value) -> ir.Operation | None:
    owner = value.owner
    if isinstance(owner, ir.OpView):
        owner = owner.operation
    return owner if isinstance(owner, ir.Operation) else None


def erase_dead_body_ops(block: ir.Block) -> None:
    """Erase side-effect-free ops of `block` whose results are unused, to a fixed point."""
    changed = True
    while changed:
        changed = False
        ops = list(block.operations)
        for op in reversed(ops[:-1]):
            op = op.operation
            if op.name in ("cf.assert",) or op.regions:
                continue
            if len(op.results) and all(not list(r.uses) for r in op.results):
                op.erase()
                changed = True
