"""fuse_dependent_reduction_ops: reductions over one axis, some reading an earlier one's
result, become ONE loop over tiles of that axis with running accumulators.

R1 reduces x over axis k with max (or min); m is its running value. A dependent consumer R2
is an additive reduction over k (a sum, or a contraction such as P @ V) of an elementwise
chain E(x, m) that reads m broadcast along k. When E is separable,
E(x, m) = A(x) * exp(beta * m) (proved from the bodies, transform_ext/analysis/separability),
a tile that moves m from m_old to m_new rescales what R2 accumulated so far:

    acc_new = acc_old * c + sum_{j in tile} E(x_j, m_new) [* v_j],
    c = 0 if m_old is R1's identity (-inf for max) else exp(beta * (m_new - m_old))

c is emitted in that stable form (never exp(-m_new) / exp(-m_old), which overflows for
|m| > 88 in f32); it needs no fast-math flag. Inside the loop E reads m_safe = (m_new is the
identity) ? 0 : m_new, so a tile whose running max is still -inf contributes exp(-inf) = 0
and exp(-inf - (-inf)) is never a live value. Sibling consumers (reductions over k that do
not read m: the masked-row AND, a target gather, a plain sum) join the loop unchanged.

Operands: `reduction` (R1, one payload op), `consumers` (the R2s and siblings: every payload
op is fused), `producers` (optional: ops producing data inputs, e.g. S = Q K^T, to compute
per tile instead of materializing them), `tile_size`. Elementwise ops between group members
join the loop too. The loop carries only the accumulators; with `yield_producers`, a producer
whose result is also read outside the group (the logits S^T a fused backward reads again) is
carried too: each tile it computes is inserted into its full value (started from its init,
or from a fill's destination: every tile overwrites its part), and those readers read the
loop's result, so it is computed once. Without it such a producer stays whole before the
loop for them. When tile_size does not divide the
axis extent, the remainder tile runs once after the loop with its own static shape (or the
op fails, when `allow_remainder` is false). The result is the new scf.for.

Legality (checked before any rewrite; a silenceable failure names the op and the reason):
one block; static extents; R1 a max/min reduction with one reduction dim and one result;
each consumer has one reduction dim mapped onto the same tensor axis as R1's; index maps of
the axis are plain dims; a dependent R2's combiner is `acc + t` with t separable and its init
a zero fill; beta < 0 for max (> 0 for min: otherwise the rescaling would amplify);
m reaches consumers only through elementwise ops of the group; no group op reads a
consumer's result (inside the loop it is a partial sum: sum_c g_c e_c / l, the softmax
backward, must divide by the final l after the loop).
Mixed precision: the correction is computed in f32; f16/bf16 accumulators are rescaled in
f32 and rounded once per tile (accumulate in f32 by giving the reduction an f32 init).
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, scf, tensor, transform
from torch_mlir.dialects import math as mmath

from .analysis.dims import DimClasses
from .analysis.separability import Form, FormAnalysis, NotSeparable
from .analysis.structure import dim_positions, loop_structure
from .common import Illegal, ReplacesTargets, Success, defining_op, fail, is_linalg, payload_ops
from .dialect import TransformExt

_MAX = ("arith.maximumf", "arith.maxnumf")
_MIN = ("arith.minimumf", "arith.minnumf")
DYNAMIC = ir.ShapedType.get_dynamic_stride_or_offset()


# ----------------------------------------------------------------------------- analysis


@dataclass
class _Consumer:
    op: ir.Operation
    dependent: bool
    beta: float = 0.0
    k: int = 0


@dataclass
class _Plan:
    r1: ir.Operation
    is_max: bool
    combiner: str                        # R1's combining op (arith.maximumf, ...)
    k: int                               # R1's reduction loop dim
    extent: int
    tile: int
    consumers: list
    chain: list                          # elementwise group ops (block order)
    producers: list
    group: list                          # all group ops in block order
    classes: DimClasses
    axis: object                         # class root of the axis
    yielded: list = field(default_factory=list)  # producers read after the group

    @property
    def filled_outputs(self) -> list:
        """The fills the yielded producers start from (each tile fills its own)."""
        fills = [defining_op(p.operands[loop_structure(p).num_inputs]) for p in self.yielded]
        return [f for f in fills if f is not None and f.name == "linalg.fill"]

    def axis_dim_of_value(self, value) -> Optional[int]:
        if not isinstance(value.type, ir.RankedTensorType):
            return None
        return self.classes.value_dim_like(value, self.axis)

    def axis_loop_dim(self, op) -> Optional[int]:
        for l in range(loop_structure(op).num_loops):
            if self.classes.same((op, l), self.axis):
                return l
        return None


def _combiner(op: ir.Operation) -> Optional[str]:
    """For a single-result reduction: the name of the op combining the accumulator."""
    body = op.regions[0].blocks[0]
    yielded = body.operations[len(body.operations) - 1].operands
    if len(yielded) != 1:
        return None
    acc = body.arguments[len(body.arguments) - 1]
    producer = defining_op(yielded[0])
    if producer is None or producer.parent != op:
        return None
    if acc not in list(producer.operands):
        return None
    return producer.name


def _is_zero_fill(value: ir.Value) -> bool:
    op = defining_op(value)
    if op is None:
        return False
    if op.name == "linalg.fill":
        scalar = op.operands[0]
        c = defining_op(scalar)
        if c is not None and c.name == "arith.constant":
            attr = c.attributes["value"]
            return isinstance(attr, (ir.FloatAttr, ir.IntegerAttr)) and attr.value == 0
        return False
    if op.name == "arith.constant":
        attr = op.attributes["value"]
        return isinstance(attr, ir.DenseElementsAttr) and attr.is_splat and \
            attr.get_splat_value().value == 0
    return False


def _is_elementwise(op: ir.Operation) -> bool:
    if not is_linalg(op) or len(op.results) != 1:
        return False
    ls = loop_structure(op)
    return not ls.reduction_dims and all(m.is_projected_permutation for m in ls.maps)


def _single_reduction(op: ir.Operation, role: str) -> int:
    if not is_linalg(op):
        raise Illegal(op, f"the {role} must be a linalg op")
    if len(op.results) != 1:
        raise Illegal(op, f"the {role} must have exactly one result (drop unused results first)")
    ls = loop_structure(op)
    if not ls.is_static:
        raise Illegal(op, f"the {role} has dynamic extents")
    if len(ls.reduction_dims) != 1:
        raise Illegal(op, f"the {role} must reduce exactly one dim, it reduces {len(ls.reduction_dims)}")
    return ls.reduction_dims[0]


def _depends_on(value: ir.Value, target: ir.Value, block, memo: dict) -> bool:
    if value == target:
        return True
    if value in memo:
        return memo[value]
    memo[value] = False
    op = defining_op(value)
    if op is None or op.parent != block.owner:
        return False
    result = any(_depends_on(v, target, block, memo) for v in op.operands)
    memo[value] = result
    return result


def analyze(r1: ir.Operation, consumers: list, producers: list, tile: int,
            allow_remainder: bool, yield_producers: bool = False) -> _Plan:
    """Legality and the fusion plan; raises Illegal with the reason."""
    k = _single_reduction(r1, "reduction")
    comb = _combiner(r1)
    if comb not in _MAX + _MIN:
        raise Illegal(r1, f"the reduction must combine with max or min, not {comb}")
    is_max = comb in _MAX
    block = r1.block
    m = r1.results[0]
    if not consumers:
        raise Illegal(r1, "no consumers to fuse")
    for op in consumers + producers:
        if op.block != block:
            raise Illegal(op, "all ops must be in the reduction's block")

    # Grow the group: elementwise ops between group members (or reading group values).
    group_set = {r1, *consumers, *producers}
    chain: list = []
    frontier = [r1] + list(consumers) + list(producers)
    memo: dict = {}
    while frontier:
        op = frontier.pop()
        for v in op.operands:
            p = defining_op(v)
            if p is None or p in group_set or p.parent != block.owner:
                continue
            reaches = _depends_on(v, m, block, memo) or any(
                _depends_on(v, g.results[0], block, {}) for g in producers)
            if not reaches:
                continue
            if not _is_elementwise(p):
                raise Illegal(p, "the reduction's result reaches a consumer through this op, "
                                 "which cannot join the loop (only elementwise ops can)")
            group_set.add(p)
            chain.append(p)
            frontier.append(p)

    ordered = [o.operation for o in block.operations if o.operation in group_set]
    for op in ordered:
        if not loop_structure(op).is_static:
            raise Illegal(op, "dynamic extents are not supported")
    classes = DimClasses(ordered)
    axis = classes.find((r1, k))
    extent = loop_structure(r1).ranges[k]
    plan = _Plan(r1, is_max, comb, k, extent, min(tile, extent), [], chain, producers, ordered,
                 classes, axis)
    if tile < 1:
        raise Illegal(r1, f"tile size must be >= 1, got {tile}")
    if extent % plan.tile and not allow_remainder:
        raise Illegal(r1, f"tile size {tile} does not divide the reduced extent {extent} "
                          f"and remainder handling is off")

    # Index maps: the axis may only appear as a plain dim.
    for op in ordered:
        ls = loop_structure(op)
        l_axis = plan.axis_loop_dim(op)
        for amap in ls.maps:
            for expr, d in zip(amap.results, dim_positions(amap)):
                if d is None and l_axis is not None and _mentions(expr, l_axis):
                    raise Illegal(op, "the fused axis appears in a composite index map")

    for op in consumers:
        kc = _single_reduction(op, "consumer")
        if not classes.same((op, kc), axis):
            raise Illegal(op, "its reduction dim is not the reduction's axis")
        dependent = _depends_on(op.operands[0], m, block, {}) or any(
            _depends_on(v, m, block, {}) for v in op.operands)
        plan.consumers.append(_Consumer(op, dependent, k=kc))
    _refuse_reads_of_consumers(r1, consumers, producers, block)
    for op in producers:
        l = plan.axis_loop_dim(op)
        if l is None or loop_structure(op).iterators[l] != "parallel":
            raise Illegal(op, "a producer must compute the fused axis as a parallel dim")

    if yield_producers:
        plan.yielded = [op for op in producers if _read_after(op, set(ordered))]
    analysis = _chain_forms(plan, m)
    for c in plan.consumers:
        if c.dependent:
            c.beta = _consumer_beta(c.op, analysis, plan)
            if c.beta == 0.0:
                raise Illegal(c.op, "the consumer's terms do not depend on the reduction result")
            if plan.is_max and c.beta > 0 or not plan.is_max and c.beta < 0:
                kind = "max" if plan.is_max else "min"
                raise Illegal(c.op, f"E grows as the running {kind} moves (exp({c.beta:g} * m)); "
                                    f"the rescaling would amplify, not shrink")
            ls = loop_structure(c.op)
            init = c.op.operands[ls.num_inputs]
            if not _is_zero_fill(init):
                raise Illegal(c.op, "the consumer's init is not provably zero (its identity)")
            # every dim of m must show up in the consumer's output
            for p in range(m.type.rank):
                if not any(classes.same((m, p), (c.op.results[0], q))
                           for q in range(c.op.results[0].type.rank)):
                    raise Illegal(c.op, "the consumer's result does not keep the rows of the reduction")
    return plan


def _read_after(op: ir.Operation, group: set) -> bool:
    """Is a result of `op` read by an op outside `group` (an op of the block, or nested in
    one, that is not a group op)?"""
    block_owner = op.parent
    for result in op.results:
        for use in result.uses:
            owner = getattr(use.owner, "operation", use.owner)
            while owner.parent is not None and owner.parent != block_owner:
                owner = owner.parent
            if getattr(owner, "operation", owner) not in group:
                return True
    return False


def _refuse_reads_of_consumers(r1, consumers, producers, block) -> None:
    """Inside the loop a consumer's result is a running partial value; only m has a
    correction (the rescaling). A group op reading a consumer's result (the softmax
    backward's sum_c g_c * e_c / l reads the exp-sum l) would read the partial value."""
    for consumer in consumers:
        memo: dict = {}
        for op in [r1, *consumers, *producers]:
            if op is not consumer and any(_depends_on(v, consumer.results[0], block, memo)
                                          for v in op.operands):
                raise Illegal(op, "it reads another reduction of the group, which the fused "
                                  "loop holds only as a partial value (final after the loop)")


