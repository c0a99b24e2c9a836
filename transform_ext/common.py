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
from torch_mlir.dialects import arith, tensor, transform

Success = transform.DiagnosedSilenceableFailure.Success
SilenceableFailure = transform.DiagnosedSilenceableFailure.SilenceableFailure


# unit attribute of a linalg op the target lowers itself (a step of a contraction on AMX
# tiles, transform_ext.contraction_loops_to_amx_tiles): vector tiling and vectorization leave it
TARGET_KERNEL = "lh.target_kernel"
# unit attribute of a bf16 contraction in pairs, loops (m, n, p, v) with A[m, p, v],
# B[p, n, v] and C[m, n] f32, m, n and 2p multiples of AMX_SIDE: a CPU schedule cuts it into
# steps of AMX tiles (schedules/linear_cross_entropy/cpu.py)
AMX_PRODUCT = "lh.amx_product"
AMX_SIDE = 32  # the side of the 2 x 2 AMX tiles of such a product's output steps


class RewritesTargets(ir.MemoryEffectsOpInterface):
    """Memory effects of an op that rewrites the payload under the handles it reads (the
    targets' own ops stay) and returns handles it produces, if any."""

    @staticmethod
    def get_effects(op, effects):
        transform.only_reads_handle(op.op_operands, effects)
        transform.produces_handle(op.results, effects)
        transform.modifies_payload(effects)


class RewritesNestedOps(ir.MemoryEffectsOpInterface):
    """Memory effects of an op that keeps its target ops but replaces ops nested in them
    outside the interpreter's rewriter (through a nested interpreter run): it consumes the
    handles it reads, so the interpreter invalidates every other handle to an op nested in
    the targets (a later use is a checked error, not a read of a freed op), and returns a
    handle to the same targets."""

    @staticmethod
    def get_effects(op, effects):
        transform.consumes_handle(op.op_operands, effects)
        transform.produces_handle(op.results, effects)
        transform.modifies_payload(effects)


class ReplacesTargets(ir.MemoryEffectsOpInterface):
    """Memory effects of an op that replaces the payload ops of the handles it consumes and
    returns handles to what replaced them."""

    @staticmethod
    def get_effects(op, effects):
        transform.consumes_handle(op.op_operands, effects)
        transform.produces_handle(op.results, effects)
        transform.modifies_payload(effects)


class MatchesPayload(ir.MemoryEffectsOpInterface):
    """Memory effects of a matcher: reads its handles and the payload, returns handles."""

    @staticmethod
    def get_effects(op, effects):
        transform.only_reads_handle(op.op_operands, effects)
        transform.produces_handle(op.results, effects)
        transform.only_reads_payload(effects)


class Illegal(Exception):
    """Raised by legality checks: `payload` is the op at fault, the message the reason."""

    def __init__(self, payload, reason: str):
        super().__init__(reason)
        self.payload = payload
        self.reason = reason


def payload_ops(state, handle) -> list[ir.Operation]:
    """The payload ops `handle` maps to in the interpreter `state`, as ir.Operation."""
    return [getattr(t, "operation", t) for t in state.get_payload_ops(handle)]


def match_op_and_producers(name: str, op, results, state, find, op_result, producers_result):
    """The apply of a matcher mapping each payload op of `op.target` to (an op, the ops to
    fuse into the loop that tiles it) with `find`: the ops go to `op_result`, all producers
    (concatenated in target order) to `producers_result`; an Illegal from `find` is a
    silenceable failure naming the op and the reason."""
    with op.context:
        found, fused = [], []
        try:
            for target in payload_ops(state, op.target):
                one, ops = find(target)
                found.append(one)
                fused += ops
        except Illegal as illegal:
            return fail(name, illegal)
        results.set_ops(op_result, found)
        results.set_ops(producers_result, fused)
        return Success


def replace_legal_reads(name: str, op, rewriter, state, legal, build):
    """The apply of an op rewriting the vector.transfer_reads nested in (or equal to) its
    targets: `legal(read)` returns what the rewrite needs or raises Illegal, `build(read,
    found)` builds the read's replacement value before it. Illegal reads are left alone,
    except that a target that is itself an illegal read is a silenceable failure (checked
    first: nothing rewritten)."""
    with op.context:
        targets = payload_ops(state, op.target)
        try:
            for target in targets:
                if target.name == "vector.transfer_read":
                    legal(target)
        except Illegal as illegal:
            return fail(name, illegal)
        for target in targets:
            for read in ops_named(target, "vector.transfer_read"):
                try:
                    found = legal(read)
                except Illegal:
                    continue
                with ir.InsertionPoint(read), read.location:
                    value = build(read, found)
                rewriter.replace_op(read, [value])
        return Success


