"""Building and applying transform schedules: thin helpers over the upstream builders.

A schedule is a `transform.named_sequence @__transform_main(%root)` in its own module. Build
one with `build_schedule(body)`, where `body(root)` emits transform ops at the current
insertion point, and apply it with `apply_schedule(payload, schedule)`; `run_schedule` does
both. All helpers expect an active MLIR context and location.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import interpreter, loop, structured

from transform_ext.nested import main_sequence

ID_ATTR = "lh.id"


def any_op() -> ir.Type:
    return transform.AnyOpType.get()


def build_schedule(body: Callable[[ir.Value], None]) -> tuple[ir.Module, object]:
    """A module holding `@__transform_main(%root: !transform.any_op {transform.consumed})`."""
    return main_sequence(body)


def apply_schedule(payload: ir.Module, schedule: tuple[ir.Module, object],
                   *, expensive_checks: bool = False) -> None:
    module, seq = schedule
    options = interpreter.TransformOptions()
    options.expensive_checks = expensive_checks
    interpreter.apply_named_sequence(payload.operation, seq, module, options)


def run_schedule(payload: ir.Module, body: Callable[[ir.Value], None], **kwargs) -> None:
    """Build the schedule `body` and apply it to `payload` (in the payload's context)."""
    with payload.context, ir.Location.unknown():
        apply_schedule(payload, build_schedule(body), **kwargs)


def run_passes(payload: ir.Module, pipeline: str) -> None:
    """Run a textual pass pipeline, e.g. 'canonicalize, cse', on the whole module."""
    from torch_mlir.passmanager import PassManager

    with payload.context:
        PassManager.parse(f"builtin.module({pipeline})").run(payload.operation)


def match(target: ir.Value, names: str | Sequence[str]) -> ir.Value:
    return structured.MatchOp.match_op_names(target, names).result


def match_id(target: ir.Value, op_id: int) -> ir.Value:
    """The payload op tagged with `lh.id = op_id` (see `tag_ops`)."""
    i64 = ir.IntegerType.get_signless(64)
    return structured.MatchOp(any_op(), target,
                              op_attrs={ID_ATTR: ir.IntegerAttr.get(i64, op_id)}).result


def apply_patterns(target: ir.Value, *populate: Callable[[], object], apply_cse: bool = False) -> None:
    """One `transform.apply_patterns` region holding the given pattern ops (keep them few:
    one giant set with every vector lowering plus canonicalization can stall the driver)."""
    op = transform.ApplyPatternsOp(target, apply_cse=apply_cse)
    with ir.InsertionPoint(op.patterns):
        for fn in populate:
            fn()


def canonicalize(target: ir.Value) -> None:
    apply_patterns(target, transform.ApplyCanonicalizationPatternsOp, apply_cse=True)


def foreach(handle: ir.Value, body: Callable[[ir.Value], None]) -> None:
    op = transform.ForeachOp([], [handle])
    with ir.InsertionPoint(op.body):
        body(op.bodyTargets[0])
        transform.YieldOp()


def hoist_loop_invariant_subsets(func: ir.Value) -> None:
    """Move loop-invariant tensor subset reads/writes (accumulators) out of every scf.for."""
    foreach(match(func, "scf.for"), lambda l: loop.HoistLoopInvariantSubsetsOp(l))


def tag_ops(payload_ops: Iterable[ir.Operation], start: int = 0) -> dict[int, ir.Operation]:
    """Give each payload op a unique `lh.id` so schedules can match it exactly."""
    i64 = ir.IntegerType.get_signless(64)
    tagged = {}
    for i, op in enumerate(payload_ops, start=start):
        op.attributes[ID_ATTR] = ir.IntegerAttr.get(i64, i)
        tagged[i] = op
    return tagged


def clear_tags(payload: ir.Module, attr: str = ID_ATTR) -> None:
    def strip(op):
        if attr in op.attributes:
            del op.attributes[attr]
        return ir.WalkResult.ADVANCE

    payload.operation.walk(strip)