def _mentions(expr, dim: int) -> bool:
    if isinstance(expr, ir.AffineDimExpr):
        return expr.position == dim
    return any(_mentions(getattr(expr, side), dim) for side in ("lhs", "rhs") if hasattr(expr, side))


def _chain_forms(plan: _Plan, m: ir.Value) -> FormAnalysis:
    """FormAnalysis where block args stand for their operands, chain ops are looked through."""
    chain = set(plan.chain)

    def leaf(arg: ir.BlockArgument) -> Form:
        owner = arg.owner.owner
        owner = owner.operation if isinstance(owner, ir.OpView) else owner
        operand = owner.operands[arg.arg_number] if arg.arg_number < len(owner.operands) else None
        if operand is None:
            return Form.x()
        return value_form(operand)

    analysis = FormAnalysis(leaf)

    def value_form(value: ir.Value) -> Form:
        if value == m:
            return Form("ADD", 1.0)
        p = defining_op(value)
        if p is not None and p in chain:
            body = p.regions[0].blocks[0]
            yielded = body.operations[len(body.operations) - 1].operands[0]
            return analysis.form(yielded)
        if p is not None and p.name == "arith.constant" and isinstance(value.type, ir.RankedTensorType):
            attr = p.attributes["value"]
            if isinstance(attr, ir.DenseElementsAttr) and attr.is_splat:
                v = attr.get_splat_value()
                return Form.x(float(v.value) if isinstance(v, (ir.FloatAttr, ir.IntegerAttr)) else None)
        return Form.x()

    analysis.value_form = value_form
    return analysis


