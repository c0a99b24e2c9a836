"""sliding_window_extrema: a stride-1 max (min) pooling as doubled windows on vector chunks.

A pooling whose one window of k > 1 taps runs along the innermost dim of its input, with
stride 1 and dilation d, and the output's innermost dim w,
    y[r, w] = max(y[r, w], max_{j<k} f(x[r', w + j*d]))          (f: an optional extf),
is computed per row r and chunk of V outputs w0 .. w0+V-1 from one read of the
S = V + (k-1)*d inputs that chunk sees. With m_1 = f(x[r', w0 .. w0+S)),
    m_2p[i] = max(m_p[i], m_p[i + p*d])  gives  m_p[i] = max_{j<p} f(x[r', w0+i+j*d]),
and for p the largest power of two <= k, max(m_p[i], m_p[i + (k-p)*d]) covers j < k (the
two halves overlap: max is idempotent). That is ceil(log2 k) maxima per output lane instead
of k - 1, each of two static lane shifts of one vector, and the output chunk is written
once: the vectorizer's form reads and writes it once per tap, after a fill. When the init
is a fill of the combine's identity (-inf for a max) it is not read at all.
When the input is a tensor.pad of a constant along its innermost dim only, the pad's source
is read instead: a chunk whose span lies inside the source reads it directly, one at an
edge splices its in-range part into a splat of the pad value; the padded copy is not made.
Exact: the max (min) of the same elements; maximumf / minimumf propagate NaN the same way
in any order.

Targets: nested in the target ops, linalg.pooling_* and linalg.generic ops with static
tensor operands and one result; input 0 indexed by w + d*j in its innermost dim (w the
output's innermost dim, parallel; j a reduction dim of extent k > 1) and by sums of other
dims times constants, or constants, in the others; every other reduction dim of extent 1;
the output map a projected permutation ending in w; other inputs (a window's shape) unread;
a body of single-operand arith ops on the input, then one of maximumf, minimumf, maxnumf,
minnumf, maxsi, minsi, maxui, minui of that and the accumulator. (k-1)*d is at most four
chunks (`lanes`), and at most 8 chunks of a row are at an edge. Other ops are left as they
are; never fails. The target handle is only read.
"""

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, scf, transform, vector

from .analysis.convolution import linear_terms
from .analysis.pooling import is_identity, pooling_body
from .analysis.structure import loop_structure
from .common import RewritesTargets, Success, constant_value, defining_op, is_static_tensor, planned_ops
from .dialect import TransformExt

MAX_EDGE_CHUNKS = 8


@dataclass
class SlidingWindow:
    lane: int                 # the output's innermost loop dim w
    taps: int                 # k
    dilation: int             # d
    rows: list[int]           # the other parallel dims of extent > 1
    input_terms: list         # per input dim but the last: {dim: coefficient} or a constant int
    output_dims: list[int]    # per output dim, its loop dim
    convert: list[ir.Operation]   # f: the body's ops on the input
    combine: ir.Operation
    input_first: bool         # combine(f(x), acc) rather than combine(acc, f(x))
    source: ir.Value          # what is read: input 0, or its pad's source
    pad_low: int              # elements of padding before the source's innermost dim
    pad_value: ir.Value | None
    init_is_identity: bool


def _pad_of(value: ir.Value):
    """(source, low, pad value) of a tensor.pad of a constant along the innermost dim only."""
    pad = defining_op(value)
    if pad is None or pad.name != "tensor.pad" or len(pad.operands) != 1:
        return None
    low = list(ir.DenseI64ArrayAttr(pad.attributes["static_low"]))
    high = list(ir.DenseI64ArrayAttr(pad.attributes["static_high"]))
    if any(low[:-1]) or any(high[:-1]):
        return None
    yielded = list(pad.regions[0].blocks[0].operations)[-1].operands[0]
    constant = defining_op(yielded)
    if constant is None or constant.name != "arith.constant" or not is_static_tensor(pad.operands[0]):
        return None
    return pad.operands[0], low[-1], yielded


