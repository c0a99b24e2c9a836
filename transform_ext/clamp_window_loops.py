"""clamp_window_loops: the window loops around a convolution's one-tap tile skip the taps that
read only the zero padding of its image.

A convolution tiled to one tap per step (the register tile: T reads the element
Z[.., b + k, ..] of its image along an image dim, b the output's position, k the tap; the
loop `for k in [lo, hi)` encloses T) over an image Z that is x padded with zeros, x's
elements at [p, p + n) of Z along that dim (tensor.pad with low padding p, or x inserted
at offset p into zeros, as torch-mlir imports a transposed convolution of stride 1):

    for k in [max(lo, p - b), min(hi, p + n - b)):  acc += W[.., k, ..] Z[.., b + k, ..]

Exact: the skipped terms are products of a stuffed zero (torch's transposed convolution
never forms them; a finite W gives +-0 either way). The position b is the sum of the offsets
of the extract_slice chain from Z to T's image along that dim (affine.apply sums expanded)
without the tap's induction variable (every other term defined outside the tap's loop). The loops enclosing T innermost
are its reduction dims tiled by 1, in order (transform.structured.tile_using_for); only the
window dims whose tap appears as a term of that sum, of dilation 1, are clamped.

Targets: linalg ops that are convolutions (transform_ext.analysis.convolution) of one tap
inside such loops; what cannot be shown to read padding is left alone (the op never
fails). The target handles stay valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .analysis.convolution import NotConvolution, convolution_dims
from .analysis.structure import loop_structure
from .common import RewritesTargets, Success, defining_op, is_zero, payload_ops
from .dialect import TransformExt


def _parent_op(op: ir.Operation):
    parent = op.parent
    return getattr(parent, "operation", parent) if parent is not None else None


def _enclosing_loops(op: ir.Operation, count: int) -> list[ir.Operation] | None:
    """The `count` scf.for ops directly around `op`, outermost first, or None."""
    loops, current = [], op
    for _ in range(count):
        current = _parent_op(current)
        if current is None or current.name != "scf.for":
            return None
        loops.insert(0, current)
    return loops


def _is_inside(value: ir.Value, loop: ir.Operation) -> bool:
    """Is `value` defined in `loop` (its induction variable, or an op nested in it)?"""
    if isinstance(value, ir.BlockArgument):
        op = value.owner.owner
        op = getattr(op, "operation", op)
    else:
        op = defining_op(value)
    while op is not None:
        if op == loop:
            return True
        op = _parent_op(op)
    return False


def _real_range(z: ir.Value, axis: int) -> tuple[int, int] | None:
    """[p, p + n): where x lies along `axis` of its zero-padded image Z, else None."""
    producer = defining_op(z)
    if producer is None:
        return None
    if producer.name == "tensor.pad":
        view = producer.opview
        yielded = list(producer.regions[0].blocks[0].operations)[-1].operands[0]
        if len(view.low) or len(view.high) or not is_zero(yielded):
            return None
        low = list(view.static_low)[axis]
        return low, low + producer.operands[0].type.shape[axis]
    if producer.name == "tensor.insert_slice":
        view = producer.opview
        if len(view.offsets) or len(view.sizes) or len(view.strides) or not is_zero(producer.operands[1]):
            return None
        if list(view.static_strides)[axis] != 1:
            return None
        offset = list(view.static_offsets)[axis]
        return offset, offset + list(view.static_sizes)[axis]
    return None


def _sum_of(expr, n_dims: int):
    """([operand positions], constant) of an affine expression that is a sum of dims,
    symbols and constants, each once with coefficient 1; None otherwise."""
    if isinstance(expr, ir.AffineDimExpr):
        return [expr.position], 0
    if isinstance(expr, ir.AffineSymbolExpr):
        return [n_dims + expr.position], 0
    if isinstance(expr, ir.AffineConstantExpr):
        return [], expr.value
    if isinstance(expr, ir.AffineAddExpr):
        lhs, rhs = _sum_of(expr.lhs, n_dims), _sum_of(expr.rhs, n_dims)
        if lhs is None or rhs is None:
            return None
        return lhs[0] + rhs[0], lhs[1] + rhs[1]
    return None


def _terms(value: ir.Value) -> tuple[list[ir.Value], int]:
    """`value` as a sum of values and a constant, through affine.apply sums and constants."""
    producer = defining_op(value)
    if producer is not None and producer.name == "arith.constant":
        return [], ir.IntegerAttr(producer.attributes["value"]).value
    if producer is not None and producer.name == "affine.apply":
        amap = ir.AffineMapAttr(producer.attributes["map"]).value
        parsed = _sum_of(amap.results[0], amap.n_dims) if len(amap.results) == 1 else None
        if parsed is not None:
            values, constant = [], parsed[1]
            for position in parsed[0]:
                more, c = _terms(producer.operands[position])
                values += more
                constant += c
            return values, constant
    return [value], 0


def _offset_terms(image: ir.Value, axis: int):
    """(Z, [offset values], constant) of the extract_slice chain from the padded image Z to
    `image` along `axis` (rank kept by every slice), or None."""
    values, constant = [], 0
    while True:
        producer = defining_op(image)
        if producer is None or producer.name != "tensor.extract_slice":
            return image, values, constant
        view = producer.opview
        if len(producer.operands[0].type.shape) != len(image.type.shape):
            return None
        if list(view.static_strides)[axis] != 1:
            return None
        static = list(view.static_offsets)[axis]
        if static == ir.ShapedType.get_dynamic_size():
            dynamic = [i for i, s in enumerate(view.static_offsets)
                       if s == ir.ShapedType.get_dynamic_size()]
            more, c = _terms(list(view.offsets)[dynamic.index(axis)])
            values += more
            constant += c
        else:
            constant += static
        image = producer.operands[0]


def _index(value: int) -> ir.Value:
    return arith.ConstantOp(ir.IndexType.get(), value).result


def _clamp(loop: ir.Operation, terms: list[ir.Value], constant: int, lo: int, hi: int) -> None:
    """Bounds of `loop` clamped to [lo - b, hi - b), b = sum(terms) + constant."""
    with ir.InsertionPoint(loop), loop.location:
        base = _index(constant)
        for t in terms:
            base = arith.AddIOp(base, t).result
        first = arith.MaxSIOp(loop.operands[0], arith.SubIOp(_index(lo), base).result).result
        last = arith.MinSIOp(loop.operands[1], arith.SubIOp(_index(hi), base).result).result
    loop.operands[0] = first
    loop.operands[1] = last


def clamp(op: ir.Operation) -> int:
    """Clamp the window loops of `op` that read padding (module docstring); how many."""
    try:
        dims = convolution_dims(op, static=False)  # the lanes of an edge tile are dynamic
    except NotConvolution:
        return 0
    ls = loop_structure(op)
    reductions = sorted(ls.reduction_dims)
    loops = _enclosing_loops(op, len(reductions))
    if loops is None:
        return 0
    loop_of = dict(zip(reductions, loops))
    image = op.operands[dims.input_index]
    clamped = 0
    for axis, we in dims.exprs.items():
        if we.window is None or we.dilation != 1 or we.window not in loop_of:
            continue
        if ls.ranges[we.window] != 1 or ls.ranges[we.image] != 1:
            continue
        found = _offset_terms(image, axis)
        if found is None:
            continue
        z, terms, constant = found
        real = _real_range(z, axis)
        loop = loop_of[we.window]
        iv = loop.regions[0].blocks[0].arguments[0]
        taps = [t for t in terms if t == iv]
        rest = [t for t in terms if t != iv]
        if real is None or len(taps) != 1 or any(_is_inside(t, loop) for t in rest):
            continue
        if real == (0, z.type.shape[axis]):
            continue  # no padding along this dim
        _clamp(loop, rest, constant, *real)
        clamped += 1
    return clamped


class ClampWindowLoopsOp(TransformExt.Operation, name="clamp_window_loops"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for target in payload_ops(state, op.target):
                    clamp(target)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def clamp_window_loops(target: ir.Value) -> ClampWindowLoopsOp:
    """Clamp the window loops around the one-tap convolution tiles in `target` to the taps
    that read the unpadded image (module docstring)."""
    return ClampWindowLoopsOp(target)