def _consumer_beta(op: ir.Operation, analysis: FormAnalysis, plan: _Plan) -> float:
    body = op.regions[0].blocks[0]
    acc = body.arguments[len(body.arguments) - 1]
    yielded = body.operations[len(body.operations) - 1].operands[0]
    add = defining_op(yielded)
    if add is None or add.name != "arith.addf" or acc not in list(add.operands):
        raise Illegal(op, "the consumer must accumulate with `acc + t` (an additive reduction)")
    term = add.operands[1] if add.operands[0] == acc else add.operands[0]
    try:
        form = analysis.form(term)
    except NotSeparable as exc:
        raise Illegal(op, f"E is not separable in the reduction result: {exc}") from None
    if form.kind == "X":
        return 0.0
    if form.kind != "MUL":
        raise Illegal(op, "E is not separable in the reduction result: its terms depend on it "
                          "additively, not as a factor")
    return form.beta


# ----------------------------------------------------------------------------- rewrite


def _tile_type(t: ir.RankedTensorType, dim: int, size: int) -> ir.RankedTensorType:
    shape = list(t.shape)
    shape[dim] = size
    return ir.RankedTensorType.get(shape, t.element_type, t.encoding)


def _tile_of(t: ir.RankedTensorType, dim: int, offset, size: int):
    """(dynamic offsets, static offsets, sizes) of the tile of `t` at `offset` (an int or an
    index value) of `size` along `dim`, whole along the other dims."""
    static_offsets = [0] * t.rank
    offsets = []
    if isinstance(offset, int):
        static_offsets[dim] = offset
    else:
        static_offsets[dim] = DYNAMIC
        offsets = [offset]
    sizes = list(t.shape)
    sizes[dim] = size
    return offsets, static_offsets, sizes