def all_in_bounds(transfer: ir.Operation) -> bool:
    """Whether a vector transfer op is marked in bounds in every dim."""
    attrs = transfer.attributes
    return "in_bounds" in attrs and all(ir.BoolAttr(b).value for b in ir.ArrayAttr(attrs["in_bounds"]))


def is_argument_view(value: ir.Value, block: ir.Block) -> bool:
    """Whether `value` is an argument of `block` or a tensor.collapse_shape / expand_shape
    of one in `block` (a [B, T] target tensor read as [B * T]: the same elements)."""
    owner = defining_op(value)
    if owner is not None and owner.name in ("tensor.collapse_shape", "tensor.expand_shape") \
            and owner.block == block:
        value = owner.operands[0]
    return isinstance(value, ir.BlockArgument) and value.owner == block


def rewrite_functions(name: str, op, rewriter, state, rewrite_in) -> object:
    """The apply of an op whose targets are functions: every target checked to be a
    func.func first (else a silenceable failure naming it, nothing rewritten), then
    `rewrite_in(func, rewriter)` on each."""
    with op.context:
        targets = payload_ops(state, op.target)
        try:
            for t in targets:
                if t.name != "func.func":
                    raise Illegal(t, "not a func.func")
        except Illegal as illegal:
            return fail(name, illegal)
        for t in targets:
            rewrite_in(t, rewriter)
        return Success


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of n in [1, limit] (tile sizes that divide their extents)."""
    limit = max(1, min(n, limit))
    for d in range(limit, 0, -1):
        if n % d == 0:
            return d
    return 1


def describe(op) -> str:
    """'linalg.generic at loc(...)' for messages."""
    op = getattr(op, "operation", op)
    return f"{op.name} at {op.location}"


def strip_locations(text: str) -> str:
    """`text` without its ` at loc(...)` parts (nested parentheses and quoted file names
    included): a location is no use in a one-line reason."""
    out, i = [], 0
    while (j := text.find("at loc(", i)) >= 0:
        out.append(text[i:j].rstrip())
        k, depth, quoted = j + len("at loc("), 1, False
        while k < len(text) and depth:
            c = text[k]
            if quoted:
                if c == "\\":
                    k += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c in "()":
                depth += 1 if c == "(" else -1
            k += 1
        i = k
    out.append(text[i:])
    return "".join(out)


def failure_reason(text: str) -> str:
    """The reason of an MLIR failure as one clean line: the first diagnostic (or the first
    line), without locations, the "Diagnostic message" prefix, or the notes MLIR appends to
    a silenceable failure of a Python-defined op ("...at loc(unknown): at loc(unknown):
    TransformOpInterfaceFallbackModel: silenceable failure")."""
    lines = [line for line in text.splitlines() if line.strip()]
    line = next((l for l in lines if "Diagnostic message" in l or l.lstrip().startswith("error:")),
                lines[0] if lines else "")
    line = line.split("TransformOpInterfaceFallbackModel", 1)[0]
    line = strip_locations(line).strip()
    for prefix in ("Diagnostic message", "error"):
        if line.startswith(prefix):
            line = line[len(prefix):]
    parts = [p.strip() for p in line.split(": ")]
    return ": ".join(p for p in parts if p.strip(" :")).strip(" :")


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


def planned_ops(state, handle, plan) -> list[tuple[ir.Operation, object]]:
    """(op, plan(op)) for the ops nested in the payload of `handle` (the ops themselves
    included) whose plan is not None; each op is planned once."""
    plans = {}

    def planned(op):
        plans[op] = plan(op)
        return plans[op] is not None

    return [(p, plans[p]) for t in payload_ops(state, handle) for p in walk_ops(t, planned)]


def is_static_tensor(value: ir.Value) -> bool:
    return isinstance(value.type, ir.RankedTensorType) and ir.RankedTensorType(value.type).has_static_shape


def ops_named(root, name: str) -> list[ir.Operation]:
    """Ops named `name` under `root` (root included), in post-order (inner ops first)."""
    found = []

    def visit(op):
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    getattr(root, "operation", root).walk(visit, ir.WalkOrder.POST_ORDER)
    return found


def is_row_major(t: ir.MemRefType) -> bool:
    """A static memref whose elements are one dense row-major block from its base (offset 0,
    every stride the product of the sizes after it)."""
    if not t.has_static_shape:
        return False
    strides, offset = t.get_strides_and_offset()
    expected, running = [], 1
    for size in reversed(t.shape):
        expected.append(running)
        running *= size
    return offset == 0 and list(strides) == expected[::-1]


def static_region(slice_op: ir.Operation) -> list[tuple[int, int]] | None:
    """[(offset, size)] per dim of a tensor.extract_slice or insert_slice with static
    offsets and sizes and unit strides, else None."""
    view = slice_op.opview
    offsets, sizes = list(view.static_offsets), list(view.static_sizes)
    if any(ir.ShapedType.is_dynamic_size(x) for x in offsets + sizes) or \
            any(s != 1 for s in view.static_strides):
        return None
    return list(zip(offsets, sizes))


def block_ops(where) -> list[ir.Operation]:
    """The ops of a block, or of the entry block of an op's first region (a function)."""
    block = where if isinstance(where, ir.Block) else where.regions[0].blocks[0]
    return [op.operation for op in block.operations]


def is_nested_in(op: ir.Operation, container: ir.Operation) -> bool:
    """Is `op` inside a region of `container` (at any depth; not `container` itself)?"""
    container = getattr(container, "operation", container)
    parent = op.parent
    while parent is not None:
        parent = getattr(parent, "operation", parent)
        if parent == container:
            return True
        parent = parent.parent
    return False


def defining_op(value: ir.Value) -> ir.Operation | None:
    owner = value.owner
    if isinstance(owner, ir.OpView):
        owner = owner.operation
    return owner if isinstance(owner, ir.Operation) else None


def users(value: ir.Value) -> list[ir.Operation]:
    """The ops reading `value`, one per use (an op reading it twice is listed twice)."""
    return [user_op(use) for use in value.uses]


def result_users(op: ir.Operation) -> list[ir.Operation]:
    """The ops reading any result of `op`, one per use."""
    return [user for result in op.results for user in users(result)]


def user_op(use) -> ir.Operation:
    """The op an OpOperand `use` belongs to, as ir.Operation."""
    return getattr(use.owner, "operation", use.owner)



def depends_on(op: ir.Operation, value: ir.Value, limit: int = 256) -> bool:
    """`op` reads `value` through ops of its block (at most `limit` ops looked at)."""
    seen, pending = [], [op]
    while pending and len(seen) < limit:
        cur = pending.pop()
        if cur in seen:
            continue
        seen.append(cur)
        for v in cur.operands:
            if v == value:
                return True
            p = defining_op(v)
            if p is not None and p.block == op.block:
                pending.append(p)
    return False


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


# ----------------------------------------------------------------------------- building IR


def iterator_attr(kind: str) -> ir.Attribute:
    """#linalg.iterator_type<parallel|reduction>."""
    return ir.Attribute.parse(f"#linalg.iterator_type<{kind}>")


def iterator_kind(attr: ir.Attribute) -> str:
    """'parallel' or 'reduction': the kind a #linalg.iterator_type or #vector.iterator_type
    attribute holds (compared as attributes, not as printed text)."""
    from torch_mlir.dialects import linalg, vector

    for dialect, kinds in (("linalg", linalg.IteratorType), ("vector", vector.IteratorType)):
        for kind in kinds:
            if attr == ir.Attribute.parse(f"#{dialect}.iterator_type<{kind}>", attr.context):
                return str(kind)
    raise ValueError(f"not an iterator type attribute: {attr}")


def iterator_kinds(op) -> list[str]:
    """'parallel' / 'reduction' per loop dim of a linalg.generic or vector.contract."""
    return [iterator_kind(a) for a in ir.ArrayAttr(getattr(op, "operation", op).attributes["iterator_types"])]


def body_of(op) -> ir.Block:
    return getattr(op, "operation", op).regions[0].blocks[0]


def terminator(block: ir.Block) -> ir.Operation:
    return block.operations[len(block.operations) - 1].operation


def clone_body(source, mapping: dict, until_terminator: bool = True) -> list[ir.Value]:
    """Clone the ops of `source`'s body at the current insertion point, mapping the values in
    `mapping` (body arguments to new values; filled with the clones' results as it goes).

    Returns the values the terminator yields, mapped; nested regions are remapped too."""
    block = body_of(source)
    ops = list(block.operations)
    for op in ops[:-1] if until_terminator else ops:
        clone_op(op.operation, mapping)
    return [mapping.get(v, v) for v in terminator(block).operands]


def clone_op(op: ir.Operation, mapping: dict) -> ir.Operation:
    """Clone `op` at the current insertion point with its operands (nested ones too) looked
    up in `mapping`, and record its results' clones there. Returns the clone."""
    clone = op.clone()
    remap_operands(clone, mapping)
    for old, new in zip(op.results, clone.results):
        mapping[old] = new
    return clone


def remap_operands(op: ir.Operation, mapping: dict) -> None:
    """Replace, in `op` and every op nested in it, operands found in `mapping`."""

    def visit(inner):
        for i, v in enumerate(inner.operands):
            if v in mapping:
                inner.operands[i] = mapping[v]
        return ir.WalkResult.ADVANCE

    op.walk(visit)


def build_generic(inputs, outputs, maps, iterators, body, *, name_from=None):
    """A linalg.generic at the current insertion point and location.

    `maps`: ir.AffineMap per input then output; `iterators`: 'parallel'/'reduction' per loop;
    `body(args)` builds the body at the block's insertion point from its arguments and
    returns the values to yield. `name_from`: copy its `library_call`/`doc` attributes."""
    from torch_mlir.dialects import linalg

    result_types = [v.type for v in outputs if isinstance(v.type, ir.RankedTensorType)]
    generic = linalg.GenericOp(result_types, list(inputs), list(outputs),
                               ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps]),
                               ir.ArrayAttr.get([iterator_attr(k) for k in iterators]))
    arg_types = [element_type(v.type) for v in list(inputs) + list(outputs)]
    block = generic.regions[0].blocks.append(*arg_types)
    with ir.InsertionPoint(block):
        linalg.YieldOp(list(body(list(block.arguments))))
    if name_from is not None:
        for attr in ("library_call", "doc"):
            if attr in name_from.attributes:
                generic.attributes[attr] = name_from.attributes[attr]
    return generic


