"""Loop-carried reductions into vector accumulators.

Vectorizing a row reduction whose row is tiled (softmax's max and sum over 4096 columns in
steps of 64) leaves a loop that carries one scalar and reduces each step's vector across
its lanes into it:

    %r = scf.for %j = ... iter_args(%acc = %init) -> (vector<1xf32>) {
      %a = vector.extract %acc[0]
      %s = vector.reduction <add>, %x, %a : vector<64xf32> into f32
      %b = vector.insert %s, %v [0] : f32 into vector<1xf32>   (or a broadcast)
      scf.yield %b
    }

Each step then waits for the last one's shuffle tree (about 30 cycles for 64 lanes): the
loop ran at a third of the memory's speed. `reductions_into_vector_accumulators` carries the
step's whole vector instead, combined lane by lane (`%acc' = %acc + %x`, from the kind's
neutral element), and reduces across lanes once after the loop, into the original init.
Exact for max and min (NaN still propagates); a sum or product is reassociated (lane
partials, then a tree), as torch's own vectorized reductions do, and only when the reduction
allows it (its `reassoc` flag, which `cpu.reassociate_vector_reductions` sets on float sums).
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import arith, vector

from transform_ext.common import defining_op, user_op

# the kind of a vector.reduction -> (its lane-wise op, its neutral element, needs reassoc)
_COMBINE = {
    "add": ("arith.addf", 0.0, True),
    "mul": ("arith.mulf", 1.0, True),
    "maximumf": ("arith.maximumf", float("-inf"), False),
    "minimumf": ("arith.minimumf", float("inf"), False),
    "maxnumf": ("arith.maxnumf", float("-inf"), False),
    "minnumf": ("arith.minnumf", float("inf"), False),
}


def reductions_into_vector_accumulators(payload: ir.Module, max_bytes: int = 256) -> int:
    """Rewrite every float scf.for iter_arg that only feeds one lane reduction's accumulator
    and is yielded that reduction's result (see the module docstring); the number rewritten.
    A step's vector longer than `max_bytes` (four registers by default) is folded in halves
    to that width first, so that the carried vectors stay in registers (a layer norm's two
    f64 sums of 64 lanes would take all 32)."""
    found = []

    def visit(op):
        if op.name == "scf.for":
            for k in range(len(op.results)):
                reduction = _lane_reduction(op, k)
                if reduction is not None and _carried_lanes(reduction, max_bytes):
                    found.append((op, k, reduction))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        for loop, k, reduction in found:
            _carry_vector(loop, k, reduction, _carried_lanes(reduction, max_bytes))
    return len(found)


def _carried_lanes(reduction: ir.Operation, max_bytes: int) -> int:
    """Lanes of the carried vector: the step's, halved until they fit in `max_bytes` (0 when
    even one lane does not)."""
    lanes_type = ir.VectorType(reduction.operands[0].type)
    lanes = lanes_type.shape[0]
    element_bytes = max(1, lanes_type.element_type.width // 8)
    while lanes * element_bytes > max_bytes and lanes % 2 == 0:
        lanes //= 2
    return lanes if lanes * element_bytes <= max_bytes else 0


def _kind(reduction: ir.Operation) -> str:
    return str(reduction.attributes["kind"]).split("<")[-1].rstrip(">")


def _lane_reduction(loop: ir.Operation, k: int) -> ir.Operation | None:
    """The vector.reduction that iter_arg k of `loop` feeds, when the iter_arg (a float or
    a vector of one element, of any rank: a reduction over several dims into [1, 1]) is
    read only as that reduction's accumulator and the loop yields the reduction's result at
    k; else None."""
    body = loop.regions[0].blocks[0]
    arg = body.arguments[1 + k]
    single = isinstance(arg.type, ir.VectorType)
    if single and any(d != 1 for d in ir.VectorType(arg.type).shape):
        return None
    scalar_type = ir.VectorType(arg.type).element_type if single else arg.type
    if not isinstance(scalar_type, ir.FloatType):
        return None
    uses = list(arg.uses)
    if len(uses) != 1:
        return None
    reader = user_op(uses[0])
    if single:
        if reader.name != "vector.extract" or len(list(reader.results[0].uses)) != 1:
            return None
        reader = user_op(next(iter(reader.results[0].uses)))
    if reader.name != "vector.reduction" or reader.parent != loop or len(reader.operands) != 2 \
            or _kind(reader) not in _COMBINE:
        return None
    lanes = reader.operands[0].type
    if not isinstance(lanes, ir.VectorType) or lanes.rank != 1 or lanes.scalable:
        return None
    _, _, needs_reassoc = _COMBINE[_kind(reader)]
    if needs_reassoc and ("fastmath" not in reader.attributes
                          or "reassoc" not in str(reader.attributes["fastmath"])):
        return None
    yielded = list(body.operations)[-1].operands[k]
    if single:
        widen = defining_op(yielded)  # into the one-element vector: broadcast or insert
        if widen is None or widen.name not in ("vector.broadcast", "vector.insert") \
                or not widen.operands[0] == reader.results[0] \
                or len(list(widen.results[0].uses)) != 1:
            return None
    elif not yielded == reader.results[0]:
        return None
    if len(list(reader.results[0].uses)) != 1:
        return None
    return reader


def _carry_vector(loop: ir.Operation, k: int, reduction: ir.Operation, lanes: int) -> None:
    body = loop.regions[0].blocks[0]
    arg = body.arguments[1 + k]
    single = isinstance(arg.type, ir.VectorType)
    step_type = ir.VectorType(reduction.operands[0].type)
    lanes_type = ir.VectorType.get([lanes], step_type.element_type)
    combine, neutral, _ = _COMBINE[_kind(reduction)]

    def combined(a, b):
        return ir.Operation.create(combine, results=[a.type], operands=[a, b]).result

    init = loop.operands[3 + k]
    yield_op = list(body.operations)[-1]
    old_yielded = yield_op.operands[k]
    # before the loop: the neutral vector
    with ir.InsertionPoint(loop), loop.location:
        neutral_lanes = arith.constant(lanes_type, ir.DenseElementsAttr.get_splat(
            lanes_type, ir.FloatAttr.get(lanes_type.element_type, neutral)))
    loop.operands[3 + k] = neutral_lanes
    # in the loop: combine lane by lane
    reader = user_op(next(iter(arg.uses)))
    with ir.InsertionPoint(reduction), reduction.location:
        step = reduction.operands[0]
        pieces = [step] if lanes == step_type.shape[0] else [
            vector.extract_strided_slice(lanes_type, step, [offset], [lanes], [1])
            for offset in range(0, step_type.shape[0], lanes)]
        while len(pieces) > 1:  # a tree: the halves of the step, independent of the carry
            pieces = [combined(pieces[i], pieces[i + 1]) for i in range(0, len(pieces), 2)]
        arg.set_type(lanes_type)
        yield_op.operands[k] = combined(arg, pieces[0])
    # after the loop: one reduction across lanes into the original init
    result = loop.results[k]
    old_uses = [(user_op(u), u.operand_number) for u in result.uses]
    result.set_type(lanes_type)
    with ir.InsertionPoint.after(loop), loop.location:
        acc = vector.extract(init, [], [0] * ir.VectorType(init.type).rank) if single else init
        attrs = {"kind": reduction.attributes["kind"]}
        if "fastmath" in reduction.attributes:
            attrs["fastmath"] = reduction.attributes["fastmath"]
        total = ir.Operation.create("vector.reduction", results=[reduction.results[0].type],
                                    operands=[result, acc], attributes=attrs).result
        final = vector.broadcast(init.type, total) if single else total
    for user, number in old_uses:
        user.operands[number] = final
    if single:
        defining_op(old_yielded).erase()
    reduction.erase()
    if single:
        reader.erase()