def _slice(value: ir.Value, dim: int, offset, size: int) -> ir.Value:
    offsets, static_offsets, sizes = _tile_of(value.type, dim, offset, size)
    return tensor.ExtractSliceOp(_tile_type(value.type, dim, size), value, offsets, [], [],
                                 static_offsets, sizes, [1] * value.type.rank).result


def _insert(part: ir.Value, whole: ir.Value, dim: int, offset, size: int) -> ir.Value:
    """`part` written into `whole` at `offset` along `dim` (the other dims whole)."""
    offsets, static_offsets, sizes = _tile_of(whole.type, dim, offset, size)
    return tensor.InsertSliceOp(part, whole, offsets, [], [], static_offsets, sizes,
                                [1] * whole.type.rank).result


def _is_empty_like(value: ir.Value) -> bool:
    """A tensor.empty, possibly seen through extract_slice ops (its contents are undefined)."""
    op = defining_op(value)
    while op is not None and op.name == "tensor.extract_slice":
        op = defining_op(op.operands[0])
    return op is not None and op.name == "tensor.empty"


def _elementwise(inputs, input_maps, out_type, build, rank, init=None):
    """A parallel linalg.generic over `out_type`'s shape; build(args) -> yielded value.
    `init` (default: a new tensor.empty) is the destination, for in-place updates."""
    identity = ir.AffineMap.get_identity(rank)
    empty = init if init is not None else tensor.EmptyOp(list(out_type.shape),
                                                         out_type.element_type).result
    maps = [ir.AffineMapAttr.get(m) for m in input_maps] + [ir.AffineMapAttr.get(identity)]
    iters = ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * rank)
    op = linalg.GenericOp([out_type], inputs, [empty], ir.ArrayAttr.get(maps), iters)
    block = op.regions[0].blocks.append(*[v.type.element_type for v in inputs], out_type.element_type)
    with ir.InsertionPoint(block):
        linalg.YieldOp([build(list(block.arguments)[: len(inputs)])])
    return op.result