def reassociation_attr(groups: list[list[int]]) -> ir.ArrayAttr:
    """The reassociation attribute of tensor.expand_shape / collapse_shape."""
    i64 = ir.IntegerType.get_signless(64)
    return ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(i64, i) for i in g]) for g in groups])


def element_type(t: ir.Type) -> ir.Type:
    return t.element_type if isinstance(t, ir.ShapedType) else t


def constant_value(value: ir.Value):
    """The scalar attribute a value is known to hold everywhere: an arith.constant scalar, the
    splat of a dense constant, or a linalg.fill of a constant; else None."""
    op = defining_op(value)
    if op is None:
        return None
    if op.name == "arith.constant":
        attr = op.attributes["value"]
        if isinstance(attr, (ir.FloatAttr, ir.IntegerAttr)):
            return attr
        if isinstance(attr, ir.DenseElementsAttr) and attr.is_splat:
            splat = attr.get_splat_value()
            return splat if isinstance(splat, (ir.FloatAttr, ir.IntegerAttr)) else None
        return None
    if op.name == "linalg.fill" and len(op.operands) == 2:
        return constant_value(op.operands[0])
    return None


def is_zero(value: ir.Value) -> bool:
    """True when `value` is a constant +0.0 / -0.0 / integer 0 (scalar, splat or fill)."""
    attr = constant_value(value)
    if isinstance(attr, ir.FloatAttr):
        return attr.value == 0.0
    if isinstance(attr, ir.IntegerAttr):
        return attr.value == 0
    return False


