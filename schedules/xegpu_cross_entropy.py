"""XeGPU tail of cross-entropy losses: F.cross_entropy, forward and forward+backward.

Input: the cross_entropy family's target-independent restructuring (schedules/cross_entropy.py,
`normalize` + `restructure`): the row max m, the exp-sum l and the other class sums (label
smoothing, the backward's sum of d loss / d logp) read the logits x [N, C]; the target
gather reads x[i, t_i] (never the [N, C] log-softmax); per-row losses; rank-0 reductions
over the rows (the count or total weight of counted targets, the loss sums) and the mean;
the gradient (backward) is one elementwise [N, C] op reading x and per-row values. The
payload's own ops are kept (their bodies are the math); `lower_loss` decides where each
runs, every kernel an scf.forall whose iterations are workgroups:

  host check     the result-less generic asserting 0 <= y < C for counted targets stays in
                 the host function; after bufferization (`finish_bufferized`) it reads a
                 host copy of y (gpu.memcpy) before the first launch, so a bad target stops
                 the program with a clear message, never a silent clamp;
  rows before    (backward) the rank-0 values the row kernel reads (the count that scales
                 the gradient): one workgroup of one subgroup;
  row kernel     `rows` rows per workgroup, 2 per subgroup: the max and the class sums as
                 ONE online loop over column tiles (fuse_dependent_reduction_ops, as for
                 long softmax rows: stable exp(m_old - m_new) corrections), the gather
                 x[i, t_i] as a scattered load, the per-row losses, and (backward) a second
                 loop over column tiles writing d x: the only N x C tensor besides x;
  rows after     the reductions of the per-row losses and the mean: one workgroup of one
                 subgroup looping over row tiles with [row_tile, 16] partial sums, one
                 cross-lane reduction at the end. No atomics.
No contraction anywhere: the kernels are vectorized without vector.contract (no DPAS).

Per-row data and memory. After a reduction over the classes every lane of a subgroup holds
the row's value (XeGPU's slice layout); XeGPU has no layout for a [rows] vector spread over
the lanes that also fits those values. So per-row data meets memory in "lane form", a
[rows, 16] tile holding the row's value in its 16 lanes:
  - a per-row input (the targets y) is read by a [rows, 16] gather (every lane of row i
    reads y[i]) and reduced by max over the identical lanes (exact);
  - a per-row generic that gathers (x[i, t_i], the weight w[t_i]) runs in lane form the
    same way; a gather at a per-row index inside an [N, C] op (w[y_i] in the gradient) is
    first hoisted into such a per-row generic (`hoist_row_gathers`);
  - a per-row result read by a later kernel is written as an [N, 16] f32 tile (2-D block
    store; 16 f32 = 64 bytes, the 2-D block minimum; f16/bf16 widened exactly); a
    reduction over the rows reads it back in lane form and counts lane 0 only,
    combine(acc, lane == 0 ? t : neutral) (exact);
  - a rank-0 value from an earlier kernel is read once per workgroup as a scalar.
The gather indices are clamped into [0, C) inside the kernels: memory safety only (an
ignored row's index; the host check has refused every out-of-range counted target).

Preconditions (else NotLowerable naming the op or dimension): logits [N, C] (classes last),
N a multiple of 2, C a multiple of a column tile that is a multiple of 16, class-index
targets, no [N, C] op besides the max, the class sums and the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import arith, linalg, scf, tensor
from torch_mlir.dialects.transform import structured

from transform_ext.analysis.classify import reduction_combiner
from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import (append_input, block_ops, body_of, build_generic, clone_op,
                                  defining_op, iterator_kinds, ops_named, terminator)

from .common import canonicalize, clear_tags, match_id, run_passes, run_schedule, tag_ops
from .generic import single_func

LANES = 16                      # lanes of a per-row tile in memory: the subgroup size
CLASS_REDUCTION = "lh.ce_class_reduction"   # the max and the class sums of the online loop
GRADIENT = "lh.ce_gradient"     # the [N, C] op writing d x
LANE_FORM = "lh.ce_lanes"      # generics already in lane form
KERNEL_ATTR = "lh.ce_kernel"    # on each kernel forall: its kind
ROW_BYTES = 8 * 1024            # registers a subgroup may spend on its f32 tiles (as xegpu_rows)


class NotLowerable(ValueError):
    """The payload has no GPU form here; the message names the op and the reason."""


# ------------------------------------------------------------------------------- plans

@dataclass(frozen=True)
class LossRowTiles:
    """The row kernel: `rows` rows per workgroup, `rows_per_subgroup` per subgroup, the
    class loop in steps of `column_tile`; `grid` workgroups."""

    rows: int
    rows_per_subgroup: int
    classes: int
    column_tile: int
    grid: tuple[int, ...]
    subgroup_size: int = 16

    @property
    def subgroups(self) -> int:
        return self.rows // self.rows_per_subgroup

    @property
    def sg_layout(self) -> list[int]:
        return [self.subgroups, 1]

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.rows_per_subgroup, self.column_tile)

    @property
    def threads(self) -> int:
        return self.subgroups * self.subgroup_size


@dataclass(frozen=True)
class RowSumTiles:
    """A reduction over the rows: one workgroup of one subgroup, `row_tile` rows (lane form
    [row_tile, 16]) per loop step."""

    rows: int
    row_tile: int
    subgroup_size: int = 16
    grid: tuple[int, ...] = (1,)

    @property
    def sg_layout(self) -> list[int]:
        return [1, 1]

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.row_tile, LANES)

    @property
    def threads(self) -> int:
        return self.subgroup_size


@dataclass
class LossKernel:
    kind: str                 # "cross_entropy" (the row kernel) | "row_sum"
    description: str
    tiles: object


# ------------------------------------------------------------------------------ helpers

def _func(payload: ir.Module) -> ir.Operation:
    return single_func(payload, NotLowerable)


def _users(value: ir.Value) -> list[ir.Operation]:
    return [getattr(u.owner, "operation", u.owner) for u in value.uses]


def _is_arg(value: ir.Value, block: ir.Block) -> bool:
    return isinstance(value, ir.BlockArgument) and value.owner == block


def _rank(value: ir.Value) -> int:
    return value.type.rank if isinstance(value.type, ir.ShapedType) else -1


def _has_assert(op: ir.Operation) -> bool:
    return op.name == "linalg.generic" and any(
        o.operation.name == "cf.assert" for o in body_of(op).operations)


def _has_extract(op: ir.Operation) -> bool:
    return op.name == "linalg.generic" and any(
        o.operation.name == "tensor.extract" for o in body_of(op).operations)


def _index(value: int) -> ir.Value:
    t = ir.IndexType.get()
    return arith.ConstantOp(t, ir.IntegerAttr.get(t, value)).result


def _empty(shape, element) -> ir.Value:
    return tensor.EmptyOp(list(shape), element).result


def _map(n: int, dims) -> ir.AffineMap:
    return ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(d) for d in dims])


def _max_identity(t: ir.Type) -> ir.Attribute:
    if isinstance(t, ir.FloatType):
        return ir.FloatAttr.get(t, float("-inf"))
    return ir.IntegerAttr.get(t, -(1 << (t.width - 1)))


def _fill(value_attr: ir.Attribute, out: ir.Value) -> ir.Value:
    c = arith.ConstantOp(value_attr.type, value_attr).result
    return linalg.fill(c, outs=[out])


def _max_over_lanes(lanes: ir.Value) -> ir.Value:
    """[n, LANES] -> [n]: max over the lanes (they hold one value: exact). f16/bf16 lanes
    are compared in f32 (the device has no 16-bit float max) and rounded back, exactly."""
    t = ir.RankedTensorType(lanes.type)
    elem = t.element_type
    narrow = isinstance(elem, ir.FloatType) and elem.width < 32
    acc = ir.F32Type.get() if narrow else elem
    init = _fill(_max_identity(acc), _empty([t.shape[0]], acc))

    def body(args):
        if isinstance(elem, ir.FloatType):
            value = arith.extf(acc, args[0]) if narrow else args[0]
            return [arith.maximumf(value, args[1])]
        return [arith.maxsi(args[0], args[1])]

    reduced = build_generic([lanes], [init], [_map(2, [0, 1]), _map(2, [0])],
                            ["parallel", "reduction"], body).result
    if not narrow:
        return reduced
    return build_generic([reduced], [_empty([t.shape[0]], elem)], [_map(1, [0])] * 2,
                         ["parallel"], lambda args: [arith.truncf(elem, args[0])]).result


# ------------------------------------------------------------------------------ analysis

@dataclass
class LossGraph:
    """The top-level ops of the restructured loss, by where they will run."""

    func: ir.Operation
    logits: ir.Value
    rows: int
    classes: int
    host: list                 # result-less generics asserting on the targets
    row_ops: list              # ops over the rows (block order): the row kernel
    before: list               # rank-0 ops the row kernel reads
    after: list                # rank-0 ops reading the row kernel's results
    gradient: ir.Operation | None


def analyze(payload: ir.Module) -> LossGraph:
    """Restructure (the family's steps 1-2) and sort the ops by kernel; NotLowerable when the
    payload is not a cross-entropy this lowering takes."""
    from . import cross_entropy as ce

    try:
        ce.normalize(payload)
        ce.restructure(payload)
        found = ce.find_cross_entropy(payload)
    except ce.NotCrossEntropy as exc:
        raise NotLowerable(f"cross-entropy: {exc}") from exc
    func = _func(payload)
    block = func.regions[0].blocks[0]
    row_max = found.row_max
    x = ce._logits(func)
    if x.type.rank != 2 or found.class_dim != 1 or loop_structure(row_max).num_loops != 2:
        raise NotLowerable(f"cross-entropy over logits {x.type}: the GPU lowering takes [N, C] "
                           "logits with the classes last (fold other dims into the rows first)")
    if not isinstance(x.type.element_type, ir.FloatType) or x.type.element_type.width not in (16, 32):
        raise NotLowerable(f"cross-entropy over {x.type.element_type} logits: f32, f16 or bf16 only")
    rows, classes = x.type.shape
    fn_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    for t in fn_type.results:
        if isinstance(t, ir.RankedTensorType) and t.rank not in (0, 2):
            raise NotLowerable(f"cross-entropy with a {t} result (reduction='none'): per-row "
                               "losses have no GPU store form yet (XeGPU has no lane layout for "
                               "a [rows] vector); use reduction='mean' or 'sum'")
    for op in [row_max] + found.class_sums:
        op.attributes[CLASS_REDUCTION] = ir.UnitAttr.get()
    if found.gradient is not None:
        found.gradient.attributes[GRADIENT] = ir.UnitAttr.get()
    host, scalar, row_ops = [], [], []
    for op in block_ops(block):
        if op.name in ("func.return", "arith.constant", "tensor.empty"):
            continue
        if not is_linalg_op(op):
            raise NotLowerable(f"cross-entropy: {op.name} at {op.location} has no GPU kernel here")
        if not len(op.results):
            if not _has_assert(op):
                raise NotLowerable(f"cross-entropy: a result-less {op.name} at {op.location}")
            host.append(op)
        elif all(_rank(r) == 0 for r in op.results):
            scalar.append(op)
        else:
            row_ops.append(op)
    for op in row_ops:
        _check_row_op(op, rows)
    before = _needed_by(row_ops, scalar)
    after = [op for op in scalar if op not in before]
    return LossGraph(func, x, rows, classes, host, row_ops, before, after, found.gradient)


def _check_row_op(op: ir.Operation, rows: int) -> None:
    """Loop 0 runs over the rows: every operand with a row dim has it first, indexed by d0."""
    ls = loop_structure(op)
    if not ls.is_static or ls.ranges[0] != rows or ls.iterators[0] != "parallel":
        raise NotLowerable(f"cross-entropy: {op.name} at {op.location} does not run over the "
                           f"{rows} rows in its first loop")
    for value, amap in zip(op.operands, ls.maps):
        results = list(amap.results)
        uses_d0 = [j for j, e in enumerate(results)
                   if isinstance(e, ir.AffineDimExpr) and e.position == 0]
        if uses_d0 not in ([], [0]):
            raise NotLowerable(f"cross-entropy: {op.name} at {op.location} reads rows in a "
                               "dim other than the first")


def _needed_by(row_ops: list, scalar: list) -> list:
    """The rank-0 ops the row ops read (transitively), in `scalar`'s order."""
    needed = []
    pending = list(row_ops)
    while pending:
        op = pending.pop()
        for v in op.operands:
            p = defining_op(v)
            if p is not None and p in scalar and p not in needed:
                needed.append(p)
                pending.append(p)
    return [op for op in scalar if op in needed]


# --------------------------------------------------------------------------- rewrites

def _only_arguments(op: ir.Operation, block: ir.Block, gathers: bool = False) -> bool:
    """Is `op` an elementwise function of the function arguments (through such ops)? With
    `gathers`, its body may also read function arguments at computed indices (w[y_i])."""
    if op.name != "linalg.generic" or _has_assert(op) or "reduction" in iterator_kinds(op):
        return False
    for inner in block_ops(body_of(op)):
        if inner.name == "tensor.extract" and not (gathers and _is_arg(inner.operands[0], block)):
            return False
    for v in op.opview.inputs:
        p = defining_op(v)
        if _is_arg(v, block) or (p is not None and p.name == "arith.constant"):
            continue
        if p is None or p.parent != op.parent or not _only_arguments(p, block, gathers):
            return False
    return True


def inline_argument_producers(graph: LossGraph, consumers: list, gathers: bool = False) -> list:
    """Per-row elementwise ops computed from the function arguments only (the valid flag
    and the clamped target from y; with `gathers` also the target's weight w[y_i]) are
    inlined into `consumers` (the host check, the reductions over the rows): they then
    read y (and w) themselves. Returns the rewritten consumers."""
    from transform_ext.inline_elementwise_producers import inline_in_blocks

    block = graph.func.regions[0].blocks[0]
    marker = "lh.ce_consumer"
    for op in consumers:
        op.attributes[marker] = ir.UnitAttr.get()
    inline_in_blocks([block], consumer=lambda op: marker in op.attributes,
                     producer=lambda op: _only_arguments(op, block, gathers))
    out = [op for op in block_ops(block) if marker in op.attributes]
    for op in out:
        del op.attributes[marker]
    return out


def _lane_guarded_body(op: ir.Operation, lane0: ir.Value, mapping: dict) -> list:
    """Clone a rank-0 reduction's body so that only lane 0 contributes:
    combine(acc, t) -> combine(acc, lane0 ? t : neutral). The combiner is found as
    classify.reduction_combiner finds it (through casts)."""
    from transform_ext.analysis.body import producer_in, strip_casts
    from transform_ext.analysis.classify import _CASTS

    src = body_of(op)
    acc = src.arguments[len(src.arguments) - 1]
    y = strip_casts(src, terminator(src).operands[0], _CASTS)
    combine = producer_in(src, y)
    sides = [strip_casts(src, v, _CASTS) for v in combine.operands]
    other = 1 - [i for i, v in enumerate(sides) if v == acc][0]
    for inner in block_ops(src)[:-1]:
        clone = clone_op(inner, mapping)
        if inner == combine:
            t = clone.operands[other]
            with ir.InsertionPoint(clone), clone.location:
                neutral = arith.ConstantOp(t.type, _neutral(combine.name, t.type)).result
                guarded = arith.select(lane0, t, neutral)
            clone.operands[other] = guarded
    return [mapping.get(v, v) for v in terminator(src).operands]


def _neutral(name: str, t: ir.Type) -> ir.Attribute:
    if name == "arith.addf":
        return ir.FloatAttr.get(t, -0.0)          # x + -0.0 == x, also for x = -0.0
    if name in ("arith.addi", "arith.ori", "arith.xori"):
        return ir.IntegerAttr.get(t, 0)
    if name == "arith.mulf":
        return ir.FloatAttr.get(t, 1.0)
    if name == "arith.muli":
        return ir.IntegerAttr.get(t, 1)
    if name == "arith.andi":
        return ir.IntegerAttr.get(t, -1)
    if name in ("arith.maximumf", "arith.maxnumf"):
        return ir.FloatAttr.get(t, float("-inf"))
    if name in ("arith.minimumf", "arith.minnumf"):
        return ir.FloatAttr.get(t, float("inf"))
    if name == "arith.maxsi":
        return ir.IntegerAttr.get(t, -(1 << (t.width - 1)))
    if name == "arith.minsi":
        return ir.IntegerAttr.get(t, (1 << (t.width - 1)) - 1)
    raise NotLowerable(f"cross-entropy: no neutral element for {name}")


def lane_form_row_reduction(op: ir.Operation, graph: LossGraph, lane_inputs: dict) -> ir.Operation:
    """A reduction of [N] per-row values to rank 0 as a reduction over [N, LANES] that counts
    lane 0 only. Inputs: a function argument [N] is read in the body (`tensor.extract` at
    the row: a gather per row), a per-row result of the row kernel from its lane-form
    [N, LANES] f32 copy (`lane_inputs`, narrowed back exactly), rank-0 values as they are."""
    block = graph.func.regions[0].blocks[0]
    view = op.opview
    if reduction_combiner(op) is None:
        raise NotLowerable(f"cross-entropy: {op.name} at {op.location} reduces the rows with "
                           "an unknown combiner")
    ls = loop_structure(op)
    if ls.num_loops != 1:
        raise NotLowerable(f"cross-entropy: {op.name} at {op.location}: a rank-0 result of "
                           f"{ls.num_loops} loops")
    inputs, maps, kinds = [], [], []       # kinds: ("arg", value) | ("lanes", narrow) | ("scalar",)
    for v in view.inputs:
        if _rank(v) == 0:
            inputs.append(v)
            maps.append(ir.AffineMap.get(2, 0, []))
            kinds.append(("scalar",))
        elif _is_arg(v, block):
            kinds.append(("arg", v))
        elif v in lane_inputs:
            inputs.append(lane_inputs[v])
            maps.append(_map(2, [0, 1]))
            kinds.append(("lanes", ir.RankedTensorType(v.type).element_type))
        else:
            raise NotLowerable(f"cross-entropy: {op.name} at {op.location} reads a per-row value "
                               "no kernel writes")
    if not any(kind[0] == "lanes" for kind in kinds):
        # nothing read in lane form bounds the loops: an unread [N, LANES] witness does
        with ir.InsertionPoint(op), op.location:
            inputs.append(_empty([graph.rows, LANES], ir.IntegerType.get_signless(8)))
        maps.append(_map(2, [0, 1]))
        kinds.append(("witness",))
    outputs = list(view.outputs)
    maps.append(ir.AffineMap.get(2, 0, []))
    src = body_of(op)
    n_in = len(view.inputs)

    def body(args):
        row = linalg.IndexOp(0).result
        lane = linalg.IndexOp(1).result
        lane0 = arith.cmpi(arith.CmpIPredicate.eq, lane, _index(0))
        mapping, pos = {}, 0
        for i, kind in enumerate(kinds):
            if kind[0] == "arg":
                mapping[src.arguments[i]] = tensor.extract(kind[1], [row])
                continue
            value = args[pos]
            pos += 1
            if kind[0] == "witness":
                continue
            if kind[0] == "lanes" and value.type != kind[1]:
                value = arith.truncf(kind[1], value)
            mapping[src.arguments[i]] = value
        mapping[src.arguments[n_in]] = args[pos]
        return _lane_guarded_body(op, lane0, mapping)

    with ir.InsertionPoint(op), op.location:
        new = build_generic(inputs, outputs, maps, ["reduction", "reduction"], body)
    op.results[0].replace_all_uses_with(new.results[0])
    op.erase()
    return new.operation


def lane_form_gather(op: ir.Operation) -> ir.Operation:
    """A per-row generic whose body gathers (tensor.extract at a per-row index) runs over
    [N, LANES] (every lane of a row computes the row's value: a scattered load per lane),
    then reduces by max over the identical lanes back to [N] (exact)."""
    view = op.opview
    ls = loop_structure(op)
    if ls.num_loops != 1 or len(op.results) != 1:
        raise NotLowerable(f"cross-entropy: a gather {op.name} at {op.location} over "
                           f"{ls.num_loops} loops")
    out_t = ir.RankedTensorType(op.results[0].type)
    inputs = list(view.inputs)
    maps = []
    for m in list(view.indexing_maps)[:len(inputs)]:
        dims = [e.position for e in m.value.results]
        maps.append(_map(2, dims))
    src = body_of(op)
    with ir.InsertionPoint(op), op.location:
        lanes_out = _empty([out_t.shape[0], LANES], out_t.element_type)

        def body(args):
            mapping = {src.arguments[i]: args[i] for i in range(len(inputs) + 1)}
            for inner in block_ops(src)[:-1]:
                clone = clone_op(inner, mapping)
                if clone.name == "tensor.extract":
                    _clamp_indices(clone)
            return [mapping.get(v, v) for v in terminator(src).operands]

        lanes = build_generic(inputs, [lanes_out], maps + [_map(2, [0, 1])],
                              ["parallel", "parallel"], body).result
        defining_op(lanes).attributes[LANE_FORM] = ir.UnitAttr.get()
        reduced = _max_over_lanes(lanes)
    op.results[0].replace_all_uses_with(reduced)
    op.erase()
    return defining_op(lanes)


def hoist_row_gathers(op: ir.Operation) -> ir.Operation:
    """In an op over [rows, classes], a gather whose indices depend on the row only (the
    target's weight w[y_i] in the gradient) becomes a per-row generic computing it, read by
    the op through (d0, d1) -> (d0): one gather per row instead of one per element, and a
    per-row generic the lane form applies to. Returns the rewritten op."""
    while True:
        view = op.opview
        block = body_of(op)
        n_in = len(view.inputs)
        maps = [m.value for m in view.indexing_maps]
        row_args = {i for i in range(n_in)
                    if all(isinstance(e, ir.AffineDimExpr) and e.position == 0
                           for e in maps[i].results)}
        extracts = [o for o in block_ops(block) if o.name == "tensor.extract"]
        if not extracts:
            return op
        extract = extracts[0]
        ordered = _row_slice(block, list(extract.operands)[1:], row_args, op)
        used = sorted({v.arg_number for o in ordered + [extract] for v in o.operands
                       if isinstance(v, ir.BlockArgument) and v.owner == block})
        rows = ir.RankedTensorType(op.results[0].type).shape[0]
        elem = extract.results[0].type
        with ir.InsertionPoint(op), op.location:
            inputs = [view.inputs[i] for i in used]
            in_maps = [_map(1, [0] if maps[i].results else []) for i in used]

            def body(args):
                mapping = {block.arguments[i]: a for i, a in zip(used, args)}
                for inner in ordered + [extract]:
                    clone_op(inner, mapping)
                return [mapping[extract.results[0]]]

            gathered = build_generic(inputs, [_empty([rows], elem)], in_maps + [_map(1, [0])],
                                     ["parallel"], body).result
        new = append_input(op, gathered, _map(2, [0]))
        nblock = body_of(new)
        first = next(o for o in block_ops(nblock) if o.name == "tensor.extract")
        first.results[0].replace_all_uses_with(nblock.arguments[n_in])
        first.erase()
        op = new


def _row_slice(block: ir.Block, values: list, row_args: set, op: ir.Operation) -> list:
    """The body ops computing `values` (block order), when they depend only on per-row
    inputs, `linalg.index 0` and values from outside the body; else NotLowerable."""
    needed, pending = [], list(values)
    while pending:
        v = pending.pop()
        if isinstance(v, ir.BlockArgument):
            if v.owner == block and v.arg_number not in row_args:
                raise NotLowerable(f"cross-entropy: {op.name} at {op.location} gathers at an "
                                   "index that varies along the classes")
            continue
        owner = defining_op(v)
        if owner is None or owner.parent != op or owner in needed:
            continue
        if owner.name == "linalg.index" and ir.IntegerAttr(owner.attributes["dim"]).value != 0:
            raise NotLowerable(f"cross-entropy: {op.name} at {op.location} gathers at an index "
                               "that varies along the classes")
        needed.append(owner)
        pending.extend(owner.operands)
    return [o for o in block_ops(block) if o in needed]


def _clamp_indices(extract: ir.Operation) -> None:
    """Indices computed from data (a target) clamped into the tensor: memory safety only.
    The targets of counted rows were checked on the host before any launch; an ignored
    row's index is read and its value dropped by the payload's own select."""
    source = ir.RankedTensorType(extract.operands[0].type)
    for j in range(source.rank):
        v = extract.operands[1 + j]
        owner = defining_op(v)
        if owner is not None and owner.name == "linalg.index":
            continue
        with ir.InsertionPoint(extract), extract.location:
            low = arith.maxsi(v, _index(0))
            extract.operands[1 + j] = arith.minsi(low, _index(source.shape[j] - 1))


def load_rows_in_lane_form(graph: LossGraph, value: ir.Value, readers: list) -> None:
    """`readers` (row-kernel ops) read the per-row function argument `value` [N] through a
    lane-form gather reduced over the lanes (y_i, held by every lane of row i)."""
    t = ir.RankedTensorType(value.type)
    block = graph.func.regions[0].blocks[0]
    first = next(op for op in block_ops(block) if op in readers)
    with ir.InsertionPoint(first), first.location:
        out = _empty([t.shape[0], LANES], t.element_type)

        def body(args):
            row = linalg.IndexOp(0).result
            return [tensor.extract(value, [row])]

        lanes = build_generic([], [out], [_map(2, [0, 1])], ["parallel", "parallel"], body).result
        defining_op(lanes).attributes[LANE_FORM] = ir.UnitAttr.get()
        rows = _max_over_lanes(lanes)
    for op in readers:
        for i, v in enumerate(op.operands):
            if v == value:
                op.operands[i] = rows


def lane_copy(value: ir.Value) -> ir.Value:
    """A per-row result [N] (float) as a lane-form [N, LANES] f32 tile (widened exactly)."""
    t = ir.RankedTensorType(value.type)
    elem = t.element_type
    if not isinstance(elem, ir.FloatType) or elem.width > 32:
        raise NotLowerable(f"cross-entropy: a per-row {elem} result crosses kernels (floats "
                           "up to 32 bits only)")
    owner = defining_op(value)
    f32 = ir.F32Type.get()
    with ir.InsertionPoint.after(owner), owner.location:
        out = _empty([t.shape[0], LANES], f32)

        def body(args):
            return [args[0] if elem == f32 else arith.extf(f32, args[0])]

        return build_generic([value], [out], [_map(2, [0]), _map(2, [0, 1])],
                             ["parallel", "parallel"], body).result


# ---------------------------------------------------------------------------- outlining

DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


def _slice_rows(value: ir.Value, r0: ir.Value, rows: int) -> ir.Value:
    t = ir.RankedTensorType(value.type)
    shape = [rows] + list(t.shape[1:])
    owner = defining_op(value)
    if owner is not None and owner.name == "tensor.empty":
        return _empty(shape, t.element_type)
    result = ir.RankedTensorType.get(shape, t.element_type)
    return tensor.ExtractSliceOp(result, value, [r0], [], [], [DYNAMIC] + [0] * (t.rank - 1),
                                 shape, [1] * t.rank).result


def outline(func: ir.Operation, ops: list, outputs: list, *, rows: int | None, total_rows: int,
            kind: str) -> ir.Operation:
    """Move `ops` (block order) into a new scf.forall before the return; it yields
    `outputs` (results of `ops`), whose other uses read the forall's results. rows: rows per
    iteration (every operand indexed by loop 0 is sliced, linalg.index 0 offset), else one
    iteration running the ops as they are."""
    from .xegpu_contraction import block_mapping

    block = func.regions[0].blocks[0]
    ret = terminator(block)
    grid = total_rows // rows if rows else 1
    loc = ops[0].location
    with ir.InsertionPoint(ret), loc:
        inits = [_empty(list(v.type.shape), v.type.element_type) for v in outputs]
        forall = scf.ForallOp([0], [grid], [1], shared_outs=inits, mapping=block_mapping(1))
        forall.attributes[KERNEL_ATTR] = ir.StringAttr.get(kind)
        iv = forall.body.arguments[0]
        shared = list(forall.body.arguments)[1:]
        mapping = {}
        with ir.InsertionPoint(forall.body):
            r0 = arith.muli(iv, _index(rows)) if rows else None
            scalars = {}
            for op in ops:
                _clone_into(op, mapping, r0, rows)
                _read_scalars(mapping[op.results[0]], scalars)
            parallel = scf.InParallelOp()
        with ir.InsertionPoint(parallel.region.blocks[0]):
            for v, dest in zip(outputs, shared):
                t = ir.RankedTensorType(v.type)
                if rows:
                    sizes = [rows] + list(t.shape[1:])
                    tensor.ParallelInsertSliceOp(mapping[v], dest, [r0], [], [],
                                                 [DYNAMIC] + [0] * (t.rank - 1), sizes, [1] * t.rank)
                else:
                    tensor.ParallelInsertSliceOp(mapping[v], dest, [], [], [], [0] * t.rank,
                                                 list(t.shape), [1] * t.rank)
    for v, r in zip(outputs, forall.results):
        v.replace_all_uses_with(r)
    for op in reversed(ops):
        if any(list(r.uses) for r in op.results):
            raise NotLowerable(f"cross-entropy: {op.name} at {op.location} is read outside its "
                               "kernel")
        op.erase()
    return forall.operation


def _read_scalars(result: ir.Value, scalars: dict) -> None:
    """A rank-0 input of a cloned generic that comes from outside the kernel (the count
    written by an earlier kernel) is read once as a scalar (`tensor.extract`) and used in
    the body as a captured value: one scalar load per workgroup, no 0-d vectors (which
    have no lane layout)."""
    op = defining_op(result)
    if op.name != "linalg.generic":
        return
    view = op.opview
    block = body_of(op)
    for i, v in enumerate(view.inputs):
        if _rank(v) != 0 or (defining_op(v) is not None and defining_op(v).parent == op.parent):
            continue
        if v not in scalars:
            with ir.InsertionPoint.at_block_begin(op.parent.regions[0].blocks[0]), op.location:
                scalars[v] = tensor.extract(v, [])
        block.arguments[i].replace_all_uses_with(scalars[v])


def _clone_into(op: ir.Operation, mapping: dict, r0, rows) -> None:
    ls = loop_structure(op) if op.name != "linalg.fill" else None
    n_operands = len(op.operands)
    maps = ls.maps if ls is not None else None
    operands = []
    for k in range(n_operands):
        v = op.operands[k]
        if v in mapping:
            operands.append(mapping[v])
            continue
        if rows is None or not isinstance(v.type, ir.RankedTensorType) or v.type.rank == 0:
            operands.append(v)
            continue
        if op.name == "linalg.fill":
            sliced = True
        else:
            results = list(maps[k].results)
            sliced = bool(results) and isinstance(results[0], ir.AffineDimExpr) and \
                results[0].position == 0
        operands.append(_slice_rows(v, r0, rows) if sliced else v)
    clone = op.clone()
    for k, v in enumerate(operands):
        clone.operands[k] = v
    n_out = len(op.results)
    outs = list(clone.operands)[n_operands - n_out:]
    for r, o in zip(clone.results, outs):
        r.set_type(o.type)
    for old, new in zip(op.results, clone.results):
        mapping[old] = new
    if rows is not None and op.name == "linalg.generic":
        for inner in block_ops(body_of(clone)):
            if inner.name == "linalg.index" and ir.IntegerAttr(inner.attributes["dim"]).value == 0:
                with ir.InsertionPoint.after(inner), inner.location:
                    shifted = arith.addi(inner.results[0], r0)
                for use in list(inner.results[0].uses):
                    user = getattr(use.owner, "operation", use.owner)
                    if user != defining_op(shifted):
                        user.operands[use.operand_number] = shifted


# ------------------------------------------------------------------------------ driver

GROUP = "lh.ce_group"


def _set_group(op: ir.Operation, group: str) -> None:
    op.attributes[GROUP] = ir.StringAttr.get(group)


def _group(op: ir.Operation) -> str | None:
    return ir.StringAttr(op.attributes[GROUP]).value if GROUP in op.attributes else None


def _grouped(block: ir.Block, group: str) -> list:
    return [op for op in block_ops(block) if _group(op) == group]


def _tag_new_ops(block: ir.Block, group: str) -> None:
    """Linalg ops created by a rewrite (no group yet) belong to `group`."""
    for op in block_ops(block):
        if is_linalg_op(op) and GROUP not in op.attributes:
            _set_group(op, group)


def lower_loss(payload: ir.Module, *, subgroup_size: int = 16, max_threads: int = 1024,
               min_workgroups: int = 1, rows: int | None = None,
               column_tile: int | None = None, row_tile: int | None = None) -> list[LossKernel]:
    """The workgroups stage of a cross-entropy loss (module docstring): returns the kernels
    in launch order; the host check stays in the function. NotLowerable names what does not
    fit."""
    if subgroup_size != LANES:
        raise NotLowerable(f"cross-entropy: per-row tiles assume subgroups of {LANES} lanes, "
                           f"not {subgroup_size}")
    graph = analyze(payload)
    block = graph.func.regions[0].blocks[0]
    for name, ops in (("host", graph.host), ("before", graph.before), ("rows", graph.row_ops),
                      ("after", graph.after)):
        for op in ops:
            _set_group(op, name)
    tiles = plan_rows(graph, subgroup_size=subgroup_size, max_threads=max_threads,
                      min_workgroups=min_workgroups, rows=rows, column_tile=column_tile)
    sums = plan_row_sums(graph, subgroup_size=subgroup_size, row_tile=row_tile)
    with graph.func.context, graph.func.location:
        _prepare_host_check(graph)
        _prepare_row_sums(graph)
        _prepare_row_kernel(graph)
    kernels = []
    with graph.func.context, graph.func.location:
        for group, kind in (("before", "row_sum_before"), ("rows", "cross_entropy"),
                            ("after", "row_sum_after")):
            ops = _grouped(block, group)
            if not ops:
                continue
            outputs = [r for op in ops for r in op.results
                       if any(_group(u) != group for u in _users(r))]
            if not outputs:
                raise NotLowerable(f"cross-entropy: the {kind} kernel computes nothing used")
            where = _describe(kind, graph)
            outline(graph.func, ops, outputs, rows=tiles.rows if group == "rows" else None,
                    total_rows=graph.rows, kind=kind)
            kernels.append(LossKernel(kind if group == "rows" else "row_sum", where,
                                      tiles if group == "rows" else sums))
    clear_tags(payload, GROUP)
    run_passes(payload, "canonicalize, cse")
    _class_loops(payload, tiles.column_tile)
    for kind in ("row_sum_before", "row_sum_after"):
        _row_sum_loops(payload, kind, sums.row_tile)
    for attr in (CLASS_REDUCTION, GRADIENT, LANE_FORM, KERNEL_ATTR):
        clear_tags(payload, attr)
    run_passes(payload, "canonicalize, cse")
    return kernels


def _describe(kind: str, graph: LossGraph) -> str:
    x = ir.RankedTensorType(graph.logits.type)
    what = f"cross-entropy over [{graph.rows}, {graph.classes}] {x.element_type} logits"
    if kind == "cross_entropy":
        grad = ", d logits" if graph.gradient is not None else ""
        return f"{what}: online max / sum over column tiles, target gather, row losses{grad}"
    if kind == "row_sum_before":
        return f"{what}: reductions over the rows the row kernel reads (the count)"
    return f"{what}: reductions over the rows of the row losses, the mean"


def _kernel_forall(payload: ir.Module, kind: str) -> ir.Operation | None:
    func = _func(payload)
    return next((op for op in block_ops(func.regions[0].blocks[0])
                 if op.name == "scf.forall" and KERNEL_ATTR in op.attributes
                 and ir.StringAttr(op.attributes[KERNEL_ATTR]).value == kind), None)


def _prepare_host_check(graph: LossGraph) -> None:
    """The target check reads y only (its producers inlined); its assertions say what is
    wrong in the user's terms (cross_entropy.name_target_checks)."""
    from transform_ext.nested import apply_to

    from .cross_entropy import name_target_checks

    block = graph.func.regions[0].blocks[0]
    inline_argument_producers(graph, _grouped(block, "host"))
    for op in _grouped(block, "host"):
        if not all(_is_arg(v, block) for v in op.opview.inputs):
            raise NotLowerable(f"cross-entropy: the target check at {op.location} reads values "
                               "computed on the device")
    apply_to(graph.func, name_target_checks(graph.classes))


def _regroup_scalars(block: ir.Block) -> None:
    """Rank-0 ops the row kernel reads (transitively) run before it, the others after. A
    fill read by several kernels (a shared zero init) is cloned into each of them."""
    scalar = [op for op in block_ops(block) if _group(op) in ("before", "after")]
    before = _needed_by(_grouped(block, "rows"), scalar)
    for op in scalar:
        _set_group(op, "before" if op in before else "after")
    for fill in [op for op in block_ops(block) if op.name == "linalg.fill" and _group(op)]:
        own = _group(fill)
        for use in list(fill.results[0].uses):
            user = getattr(use.owner, "operation", use.owner)
            group = _group(user)
            if group is None or group == own:
                continue
            with ir.InsertionPoint.after(fill), fill.location:
                clone = fill.clone()
            _set_group(clone, group)
            user.operands[use.operand_number] = clone.results[0]


def _prepare_row_sums(graph: LossGraph) -> None:
    """Reductions over the rows read y itself and the row kernel's per-row results in lane
    form."""
    block = graph.func.regions[0].blocks[0]
    _regroup_scalars(block)
    reductions = [op for op in _grouped(block, "before") + _grouped(block, "after")
                  if op.name == "linalg.generic" and "reduction" in iterator_kinds(op)]
    inline_argument_producers(graph, reductions, gathers=True)
    lane_inputs = {}
    for op in _grouped(block, "before") + _grouped(block, "after"):
        if op.name != "linalg.generic" or "reduction" not in iterator_kinds(op):
            continue
        group = _group(op)
        for v in op.opview.inputs:
            p = defining_op(v)
            if p is not None and _group(p) == "rows" and v not in lane_inputs:
                if group == "before":
                    raise NotLowerable(f"cross-entropy: {op.name} at {op.location} reads a "
                                       "per-row value the row kernel has not computed yet")
                lane_inputs[v] = lane_copy(v)
                _set_group(defining_op(lane_inputs[v]), "rows")
        lane_form_row_reduction(op, graph, lane_inputs)
        _tag_new_ops(block, group)
    _tag_new_ops(block, "rows")  # the lane copies
    _regroup_scalars(block)


def _prepare_row_kernel(graph: LossGraph) -> None:
    """Per-row inputs and gathers of the row kernel in lane form."""
    block = graph.func.regions[0].blocks[0]
    row_ops = _grouped(block, "rows")
    for arg in block.arguments:
        if not isinstance(arg.type, ir.RankedTensorType) or arg == graph.logits:
            continue
        if arg.type.rank != 1 or arg.type.shape[0] != graph.rows:
            continue
        readers = [op for op in row_ops if any(v == arg for v in op.operands)]
        if readers:
            load_rows_in_lane_form(graph, arg, readers)
    _tag_new_ops(block, "rows")
    for op in _grouped(block, "rows"):
        if _has_extract(op) and LANE_FORM not in op.attributes and \
                loop_structure(op).num_loops == 2:
            hoist_row_gathers(op)
            _tag_new_ops(block, "rows")
    for op in _grouped(block, "rows"):
        if _has_extract(op) and LANE_FORM not in op.attributes:
            if loop_structure(op).num_loops != 1:
                raise NotLowerable(f"cross-entropy: {op.name} at {op.location} gathers inside "
                                   "a loop over the classes")
            lane_form_gather(op)
            _tag_new_ops(block, "rows")


# --------------------------------------------------------------------------- parameters

def plan_rows(graph: LossGraph, *, subgroup_size: int, max_threads: int, min_workgroups: int,
              rows: int | None, column_tile: int | None) -> LossRowTiles:
    """Rows per workgroup: `rows`, else the largest of 64 .. 2 dividing N that leaves
    `min_workgroups` workgroups (2 rows per subgroup). Column tile: `column_tile`, else the
    largest multiple of the subgroup size dividing C whose two f32 copies per subgroup fit
    ROW_BYTES. NotLowerable names the dimension a tile does not divide."""
    n, c = graph.rows, graph.classes
    per_subgroup = 2
    limit = (max_threads // subgroup_size) * per_subgroup
    where = f"cross-entropy over [{n}, {c}] logits"
    if n % per_subgroup:
        raise NotLowerable(f"{where}: dimension 0 ({n} rows) is not a multiple of the rows per "
                           f"subgroup ({per_subgroup})")
    if rows is None:
        fitting = [r for r in (64, 32, 16, 8, 4, 2) if n % r == 0 and r <= limit]
        rows = next((r for r in fitting if n // r >= min_workgroups), fitting[-1])
    if n % rows or rows % per_subgroup or rows > limit:
        raise NotLowerable(f"{where}: dimension 0 ({n} rows) is not a multiple of the rows per "
                           f"workgroup ({rows}), or those of {per_subgroup} per subgroup, or "
                           f"{rows} rows need more than {max_threads} threads")
    if column_tile is None:
        fitting = [t for t in range(subgroup_size, c + 1, subgroup_size)
                   if c % t == 0 and 2 * per_subgroup * t * 4 <= ROW_BYTES]
        if not fitting:
            raise NotLowerable(f"{where}: dimension 1 ({c} classes) has no column tile (a "
                               f"multiple of {subgroup_size} dividing it) that fits the registers")
        column_tile = fitting[-1]
    if c % column_tile or column_tile % subgroup_size:
        raise NotLowerable(f"{where}: dimension 1 ({c} classes) is not a multiple of the column "
                           f"tile ({column_tile}), or that of the subgroup size ({subgroup_size})")
    return LossRowTiles(rows, per_subgroup, c, column_tile, (n // rows,), subgroup_size)


def plan_row_sums(graph: LossGraph, *, subgroup_size: int, row_tile: int | None) -> RowSumTiles:
    n = graph.rows
    if row_tile is None:
        row_tile = next(t for t in (16, 8, 4, 2, 1) if n % t == 0)
    if n % row_tile:
        raise NotLowerable(f"cross-entropy: dimension 0 ({n} rows) is not a multiple of the "
                           f"row tile of the reductions over the rows ({row_tile})")
    return RowSumTiles(n, row_tile, subgroup_size)


# ------------------------------------------------------------------------- kernel loops

def _class_loops(payload: ir.Module, column_tile: int) -> None:
    """In the row kernel: the max and the class sums as one online loop over column tiles;
    the gradient (if any) swept in a second loop over column tiles, with the elementwise
    [rows, C] ops it reads computed per tile."""
    from torch_mlir.dialects import transform
    from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops

    forall = _kernel_forall(payload, "cross_entropy")
    body = forall.regions[0].blocks[0]
    group = [op for op in block_ops(body) if CLASS_REDUCTION in op.attributes]
    row_max = [op for op in group if reduction_combiner(op) == "max"]
    if len(row_max) != 1:
        raise NotLowerable("cross-entropy: the row kernel does not hold exactly one row max")
    consumers = [op for op in group if op is not row_max[0]]
    tag_ops(row_max + consumers)

    def fuse(root):
        handles = [match_id(root, 1 + i) for i in range(len(consumers))]
        cons = handles[0] if len(handles) == 1 else transform.merge_handles(handles)
        fuse_dependent_reduction_ops(match_id(root, 0), cons, column_tile, allow_remainder=False)

    run_schedule(payload, fuse)
    clear_tags(payload)
    run_passes(payload, "canonicalize, cse")
    body = _kernel_forall(payload, "cross_entropy").regions[0].blocks[0]
    gradients = [op for op in block_ops(body) if GRADIENT in op.attributes]
    if not gradients:
        return
    gradient = gradients[0]
    ranges = loop_structure(gradient).ranges
    chain, pending = [], [gradient]
    while pending:
        for v in pending.pop().operands:
            p = defining_op(v)
            if (p is not None and p.parent == gradient.parent and is_linalg_op(p)
                    and p.name != "linalg.fill" and p not in chain
                    and loop_structure(p).is_elementwise and loop_structure(p).ranges == ranges):
                chain.append(p)
                pending.append(p)
    chain.sort(key=lambda op: block_ops(body).index(op), reverse=True)
    tag_ops([gradient] + chain)

    def sweep(root):
        loop = structured.TileUsingForOp(match_id(root, 0), sizes=[0, column_tile]).results[1]
        for i in range(len(chain)):
            loop = structured.FuseIntoContainingOp(match_id(root, 1 + i), loop).new_containing_op

    run_schedule(payload, sweep)
    clear_tags(payload)


def _row_sum_loops(payload: ir.Module, kind: str, row_tile: int) -> None:
    """In a reduction kernel: each lane-form reduction over [N, LANES] as a loop over row
    tiles accumulating [row_tile, LANES] partial results, combined once at the end."""
    from torch_mlir.dialects import transform

    forall = _kernel_forall(payload, kind)
    if forall is None:
        return
    body = forall.regions[0].blocks[0]
    reductions = [op for op in block_ops(body) if op.name == "linalg.generic"
                  and iterator_kinds(op) == ["reduction", "reduction"]]
    if not reductions:
        return
    tag_ops(reductions)

    def tile(root):
        any_op = transform.AnyOpType.get()
        for i in range(len(reductions)):
            structured.TileReductionUsingForOp([any_op], any_op, any_op, any_op, match_id(root, i),
                                               tile_sizes=[row_tile, LANES])

    run_schedule(payload, tile)
    clear_tags(payload)


# ------------------------------------------------------------------ later stage hooks

def finish_bufferized(payload: ir.Module) -> None:
    """After bufferization: the target check reads a host copy of y (module docstring), a
    rank-0 result is written by a scalar store (all lanes store the same value)."""
    from torch_mlir.dialects import gpu, memref, vector

    func = _func(payload)
    block = func.regions[0].blocks[0]
    checks = [op for op in block_ops(block) if op.name == "linalg.generic" and _has_assert(op)]
    first_kernel = next((op for op in block_ops(block) if op.name == "scf.forall"), None)
    with payload.context:
        copies = {}
        for op in checks:
            with ir.InsertionPoint(op), op.location:
                for i, v in enumerate(list(op.opview.inputs)):
                    if v not in copies:
                        host = memref.AllocOp(ir.MemRefType(v.type), [], []).result
                        gpu.MemcpyOp(None, [], host, v)
                        copies[v] = host
                    op.operands[i] = copies[v]
            if first_kernel is not None and not op.is_before_in_block(first_kernel):
                op.move_before(first_kernel)
        ret = terminator(block)
        for host in copies.values():
            with ir.InsertionPoint(ret), ret.location:
                memref.DeallocOp(host)
        for write in ops_named(func, "vector.transfer_write"):
            if ir.VectorType(write.operands[0].type).rank != 0:
                continue
            with ir.InsertionPoint(write), write.location:
                scalar = vector.ExtractOp(write.operands[0], [], []).result
                memref.StoreOp(scalar, write.operands[1], [])
            write.erase()
    if checks:
        from torch_mlir.dialects import transform

        tag_ops(checks)

        def to_loops(root):
            for i in range(len(checks)):
                structured.ConvertToLoopsOp(transform.AnyOpType.get(), match_id(root, i))

        run_schedule(payload, to_loops)
        clear_tags(payload)


def kernel_anchors(gpu_func: ir.Operation, tiles, start: int) -> list[tuple[int, dict]]:
    """Tag (lh.id from `start`) the tile loads/stores and the scattered loads of one outlined
    loss kernel after convert-vector-to-xegpu; returns (id, anchor layout) pairs. Row kernel:
    [rows, w] tiles split over the subgroups by rows (`rows_per_subgroup` each), 2-D block
    instructions [rows_per_subgroup, 16]; the lane-form gathers one row per instruction.
    Reduction kernels: one subgroup holding [row_tile, 16]."""
    anchors = []
    ops = []
    for name in ("xegpu.load_nd", "xegpu.store_nd", "xegpu.load"):
        ops += ops_named(gpu_func, name)
    for op in ops:
        value = op.results[0] if op.name != "xegpu.store_nd" else op.operands[0]
        shape = list(ir.VectorType(value.type).shape)
        if len(shape) == 1 and isinstance(tiles, LossRowTiles) and op.name == "xegpu.load":
            # a class vector (weights w_c) broadcast over the rows: the tile layout, sliced
            anchors.append(dict(sg_layout=tiles.sg_layout, sg_data=[tiles.rows_per_subgroup,
                                shape[0]], inst_data=[tiles.rows_per_subgroup,
                                tiles.subgroup_size], slice_dims=[0]))
            continue
        if len(shape) != 2:
            raise ValueError(f"{op.location}: a {len(shape)}-D {op.name} has no layout in a "
                             "cross-entropy kernel")
        rows, width = shape
        if isinstance(tiles, LossRowTiles):
            sg_layout, sg_data = tiles.sg_layout, [tiles.rows_per_subgroup, width]
            inst = [1 if op.name == "xegpu.load" else tiles.rows_per_subgroup, tiles.subgroup_size]
        else:
            sg_layout, sg_data = [1, 1], [rows, width]
            inst = [1 if op.name == "xegpu.load" else min(rows, 8), tiles.subgroup_size]
        anchors.append(dict(sg_layout=list(sg_layout), sg_data=list(sg_data), inst_data=inst))
    tag_ops(ops, start=start)
    return list(zip(range(start, start + len(ops)), anchors))


def prefetch_shape(tiles) -> tuple[int, tuple[int, int]]:
    """(subgroups, instruction tile) the loop prefetches of a loss kernel are spread over."""
    if isinstance(tiles, LossRowTiles):
        return tiles.subgroups, (tiles.rows_per_subgroup, tiles.subgroup_size)
    return 1, (min(tiles.row_tile, 8), tiles.subgroup_size)


def annotate_loss_kernel(gpu_func: ir.Value, anchors: list[tuple[int, dict]]) -> None:
    """Transform IR: the anchor layouts of `kernel_anchors` (gpu_func a handle)."""
    from torch_mlir.dialects.transform import xegpu

    for i, layout in anchors:
        xegpu.set_anchor_layout(match_id(gpu_func, i), **layout)
    canonicalize(gpu_func)