def _update(dest, inputs, input_maps, build, rank):
    """dest[...] = build(inputs..., dest[...]) in place: dest is the generic's only init and
    is read through the init's block argument (after tiling, every tile reads the element it
    writes, so bufferization keeps one buffer)."""
    out_type = dest.type
    identity = ir.AffineMap.get_identity(rank)
    maps = [ir.AffineMapAttr.get(m) for m in input_maps] + [ir.AffineMapAttr.get(identity)]
    iters = ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * rank)
    op = linalg.GenericOp([out_type], inputs, [dest], ir.ArrayAttr.get(maps), iters)
    block = op.regions[0].blocks.append(*[v.type.element_type for v in inputs], out_type.element_type)
    with ir.InsertionPoint(block):
        linalg.YieldOp([build(list(block.arguments))])
    return op.result


def _const(t, value):
    return arith.ConstantOp(t, ir.FloatAttr.get(t, value)).result


def _to(t, v):
    if v.type == t:
        return v
    if ir.FloatType(v.type).width < ir.FloatType(t).width:
        return arith.extf(t, v)
    return arith.truncf(t, v)


class _Emitter:
    def __init__(self, plan: _Plan):
        self.plan = plan
        self.f32 = ir.F32Type.get()

    def tile_body(self, offset, size: int, m_old: ir.Value, accs: list) -> list:
        """Emit one tile's computation; returns [m_new, acc_new...]."""
        plan = self.plan
        mapping: dict = {}
        m = plan.r1.results[0]
        ident = float("-inf") if plan.is_max else float("inf")
        mtype = m.type
        rank_m = mtype.rank
        mid = ir.AffineMap.get_identity(rank_m)

        def operand_value(v):
            if v in mapping:
                return mapping[v]
            d = plan.axis_dim_of_value(v)
            if d is None or v.type.shape[d] != plan.extent:
                return v
            producer = defining_op(v)
            tile_type = _tile_type(v.type, d, size)
            if _is_empty_like(v):
                return tensor.EmptyOp(list(tile_type.shape), tile_type.element_type).result
            if producer is not None and producer.name == "linalg.fill" and \
                    (_is_empty_like(producer.operands[1]) or producer in plan.filled_outputs):
                empty = tensor.EmptyOp(list(tile_type.shape), tile_type.element_type).result
                return linalg.fill(producer.operands[0], outs=[empty])
            return _slice(v, d, offset, size)

        def clone(op, outs_override=None):
            ls = loop_structure(op)
            values = [outs_override[i - ls.num_inputs]
                      if outs_override is not None and i >= ls.num_inputs else operand_value(v)
                      for i, v in enumerate(op.operands)]
            new = op.clone()
            for i, v in enumerate(values):
                new.operands[i] = v
            for r_old, r_new in zip(op.results, new.results):
                d = plan.axis_dim_of_value(r_old)
                if d is not None:
                    r_new.set_type(_tile_type(r_old.type, d, size))
                mapping[r_old] = r_new
            self._shift_index(new, plan.axis_loop_dim(op), offset)
            return new

        needs_safe = any(c.dependent for c in plan.consumers)
        m_new = None
        m_safe = None
        factors: dict = {}
        for op in plan.group:
            if op == plan.r1:
                # The tile is reduced from the identity into a fresh tensor; the corrections
                # read m_old and that tile result (before m_old is overwritten); then
                # m_new = combine(m_old, tile) is written in place over m_old, so the loop
                # carries m in one buffer (bufferization needs no copy and no allocation).
                empty = tensor.EmptyOp(list(mtype.shape), mtype.element_type).result
                start = linalg.fill(_const(mtype.element_type, ident), outs=[empty])
                tile_red = clone(op, [start]).results[0]
                combine = self.plan.combiner
                for c in plan.consumers:
                    if c.dependent and c.beta not in factors:
                        factors[c.beta] = self._factor(m_old, tile_red, c.beta, ident)

                def combined(args):
                    tile, old = args
                    return ir.Operation.create(combine, results=[old.type],
                                               operands=[old, tile]).result

                m_new = _update(m_old, [tile_red], [mid], combined, rank_m)
                if needs_safe:
                    def safe(args):
                        x = args[0]
                        is_id = arith.cmpf(arith.CmpFPredicate.OEQ, x, _const(x.type, ident))
                        return arith.select(is_id, _const(x.type, 0.0), x)
                    m_safe = _elementwise([m_new], [mid], mtype, safe, rank_m)
                mapping[m] = m_safe if m_safe is not None else m_new
                continue
            consumer = next((c for c in plan.consumers if c.op == op), None)
            if consumer is None:
                clone(op)
                continue
            i = plan.consumers.index(consumer)
            acc = accs[i]
            if consumer.dependent:
                acc = self._rescale(acc, factors[consumer.beta], consumer)
            clone(op, [acc])
        self.tiles = {p: mapping[p.results[0]] for p in plan.yielded}
        return [m_new] + [mapping[c.op.results[0]] for c in plan.consumers]

    def _factor(self, m_old, tile_red, beta: float, ident: float):
        """c = (m_old == identity) ? 0 : exp(beta (m_new - m_old)), m_new = combine(m_old,
        tile), computed in f32 as exp(-beta (m_old - m_new)) (the argument is <= 0)."""
        f32 = self.f32
        mtype = m_old.type
        rank_m = mtype.rank
        mid = ir.AffineMap.get_identity(rank_m)
        combine = self.plan.combiner

        def factor(args):
            old, tile = args
            new = ir.Operation.create(combine, results=[old.type], operands=[old, tile]).result
            old, new = _to(f32, old), _to(f32, new)
            is_id = arith.cmpf(arith.CmpFPredicate.OEQ, old, _const(f32, ident))
            delta = arith.subf(old, new)
            if beta != -1.0:
                delta = arith.mulf(delta, _const(f32, -beta))
            return arith.select(is_id, _const(f32, 0.0), mmath.exp(delta))

        ftype = ir.RankedTensorType.get(list(mtype.shape), f32)
        return _elementwise([m_old, tile_red], [mid, mid], ftype, factor, rank_m)

    def _rescale(self, acc, c, consumer: _Consumer):
        plan = self.plan
        f32 = self.f32
        rank_m = plan.r1.results[0].type.rank
        out = consumer.op.results[0]
        rank = out.type.rank
        dims = []
        for p in range(rank_m):
            q = next(q for q in range(rank) if plan.classes.same((plan.r1.results[0], p), (out, q)))
            dims.append(ir.AffineDimExpr.get(q))
        bmap = ir.AffineMap.get(rank, 0, dims)
        etype = out.type.element_type

        def scale(args):
            f, a = args
            return _to(etype, arith.mulf(_to(f32, a), f))

        return _update(acc, [c], [bmap], scale, rank)

    @staticmethod
    def _shift_index(op: ir.Operation, loop_dim, offset):
        """linalg.index of the fused dim counts within the tile: add the tile's offset."""
        if loop_dim is None or offset == 0 or not op.regions:
            return
        index_ops = []

        def visit(inner):
            if inner.name == "linalg.index" and ir.IntegerAttr(inner.attributes["dim"]).value == loop_dim:
                index_ops.append(inner)
            return ir.WalkResult.ADVANCE

        op.walk(visit)
        for idx in index_ops:
            with ir.InsertionPoint.after(idx), idx.location:
                off = offset if not isinstance(offset, int) else arith.ConstantOp(
                    ir.IndexType.get(), ir.IntegerAttr.get(ir.IndexType.get(), offset)).result
                shifted = arith.addi(idx.results[0], off)
            idx.results[0].replace_all_uses_except(shifted, shifted.owner.operation)