STRUCTURAL_ATTRS = ("indexing_maps", "iterator_types", "operandSegmentSizes")


def keep_attributes(old: ir.Operation, new: ir.Operation) -> None:
    """Copy the attributes of linalg.generic `old` that do not describe its structure (its
    library_call, doc, and the schedules' marks) onto its rebuilt `new`."""
    attrs = old.attributes
    for i in range(len(attrs)):
        if attrs[i].name not in STRUCTURAL_ATTRS:
            new.attributes[attrs[i].name] = attrs[i].attr


def rebuild_generic(op: ir.Operation, inputs, input_maps, mapping_of, rewriter=None,
                    skip=()) -> ir.Operation:
    """Replace linalg.generic `op` by one reading `inputs` through `input_maps`, its outputs,
    their maps, its iterators and its other attributes kept: `op`'s body is cloned (but the
    ops in `skip`) with the values `mapping_of(args)` maps (args: the new block's arguments,
    inputs then outputs; it returns {old value: new value}, op's output block arguments
    included). Through `rewriter` inside a transform op; returns the new op."""
    view = op.opview
    outputs = list(view.outputs)
    maps = [m.value for m in view.indexing_maps]
    block = body_of(op)

    def body(args):
        mapping = mapping_of(args)
        for inner in list(block.operations)[:-1]:
            if inner.operation not in skip:
                clone_op(inner.operation, mapping)
        return [mapping.get(v, v) for v in terminator(block).operands]

    with op.context, op.location, ir.InsertionPoint(op):
        new = build_generic(list(inputs), outputs, list(input_maps) + maps[len(view.inputs):],
                            iterator_kinds(op), body, name_from=op)
    keep_attributes(op, new.operation)
    if rewriter is not None:
        rewriter.replace_op(op, list(new.results))
    else:
        for old, res in zip(op.results, new.results):
            old.replace_all_uses_with(res)
        op.erase()
    return new.operation