def sliding_window(op: ir.Operation, lanes: int) -> SlidingWindow | None:
    """The plan for a stride-1 max (min) pooling (module docstring), None for any other op."""
    if not (op.name.startswith("linalg.pooling_") or op.name == "linalg.generic") \
            or len(op.results) != 1 or not all(is_static_tensor(v) for v in op.operands):
        return None
    ls = loop_structure(op)
    if not ls.is_static or not ls.num_inputs or len(op.operands) != ls.num_inputs + 1:
        return None
    out_map, in_map = ls.output_map(), ls.maps[0]
    if not out_map.results or not in_map.results \
            or not all(isinstance(e, ir.AffineDimExpr) for e in out_map.results):
        return None
    output_dims = [e.position for e in out_map.results]
    lane = output_dims[-1]
    terms = linear_terms(in_map.results[-1])
    if terms is None or len(terms) != 2 or terms.get(lane) != 1:
        return None
    (window, dilation), = [(d, c) for d, c in terms.items() if d != lane]
    if window not in ls.reduction_dims or ls.ranges[window] < 2 \
            or any(ls.ranges[d] != 1 for d in ls.reduction_dims if d != window):
        return None
    input_terms = []
    for expr in in_map.results[:-1]:
        if isinstance(expr, ir.AffineConstantExpr):
            input_terms.append(expr.value)
            continue
        t = linear_terms(expr)
        if t is None or lane in t or window in t:
            return None
        input_terms.append(t)
    body = pooling_body(op)
    if body is None:
        return None
    taps = ls.ranges[window]
    if (taps - 1) * dilation > 4 * lanes:
        return None
    x, init = op.operands[0], op.operands[len(op.operands) - 1]
    pad = _pad_of(x)
    source, pad_low, pad_value = pad if pad else (x, 0, None)
    plan = SlidingWindow(lane, taps, dilation,
                         [d for d in ls.parallel_dims if d != lane and ls.ranges[d] > 1],
                         input_terms, output_dims, body.convert, body.combine, body.input_first,
                         source, pad_low, pad_value,
                         is_identity(body.combine, constant_value(init)) and defining_op(init).name == "linalg.fill")
    if len(_chunks(plan, ls.ranges[lane], lanes)[0]) > MAX_EDGE_CHUNKS:
        return None
    return plan


def _chunks(plan: SlidingWindow, width: int, lanes: int):
    """([(w0, n)] chunks computed one by one, (first, end) the w0 range of the full chunks
    in a loop, both inside the source or None): a chunk is inside when its S inputs are."""
    src_len = ir.RankedTensorType(plan.source.type).shape[-1]
    span = (plan.taps - 1) * plan.dilation
    full, rest = divmod(width, lanes)

    def inside(w0, n):
        return w0 - plan.pad_low >= 0 and w0 - plan.pad_low + n + span <= src_len

    inner = [i for i in range(full) if inside(i * lanes, lanes)]
    first, end = (inner[0], inner[-1] + 1) if len(inner) > 1 else (0, 0)
    static = [(i * lanes, lanes) for i in range(full) if not first <= i < end]
    if rest:
        static.append((full * lanes, rest))
    return static, ((first * lanes, end * lanes) if end else None)


def _rebuilt(op: ir.Operation, operands: list[ir.Value], result_type: ir.Type) -> ir.Value:
    """`op` (a body's arith op) built again on `operands`, with its attributes (fastmath)."""
    attrs = {a.name: a.attr for a in (op.attributes[i] for i in range(len(op.attributes)))}
    return ir.Operation.create(op.name, results=[result_type], operands=operands,
                               attributes=attrs).results[0]