def rewrite(plan: _Plan, rewriter) -> ir.Operation:
    block = plan.r1.block
    group = set(plan.group)
    externals_last = None
    externals = []
    for op in plan.group:
        for v in op.operands:
            p = defining_op(v)
            if p is not None and p not in group and p.parent == block.owner:
                externals.append(p)
                if externals_last is None or externals_last.is_before_in_block(p):
                    externals_last = p
    anchor = plan.group[0]
    if externals_last is not None and anchor.is_before_in_block(externals_last):
        ip = ir.InsertionPoint.after(externals_last)
    else:
        ip = ir.InsertionPoint(anchor)
    loc = plan.r1.location
    emitter = _Emitter(plan)
    r1_init = plan.r1.operands[loop_structure(plan.r1).num_inputs]
    inits = [r1_init] + [c.op.operands[loop_structure(c.op).num_inputs] for c in plan.consumers]
    count = len(inits)
    for p in plan.yielded:  # every tile overwrites its part: a fill's destination will do
        init = p.operands[loop_structure(p).num_inputs]
        fill = defining_op(init)
        inits.append(fill.operands[1] if fill in plan.filled_outputs else init)
    full = plan.extent - plan.extent % plan.tile
    idx = ir.IndexType.get()

    def tile(offset, size, carried):
        outs = emitter.tile_body(offset, size, carried[0], carried[1:count])
        for p, whole in zip(plan.yielded, carried[count:]):
            part = emitter.tiles[p]
            d = plan.axis_dim_of_value(p.results[0])
            outs.append(_insert(part, whole, d, offset, size))
        return outs

    with ip, loc:
        lb = arith.ConstantOp(idx, ir.IntegerAttr.get(idx, 0)).result
        ub = arith.ConstantOp(idx, ir.IntegerAttr.get(idx, full)).result
        step = arith.ConstantOp(idx, ir.IntegerAttr.get(idx, plan.tile)).result
        loop = scf.ForOp(lb, ub, step, inits)
        with ir.InsertionPoint(loop.body):
            scf.YieldOp(tile(loop.induction_variable, plan.tile, list(loop.inner_iter_args)))
        finals = list(loop.results)
        if plan.extent % plan.tile:
            finals = tile(full, plan.extent % plan.tile, finals)
    replaced_ops = [plan.r1] + [c.op for c in plan.consumers] + plan.yielded
    _sink_users(block, loop.operation, replaced_ops, finals)
    replaced = [op.results[0] for op in replaced_ops]
    for old, new in zip(replaced, finals):
        old.replace_all_uses_with(new)
    for op in reversed(plan.group):
        if all(not list(r.uses) for r in op.results):
            rewriter.erase_op(op)
    _erase_dead_inits(externals, rewriter)
    return loop.operation


