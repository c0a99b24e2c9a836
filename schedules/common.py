"""Building and applying transform schedules: thin helpers over the upstream builders.

A schedule is a `transform.named_sequence @__transform_main(%root)` in its own module. Build
one with `build_schedule(body)`, where `body(root)` emits transform ops at the current
insertion point, and apply it with `apply_schedule(payload, schedule)`; `run_schedule` does
both. All helpers expect an active MLIR context and location.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import interpreter, loop, structured

from transform_ext.nested import main_sequence



def any_op() -> ir.Type:
    return transform.AnyOpType.get()


def tile_to_vector_tile(handle: ir.Value, sizes: list[int] | None, order: list[int] | None,
                        extents: list[int], mark: str) -> None:
    """The op of `handle` (of loop `extents`) tiled with scf.for to its vector tile `sizes`
    (transform_ext.analysis.tiles.vector_tile_sizes; None: the op is one tile) in loop
    `order` (reductions innermost: tile_to_vector_tiles.reductions_innermost), as the generic
    schedule tiles it, the last partial tile of each loop peeled into a static tile of its
    own (a dynamic tile does not vectorize: it stayed a scalar loop). The op and its peeled
    copies are annotated `mark`: `vectorize_marked` vectorizes them once a canonicalization
    has folded the peeled tiles' sizes to constants."""
    from transform_ext.tile_to_vector_tiles import partial_tile_loops

    annotate(handle, mark)
    if sizes is None:
        return
    tiled = structured.TileUsingForOp(handle, sizes=sizes, interchange=order)
    for partial in reversed(partial_tile_loops(tiled, extents, sizes, order)):
        peel_loop(partial)  # innermost first: an outer peel clones the loops inside it


def suppressed(handle: ir.Value, build: Callable[[ir.Value], object]) -> None:
    """`build(target)` inside a sequence on `handle` whose failures are suppressed: an op
    the transform cannot take is left as it is."""
    seq = transform.SequenceOp(transform.FailurePropagationMode.Suppress, [], handle)
    with ir.InsertionPoint(seq.body):
        build(seq.bodyTarget)
        transform.YieldOp()


def vectorize_or_leave(handle: ir.Value, gather: bool = True) -> None:
    """Vectorize the ops of `handle`; one the vectorizer cannot take stays a (correct) loop
    nest."""
    suppressed(handle, lambda op: structured.VectorizeOp(op, vectorize_nd_extract=gather))


def vectorize_marked(func: ir.Value, mark: str) -> None:
    """`vectorize_or_leave` each op in `func` annotated `mark` (`tile_to_vector_tile`)."""
    marked = structured.MatchOp(any_op(), func, op_attrs={mark: ir.UnitAttr.get()}).result
    foreach(marked, vectorize_or_leave)


def peel_loop(loop_handle: ir.Value):
    """transform.loop.peel of the scf.for of `loop_handle`: its last, partial iteration
    split off as a loop of its own. The handle is cast to !transform.op<"scf.for"> first
    (the peel verifies its operand's type: with an !transform.any_op one the script does not
    verify, and prints only in the generic form)."""
    for_loop = transform.CastOp(transform.OperationType.get("scf.for"), loop_handle).output
    return loop.LoopPeelOp(any_op(), any_op(), for_loop)


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


def apply_passes(target: ir.Value, *names: str) -> ir.Value:
    """transform.apply_registered_pass of each pass in turn (it consumes its target);
    returns the handle to the target after the last."""
    for name in names:
        target = transform.ApplyRegisteredPassOp(any_op(), target, name).result
    return target


def match(target: ir.Value, names: str | Sequence[str]) -> ir.Value:
    return structured.MatchOp.match_op_names(target, names).result


def apply_patterns(target: ir.Value, *populate: Callable[[], object], apply_cse: bool = False) -> None:
    """One `transform.apply_patterns` region holding the given pattern ops (keep them few:
    one giant set with every vector lowering plus canonicalization can stall the driver)."""
    op = transform.ApplyPatternsOp(target, apply_cse=apply_cse)
    with ir.InsertionPoint(op.patterns):
        for fn in populate:
            fn()


def canonicalize(target: ir.Value) -> None:
    apply_patterns(target, transform.ApplyCanonicalizationPatternsOp, apply_cse=True)


def annotate(handle: ir.Value, name: str, value: ir.Attribute | str | None = None) -> None:
    """transform.annotate the ops of `handle` with `name`: a unit attribute, or `value` (an
    attribute, or a string) as a param constant."""
    if isinstance(value, str):
        value = ir.StringAttr.get(value)
    param = None if value is None else transform.ParamConstantOp(transform.AnyParamType.get(),
                                                                  value).param
    transform.AnnotateOp(handle, name, param=param)


def foreach(handle: ir.Value, body: Callable[[ir.Value], None]) -> None:
    op = transform.ForeachOp([], [handle])
    with ir.InsertionPoint(op.body):
        body(op.bodyTargets[0])
        transform.YieldOp()


def hoist_loop_invariant_subsets(func: ir.Value) -> None:
    """Move loop-invariant tensor subset reads/writes (accumulators) out of every scf.for."""
    foreach(match(func, "scf.for"), lambda l: loop.HoistLoopInvariantSubsetsOp(l))


Place = tuple[str, int, int]  # (op name, index among the ops of that name, their number)


def place_of(scope: ir.Operation, op: ir.Operation) -> Place:
    """Where `op` is among the ops of its name nested in `scope` (the payload module), in
    the order `structured.match` lists them (a post-order walk): a handle to it in a script
    is `at_place(root, place)`."""
    same_name = []

    def visit(o):
        if o.name == op.name:
            same_name.append(o)
        return ir.WalkResult.ADVANCE

    scope.walk(visit, ir.WalkOrder.POST_ORDER)
    return op.name, same_name.index(op), len(same_name)


def places_of(scope: ir.Operation, ops: list[ir.Operation]) -> list[Place]:
    """`place_of` of each of `ops`, in one walk of `scope` (one walk per op is quadratic
    in a whole CNN's thousands of ops)."""
    by_name: dict[str, list] = {}

    def visit(o):
        by_name.setdefault(o.name, []).append(o)
        return ir.WalkResult.ADVANCE

    scope.walk(visit, ir.WalkOrder.POST_ORDER)
    index = {name: {o: i for i, o in enumerate(found)} for name, found in by_name.items()}
    return [(op.name, index[op.name][op], len(by_name[op.name])) for op in ops]


def at_places(root: ir.Value, places: list[Place]) -> list[ir.Value]:
    """`at_place` of each of `places`, the ops of one name matched and split once (a
    split per place would list every op of the name again: quadratic in the script)."""
    splits: dict[tuple[str, int], list[ir.Value]] = {}
    handles = []
    for name, index, count in places:
        if (name, count) not in splits:
            matched = match(root, name)
            splits[name, count] = [matched] if count == 1 else list(
                transform.SplitHandleOp([any_op()] * count, matched).results)
        handles.append(splits[name, count][index])
    return handles


def at_place(root: ir.Value, place: Place) -> ir.Value:
    """The handle to the op at `place` (see place_of) among the ops matched in `root`."""
    name, index, count = place
    matched = match(root, name)
    if count == 1:
        return matched
    return transform.SplitHandleOp([any_op()] * count, matched).results[index]
