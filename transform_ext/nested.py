"""Nested interpreter runs: a policy op applies upstream transforms to one payload op.

A policy op (e.g. fuse_roots_into_foralls) decides at apply time what to do with each
payload op it finds, then applies a small transform sequence to that op itself:
`apply_to(payload_op, body)` builds `@__transform_main(%op)` with `body(%op)` and runs the
interpreter with `payload_op` as the payload root. The sequence may replace the op
(structured.fuse, tile_using_for): the caller holds no handle to it then.
"""

from __future__ import annotations

from typing import Callable

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import interpreter


def any_op() -> ir.Type:
    return transform.AnyOpType.get()


def main_sequence(body: Callable[[ir.Value], None]) -> tuple[ir.Module, object]:
    """A module holding `@__transform_main(%root: !transform.any_op {transform.consumed})`
    whose body `body(%root)` emits (needs an active context and location)."""
    module = ir.Module.create()
    module.operation.attributes["transform.with_named_sequence"] = ir.UnitAttr.get()
    with ir.InsertionPoint(module.body):
        seq = transform.NamedSequenceOp(
            "__transform_main", [any_op()], [],
            arg_attrs=[{"transform.consumed": ir.UnitAttr.get()}])
    with ir.InsertionPoint(seq.body):
        body(seq.bodyTarget)
        transform.YieldOp()
    return module, seq


def apply_to(payload_op: ir.Operation, body: Callable[[ir.Value], None]) -> None:
    """Apply the sequence `body(handle)` to `payload_op` (its handle is consumed)."""
    with payload_op.context, ir.Location.unknown():
        module, seq = main_sequence(body)
        interpreter.apply_named_sequence(payload_op, seq, module)


def canonicalize(target: ir.Value) -> None:
    """Canonicalization patterns and CSE on `target` (inside a sequence being built)."""
    op = transform.ApplyPatternsOp(target, apply_cse=True)
    with ir.InsertionPoint(op.patterns):
        transform.ApplyCanonicalizationPatternsOp()