_PURE_INITS = ("tensor.empty", "linalg.fill", "tensor.extract_slice", "arith.constant")


def _erase_dead_inits(ops, rewriter) -> None:
    """Erase the tensor.empty / fill / slice / constant producers of the fused ops' operands
    that nothing reads anymore (the full-size score init, for one)."""
    pending = []
    for op in ops:
        if op not in pending:
            pending.append(op)
    erased: list = []
    while pending:
        op = pending.pop()
        if op in erased or op.name not in _PURE_INITS or any(list(r.uses) for r in op.results):
            continue
        operands = [defining_op(v) for v in op.operands]
        rewriter.erase_op(op)
        erased.append(op)
        pending.extend(p for p in operands if p is not None and p not in erased and p not in pending)


def _sink_users(block, loop: ir.Operation, replaced_ops, finals) -> None:
    """Ops before the new loop that use a replaced result move (with their users) after it."""
    owners = [defining_op(v) for v in finals]
    after = owners[0]
    for o in owners[1:]:
        if after.is_before_in_block(o):
            after = o
    moving = []
    for o in block.operations:
        o = o.operation
        if o == loop or not o.is_before_in_block(loop):
            continue
        if o in replaced_ops:
            continue
        producers = [p for p in map(defining_op, o.operands) if p is not None]
        if any(p in replaced_ops or p in moving for p in producers):
            moving.append(o)
    for o in moving:
        o.move_after(after)
        after = o