class _Emitter:
    """Builds one pooling's replacement at the current insertion point."""

    def __init__(self, op: ir.Operation, plan: SlidingWindow, lanes: int):
        self.op, self.plan, self.lanes = op, plan, lanes
        self.index = ir.IndexType.get()
        self.src_type = ir.RankedTensorType(plan.source.type)
        self.out_type = ir.RankedTensorType(op.results[0].type)
        self.width = self.out_type.shape[-1]
        self.ranges = loop_structure(op).ranges
        self.consts: dict[tuple[int, str], ir.Value] = {}
        self.pad: ir.Value | None = None  # f of the pad value
        # constants and f(pad) go before this first op built: they dominate every loop
        self.anchor = self.const(0).owner

    def const(self, n: int, elem: ir.Type | None = None) -> ir.Value:
        """The constant n (an index by default), built before everything built here."""
        elem = elem or self.index
        key = (n, str(elem))
        if key not in self.consts:
            with ir.InsertionPoint(self.op if not self.consts else self.anchor):
                self.consts[key] = arith.constant(elem, n if isinstance(elem, (ir.IndexType, ir.IntegerType))
                                                  else float(n))
        return self.consts[key]

    def offset(self, base, n: int):
        """base + n for a static int or an index Value."""
        if isinstance(base, int):
            return self.const(base + n)
        return base if n == 0 else arith.addi(base, self.const(n))

    def read(self, tensor: ir.Value, lead: list[ir.Value], last, n: int) -> ir.Value:
        t = ir.RankedTensorType(tensor.type)
        rank = t.rank
        rows = vector.transfer_read(
            ir.VectorType.get([1] * (rank - 1) + [n], t.element_type), tensor,
            lead + [last if isinstance(last, ir.Value) else self.const(last)],
            ir.AffineMap.get_minor_identity(rank, rank), self.const(0, t.element_type), [True] * rank)
        return vector.shape_cast(ir.VectorType.get([n], t.element_type), rows)

    def convert(self, value: ir.Value) -> ir.Value:
        """f (the body's ops on the input) applied to a vector or a scalar."""
        for inner in self.plan.convert:
            elem = inner.results[0].type
            t = ir.VectorType.get(ir.VectorType(value.type).shape, elem) \
                if isinstance(value.type, ir.VectorType) else elem
            value = _rebuilt(inner, [value], t)
        return value

    def span(self, lead: list[ir.Value], w0, n: int) -> ir.Value:
        """f of the S = n + (k-1)*d inputs of outputs w0 .. w0+n, as a vector (the padding
        spliced in after f: no shuffles of narrow lanes)."""
        plan = self.plan
        size = n + (plan.taps - 1) * plan.dilation
        if not isinstance(w0, int):
            return self.convert(self.read(plan.source, lead, self.offset(w0, -plan.pad_low)
                                          if plan.pad_low else w0, size))
        lo = w0 - plan.pad_low
        src_len = self.src_type.shape[-1]
        if lo >= 0 and lo + size <= src_len:
            return self.convert(self.read(plan.source, lead, lo, size))
        if self.pad is None:
            with ir.InsertionPoint(self.anchor):
                self.pad = self.convert(plan.pad_value)
        pad = self.pad
        splat = vector.broadcast(ir.VectorType.get([size], pad.type), pad)
        a, b = max(lo, 0), min(lo + size, src_len)
        if b <= a:
            return splat
        return vector.insert_strided_slice(self.convert(self.read(plan.source, lead, a, b - a)),
                                           splat, [a - lo], [1])

    def combine(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return _rebuilt(self.plan.combine, [a, b], a.type)

    def lanes_of(self, v: ir.Value, offset: int, n: int) -> ir.Value:
        vt = ir.VectorType(v.type)
        if offset == 0 and n == vt.shape[0]:
            return v
        return vector.extract_strided_slice(ir.VectorType.get([n], vt.element_type), v, [offset], [n], [1])

    def chunk(self, lead_in, lead_out, w0, n: int, dest: ir.Value) -> ir.Value:
        """Outputs w0 .. w0+n of one row, written into `dest`."""
        plan = self.plan
        m = self.span(lead_in, w0, n)
        length, p, d = ir.VectorType(m.type).shape[0], 1, plan.dilation
        while 2 * p <= plan.taps:
            length -= p * d
            m = self.combine(self.lanes_of(m, 0, length), self.lanes_of(m, p * d, length))
            p *= 2
        result = self.lanes_of(m, 0, n)
        if p < plan.taps:
            result = self.combine(result, self.lanes_of(m, (plan.taps - p) * d, n))
        if not plan.init_is_identity:
            acc = self.read(dest, lead_out, w0, n)
            result = self.combine(result, acc) if plan.input_first else self.combine(acc, result)
        rank = self.out_type.rank
        last = w0 if isinstance(w0, ir.Value) else self.const(w0)
        rows = vector.shape_cast(ir.VectorType.get([1] * (rank - 1) + [n], self.out_type.element_type), result)
        return vector.transfer_write(dest.type, rows, dest, lead_out + [last],
                                     ir.AffineMap.get_minor_identity(rank, rank), [True] * rank)

    def row(self, ivs: dict[int, ir.Value], dest: ir.Value) -> ir.Value:
        plan = self.plan
        zero = self.const(0)
        lead_in = []
        for t in plan.input_terms:
            if isinstance(t, int):
                lead_in.append(self.const(t))
                continue
            value = None
            for d, c in t.items():
                if d not in ivs:
                    continue
                term = ivs[d] if c == 1 else arith.muli(ivs[d], self.const(c))
                value = term if value is None else arith.addi(value, term)
            lead_in.append(value if value is not None else zero)
        lead_out = [ivs.get(d, zero) for d in plan.output_dims[:-1]]
        static, looped = _chunks(plan, self.width, self.lanes)
        for w0, n in static:
            if looped and w0 >= looped[1]:
                break
            dest = self.chunk(lead_in, lead_out, w0, n, dest)
        if looped:
            loop = scf.ForOp(self.const(looped[0]), self.const(looped[1]), self.const(self.lanes), [dest])
            with ir.InsertionPoint(loop.body):
                scf.YieldOp([self.chunk(lead_in, lead_out, loop.induction_variable, self.lanes,
                                        loop.inner_iter_args[0])])
            dest = loop.results[0]
            for w0, n in static:
                if w0 >= looped[1]:
                    dest = self.chunk(lead_in, lead_out, w0, n, dest)
        return dest

    def nest(self, dims: list[int], ivs: dict, dest: ir.Value) -> ir.Value:
        if not dims:
            return self.row(ivs, dest)
        loop = scf.ForOp(self.const(0), self.const(self.ranges[dims[0]]), self.const(1), [dest])
        with ir.InsertionPoint(loop.body):
            scf.YieldOp([self.nest(dims[1:], {**ivs, dims[0]: loop.induction_variable},
                                   loop.inner_iter_args[0])])
        return loop.results[0]


def _rewrite(op: ir.Operation, plan: SlidingWindow, lanes: int, rewriter) -> None:
    init = op.operands[len(op.operands) - 1]
    dest = defining_op(init).operands[1] if plan.init_is_identity else init
    with ir.InsertionPoint(op), op.location:
        result = _Emitter(op, plan, lanes).nest(plan.rows, {}, dest)
    rewriter.replace_op(op, [result])


class SlidingWindowExtremaOp(TransformExt.Operation, name="sliding_window_extrema"):
    target: ext.Operand[transform.AnyOpType]
    lanes: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                lanes = ir.IntegerAttr(op.lanes).value
                plan = (lambda o: sliding_window(o, lanes)) if lanes > 0 else (lambda o: None)
                for p, window in planned_ops(state, op.target, plan):
                    _rewrite(p, window, lanes, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def sliding_window_extrema(target: ir.Value, lanes: int) -> SlidingWindowExtremaOp:
    """Rewrite the stride-1 max (min) poolings nested in `target` (module docstring) in
    chunks of `lanes` outputs."""
    return SlidingWindowExtremaOp(target, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), lanes))


__all__ = ["SlidingWindowExtremaOp", "sliding_window_extrema", "sliding_window"]