def append_input(op: ir.Operation, value: ir.Value, amap: ir.AffineMap, rewriter=None) -> ir.Operation:
    """Rebuild linalg.generic `op` with one more input (`value` through `amap`) that its body
    does not read, every other attribute kept; the new op replaces `op` (through `rewriter`
    inside a transform op) and is returned."""
    view = op.opview
    inputs = list(view.inputs)
    n_out = len(list(view.outputs))
    block = body_of(op)

    def mapping_of(args):
        mapping = {block.arguments[i]: args[i] for i in range(len(inputs))}
        for j in range(n_out):
            mapping[block.arguments[len(inputs) + j]] = args[len(inputs) + 1 + j]
        return mapping

    maps = [m.value for m in view.indexing_maps]
    return rebuild_generic(op, inputs + [value], maps[:len(inputs)] + [amap], mapping_of, rewriter)


# ----------------------------------------------------------------------------- slices


def i64_array(values) -> ir.DenseI64ArrayAttr:
    return ir.DenseI64ArrayAttr.get(list(values))


def slice_strides(sizes, strides) -> list[int]:
    """`strides` with 1 on the dims of one element: a stride there only upsets the strided
    layouts of bufferization (a copy it cannot lower to a plain one)."""
    return [1 if size == 1 else stride for size, stride in zip(sizes, strides)]


def strided_slice(value: ir.Value, offsets, sizes, strides) -> ir.Value:
    """tensor.extract_slice of `value` with static offsets, sizes and strides (`value`
    itself when the slice is the whole), `slice_strides`. At the current insertion point."""
    strides = slice_strides(sizes, strides)
    t = value.type
    if list(offsets) == [0] * len(sizes) and list(sizes) == list(t.shape) and set(strides) <= {1}:
        return value
    return tensor.ExtractSliceOp(ir.RankedTensorType.get(list(sizes), t.element_type), value, [], [],
                                 [], i64_array(offsets), i64_array(sizes), i64_array(strides)).result


def zero_padded(value: ir.Value, low, high) -> ir.Value:
    """tensor.pad of `value` with zeros, `low` and `high` elements per dim (`value` itself
    when both are all zero). At the current insertion point."""
    if not any(low) and not any(high):
        return value
    t = value.type
    shape = [s + lo + hi for s, lo, hi in zip(t.shape, low, high)]
    pad = tensor.PadOp(ir.RankedTensorType.get(shape, t.element_type), value, [], [],
                       i64_array(low), i64_array(high))
    block = pad.regions[0].blocks.append(*[ir.IndexType.get()] * len(shape))
    with ir.InsertionPoint(block):
        zero = arith.ConstantOp(t.element_type, ir.FloatAttr.get(t.element_type, 0.0)).result
        tensor.YieldOp(zero)
    return pad.result