# ----------------------------------------------------------------------------- the op


class FuseDependentReductionOpsOp(TransformExt.Operation, name="fuse_dependent_reduction_ops"):
    reduction: ext.Operand[transform.AnyOpType]
    consumers: ext.Operand[transform.AnyOpType]
    producers: Sequence[ext.Operand[transform.AnyOpType]]
    tile_size: ir.IntegerAttr
    allow_remainder: ir.IntegerAttr
    yield_producers: ir.IntegerAttr  # i1
    loop: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                r1s = payload_ops(state, op.reduction)
                consumers = payload_ops(state, op.consumers)
                producers = [p for h in op.producers for p in payload_ops(state, h)]
                tile = ir.IntegerAttr(op.tile_size).value
                allow = bool(ir.IntegerAttr(op.allow_remainder).value)
                yields = bool(ir.IntegerAttr(op.yield_producers).value)
                if len(r1s) != 1:
                    payload = r1s[0] if r1s else op.operation
                    return fail("transform_ext.fuse_dependent_reduction_ops",
                                Illegal(payload, f"expected one reduction, got {len(r1s)}"))
                try:
                    plan = analyze(r1s[0], consumers, producers, tile, allow, yields)
                except Illegal as illegal:
                    return fail("transform_ext.fuse_dependent_reduction_ops", illegal)
                loop = rewrite(plan, rewriter)
                results.set_ops(op.loop, [loop])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def fuse_dependent_reduction_ops(reduction: ir.Value, consumers: ir.Value, tile_size: int,
                                 *, producers: Sequence[ir.Value] = (),
                                 allow_remainder: bool = True,
                                 yield_producers: bool = False) -> ir.Value:
    """Fuse `consumers` (dependent reductions and siblings) with `reduction` into one loop
    over tiles of `tile_size` along the reduced axis; returns the loop handle."""
    i64, i1 = ir.IntegerType.get_signless(64), ir.IntegerType.get_signless(1)
    return FuseDependentReductionOpsOp(
        reduction, consumers, list(producers), ir.IntegerAttr.get(i64, tile_size),
        ir.IntegerAttr.get(i1, int(allow_remainder)),
        ir.IntegerAttr.get(i1, int(yield_producers))).loop
