"""split_transposed_convolution: a convolution over an input stuffed with zeros becomes one
convolution over the input itself per phase of the output.

torch-mlir imports a transposed convolution of stride s as a convolution of stride 1 over Z,
the input x written with s - 1 zeros between neighbours (tensor.insert_slice of x into
zeros, strides s, at offset `off`, possibly followed by a tensor.expand_shape splitting the
channels into groups). Per image dim (dilation d, window K, output extent O):

    Y[o] = sum_k Z[o + k d] W[k],   Z[z] = x[(z - off) / s] if s divides z - off, else 0.

For the outputs o = q + s j of phase q (0 <= q < s, j < J_q = ceil((O - q) / s)), Z is
nonzero at o + k d only for the taps k = k0 + t m (m < M_q) with s | q + k d - off, where
t = s / gcd(d, s); there Z reads x[b + j + m e] with e = t d / s and
b = (q + k0 d - off) / s. So each phase is a convolution of stride 1 and dilation e over
X_q = x[b : b + J_q + (M_q - 1) e] (zero-padded where that leaves x) with the filter
W_q[m] = W[k0 + t m] (a strided slice of W):

    Y[q + s j] = I[q + s j] + sum_m X_q[j + m e] W_q[m]

over all image dims at once (s_1 ... s_d phases). Exact: the same terms, without the
products of stuffed zeros (a fraction 1 - 1/s^d of them). The phases read one zero-padded
copy of x over the union of their ranges [b, b + J_q + (M_q - 1) e) (zeros, x inserted
into them as a linalg.copy, an op a schedule can tile for threads), each X_q a slice of it.
A phase whose taps are empty in some dim is the accumulator start I alone: when there is
one, the result starts as I over all of Y (written contiguously, not strided phase by
phase) and only the phases with taps are written over it. Each phase writes the strided
slice Y[q :: s] of the result in place: its accumulator start is I's producer (a fill or
broadcast, cloned) over that slice of the result, or a slice of I itself.

Targets: convolutions (transform_ext.analysis.convolution) of stride 1 whose image is such
a Z: a tensor.insert_slice of static offsets, sizes and strides, stride > 1 in some image
dim, the whole of every other dim, into a constant zero (or a chain of them, each stuffing
other dims); possibly through a tensor.expand_shape that leaves the image dims alone. Otherwise a silenceable failure
naming the op and the reason, nothing rewritten. Result `phases`: the phase convolutions
(linalg.generic). The target handle is consumed.
"""


import itertools
from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.convolution import NotConvolution, convolution_dims
from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, ReplacesTargets, Success, build_generic, clone_body, defining_op,
                     fail, i64_array, is_zero, payload_ops, slice_strides, strided_slice,
                     zero_padded)
from .dialect import TransformExt

NAME = "transform_ext.split_transposed_convolution"


@dataclass(frozen=True)
class Phase:
    """One phase q of one image dim: J outputs, taps k0 + t m (m < M), dilation e, and
    the range [lo, hi] of x it reads."""

    q: int
    J: int
    k0: int
    M: int
    t: int
    e: int
    lo: int
    hi: int


@dataclass
class Stuffed:
    """A convolution over a stuffed input: the stuffing and, per window expression, the
    image dim's place in x and the conv's output."""

    op: ir.Operation
    dims: object
    x: ir.Value                    # the input before stuffing
    expand: ir.Operation | None    # the tensor.expand_shape between Z and the convolution
    x_axis: dict[int, int]         # position in the conv's image operand -> axis of x
    strides: dict[int, int]        # position -> the stuffing stride
    offsets: dict[int, int]        # position -> the stuffing offset


def analyze(op: ir.Operation) -> Stuffed:
    """The stuffing of a legal target; Illegal otherwise."""
    try:
        dims = convolution_dims(op)
    except NotConvolution as exc:
        raise Illegal(op, f"is not a convolution ({exc})") from None
    if any(s != 1 for s in dims.strides):
        raise Illegal(op, f"has strides {dims.strides} (wants 1: a convolution over a stuffed input)")
    image = op.operands[dims.input_index]
    producer = defining_op(image)
    expand = None
    if producer is not None and producer.name == "tensor.expand_shape":
        expand, image = producer, producer.operands[0]
        producer = defining_op(image)
    if producer is None or producer.name != "tensor.insert_slice":
        raise Illegal(op, "its image is not a tensor.insert_slice (of an input stuffed with zeros)")
    x, offsets, strides = _stuffing(op, producer)
    z_shape = list(producer.results[0].type.shape)
    if expand is not None:
        groups = [list(g) for g in ir.ArrayAttr(expand.attributes["reassociation"])]
        axis_of = {ir.IntegerAttr(p).value: j for j, g in enumerate(groups) for p in g}
        group_size = {j: len(g) for j, g in enumerate(groups)}
    else:
        axis_of = {p: p for p in range(len(z_shape))}
        group_size = {p: 1 for p in range(len(z_shape))}
    x_axis = {}
    for pos in dims.exprs:
        axis = axis_of[pos]
        if group_size[axis] != 1:
            raise Illegal(op, "the tensor.expand_shape before it reshapes an image dim")
        x_axis[pos] = axis
    image_axes = set(x_axis.values())
    for axis in range(len(z_shape)):
        if axis not in image_axes and axis in offsets:
            raise Illegal(op, f"its input is stuffed along dim {axis}, which is not an image dim")
    if all(strides.get(a, 1) == 1 for a in image_axes):
        raise Illegal(op, "its image is not stuffed (strides 1: a padded input)")
    return Stuffed(op, dims, x, expand, x_axis, {p: strides.get(a, 1) for p, a in x_axis.items()},
                   {p: offsets.get(a, 0) for p, a in x_axis.items()})


def _stuffing(op: ir.Operation, insert: ir.Operation):
    """(x, {dim: offset}, {dim: stride}) of Z = insert_slice(x into zeros), or of a chain of
    insert_slices into zeros each stuffing its own dims (x at `offset`, `stride` apart
    along a stuffed dim; every other dim whole); x of Z's rank."""
    offsets, strides = {}, {}
    value = insert.results[0]
    # (an insert that changes the rank, a reshape, ends the chain: x is its result)
    while insert is not None and insert.name == "tensor.insert_slice" and \
            insert.operands[0].type.rank == insert.results[0].type.rank:
        view = insert.opview
        if len(view.offsets) or len(view.sizes) or len(view.strides):
            raise Illegal(op, "its image's tensor.insert_slice has dynamic offsets, sizes or strides")
        if not is_zero(insert.operands[1]):
            raise Illegal(op, "its image's tensor.insert_slice writes into a tensor that is not zero")
        dest = list(insert.operands[1].type.shape)
        for axis, (o, z, t) in enumerate(zip(view.static_offsets, view.static_sizes,
                                             view.static_strides)):
            if (o, t, z) == (0, 1, dest[axis]):
                continue
            if axis in offsets:
                raise Illegal(op, f"its image is stuffed twice along dim {axis}")
            offsets[axis], strides[axis] = o, t
        value = insert.operands[0]
        insert = defining_op(value)
    return value, offsets, strides


def phases_of_dim(O: int, K: int, d: int, s: int, off: int) -> list[Phase]:
    """The phases of one image dim (module docstring) with at least one output."""
    out = []
    for q in range(s):
        J = len(range(q, O, s))
        if J == 0:
            continue
        taps = [k for k in range(K) if (q + k * d - off) % s == 0]
        if not taps:
            out.append(Phase(q, J, 0, 0, 1, 1, 0, 0))
            continue
        k0, M = taps[0], len(taps)
        t = taps[1] - taps[0] if M > 1 else 1
        e = t * d // s if M > 1 else 1
        b = (q + k0 * d - off) // s
        out.append(Phase(q, J, k0, M, t, e, b, b + J - 1 + (M - 1) * e))
    return out


def _window_of_x(x: ir.Value, axes: dict[int, tuple[int, int]]) -> ir.Value:
    """x over [lo, hi] along each image axis (`axes`: axis -> (lo, hi)), zero outside x."""
    shape = list(x.type.shape)
    offsets, sizes, low, high = [0] * len(shape), list(shape), [0] * len(shape), [0] * len(shape)
    for axis, (lo, hi) in axes.items():
        extent = hi - lo + 1
        first, last = max(lo, 0), min(hi, shape[axis] - 1)
        size = max(0, last - first + 1)
        if size == 0:
            offsets[axis], sizes[axis], low[axis], high[axis] = min(first, shape[axis]), 0, extent, 0
        else:
            offsets[axis], sizes[axis] = first, size
            low[axis], high[axis] = first - lo, hi - last
    part = strided_slice(x, offsets, sizes, [1] * len(shape))
    if not any(low) and not any(high) or 0 in sizes:
        return zero_padded(part, low, high)
    # zeros and x copied into their interior by linalg ops (a tensor.pad would be copied
    # by one thread)
    t = part.type
    padded = [n + lo + hi for n, lo, hi in zip(t.shape, low, high)]
    zero = arith.ConstantOp(t.element_type, ir.FloatAttr.get(t.element_type, 0.0)).result
    zeros = linalg.fill(zero, outs=[tensor.EmptyOp(padded, t.element_type).result])
    interior = strided_slice(zeros, low, list(t.shape), [1] * len(shape))
    copied = linalg.copy(part, outs=[interior])
    return tensor.InsertSliceOp(copied, zeros, [], [], [], i64_array(low), i64_array(list(t.shape)),
                                i64_array([1] * len(shape))).result


def _phase_window(union: ir.Value, union_lo: dict[int, int], axes: dict[int, Phase]) -> ir.Value:
    """X_q: the slice [lo, hi] of each phase axis out of `union`, x over [union_lo, ..]."""
    shape = list(union.type.shape)
    offsets, sizes = [0] * len(shape), list(shape)
    for axis, ph in axes.items():
        offsets[axis], sizes[axis] = ph.lo - union_lo[axis], ph.hi - ph.lo + 1
    return strided_slice(union, offsets, sizes, [1] * len(shape))


def _recomputable(producer: ir.Operation, y_strides) -> bool:
    """A fill, a broadcast, or an elementwise generic (identity output map) whose inputs
    do not vary along the strided dims: its clone over a slice of those dims computes the
    slice of its result."""
    if producer.name in ("linalg.fill", "linalg.broadcast"):
        return True
    if producer.name != "linalg.generic" or len(producer.results) != 1:
        return False
    ls = loop_structure(producer)
    if ls.reduction_dims or ls.output_map(0) != ir.AffineMap.get_identity(ls.num_loops):
        return False
    strided = {axis for axis, s in enumerate(y_strides) if s != 1}
    return all(not (set(dim_positions(m)) & strided) and m.is_projected_permutation
               for m in ls.maps[:ls.num_inputs])


def _init_over(init: ir.Value, dest: ir.Value, y_offsets, y_sizes, y_strides) -> ir.Value:
    """The accumulator start of one phase, written into `dest` (a slice of the result): a
    clone of I's producer when `_recomputable`, else I's own slice copied."""
    producer = defining_op(init)
    if producer is not None and len(list(init.uses)) == 1 and _recomputable(producer, y_strides):
        clone = producer.clone()
        clone.operands[len(clone.operands) - 1] = dest
        clone.results[0].set_type(dest.type)
        return clone.results[0]
    piece = strided_slice(init, y_offsets, y_sizes, y_strides)
    return linalg.copy(piece, outs=[dest])


def rewrite(st: Stuffed, rewriter) -> list[ir.Operation]:
    """Replace the target by its phases (module docstring); returns their convolutions."""
    op, dims = st.op, st.dims
    ls = loop_structure(op)
    x_map, w_map, y_map = (ls.maps[dims.input_index], ls.maps[dims.filter_index], ls.output_map(0))
    y = op.results[0]
    y_type = y.type
    per_dim = {pos: phases_of_dim(dims.ranges[we.image],
                                  dims.ranges[we.window] if we.window is not None else 1,
                                  we.dilation, st.strides[pos], st.offsets[pos])
               for pos, we in dims.exprs.items()}
    positions = list(dims.exprs)
    y_axis = {e.position: a for a, e in enumerate(y_map.results)}
    w_axis = {e.position: a for a, e in enumerate(w_map.results)}
    convs = []
    reach = {st.x_axis[p]: (min(ph.lo for ph in phases if ph.M), max(ph.hi for ph in phases if ph.M))
             for p, phases in per_dim.items() if any(ph.M for ph in phases)}
    with ir.InsertionPoint(op), op.location:
        union = None
        result = tensor.EmptyOp(list(y_type.shape), y_type.element_type).result
        combos = list(itertools.product(*(per_dim[p] for p in positions)))
        if not all(ph.M for combo in combos for ph in combo):
            shape = list(y_type.shape)
            result = _init_over(op.operands[2], result, [0] * len(shape), shape, [1] * len(shape))
        for combo in combos:
            phase = dict(zip(positions, combo))
            if not all(ph.M for ph in phase.values()):
                continue
            y_offsets, y_sizes, y_strides = [0] * len(y_type.shape), list(y_type.shape), [1] * len(y_type.shape)
            for pos, ph in phase.items():
                a = y_axis[dims.exprs[pos].image]
                y_offsets[a], y_sizes[a], y_strides[a] = ph.q, ph.J, st.strides[pos]
            y_strides = slice_strides(y_sizes, y_strides)
            dest = strided_slice(result, y_offsets, y_sizes, y_strides)
            init = _init_over(op.operands[2], dest, y_offsets, y_sizes, y_strides)
            if union is None:
                union = _window_of_x(st.x, reach)
            window = _phase_window(union, {a: lo for a, (lo, _) in reach.items()},
                                   {st.x_axis[pos]: ph for pos, ph in phase.items()})
            value = _phase_convolution(st, phase, window, init, x_map, w_map, y_map, w_axis)
            convs.append(defining_op(value))
            result = tensor.InsertSliceOp(value, result, [], [], [], i64_array(y_offsets), i64_array(y_sizes),
                                          i64_array(y_strides)).result
    rewriter.replace_op(op, [result])
    return convs


def _phase_convolution(st: Stuffed, phase: dict[int, Phase], window: ir.Value, init: ir.Value,
                       x_map, w_map, y_map, w_axis) -> ir.Value:
    """The convolution of one phase (all image dims' phases in `phase`) over its X_q."""
    op, dims = st.op, st.dims
    image = window
    if st.expand is not None:
        shape = list(st.expand.results[0].type.shape)
        for pos, ph in phase.items():
            shape[pos] = ph.hi - ph.lo + 1
        image = tensor.ExpandShapeOp(ir.RankedTensorType.get(shape, window.type.element_type), window,
                                     st.expand.attributes["reassociation"], [], i64_array(shape)).result
    w = op.operands[dims.filter_index]
    w_offsets, w_sizes, w_strides = [0] * len(w.type.shape), list(w.type.shape), [1] * len(w.type.shape)
    for pos, ph in phase.items():
        k = dims.exprs[pos].window
        if k is not None:
            a = w_axis[k]
            w_offsets[a], w_sizes[a], w_strides[a] = ph.k0, ph.M, ph.t
    w_q = strided_slice(w, w_offsets, w_sizes, w_strides)
    exprs = []
    for pos, e in enumerate(x_map.results):
        if pos in phase:
            we = dims.exprs[pos]
            expr = ir.AffineDimExpr.get(we.image)
            if we.window is not None:
                expr = expr + ir.AffineDimExpr.get(we.window) * phase[pos].e
            exprs.append(expr)
        else:
            exprs.append(e)
    n = x_map.n_dims
    maps = [None, None, y_map]
    maps[dims.input_index] = ir.AffineMap.get(n, 0, exprs)
    maps[dims.filter_index] = w_map
    inputs = [None, None]
    inputs[dims.input_index], inputs[dims.filter_index] = image, w_q
    block = op.regions[0].blocks[0]

    def body(args):
        return clone_body(op, dict(zip(block.arguments, args)))

    conv = build_generic(inputs, [init], maps, loop_structure(op).iterators, body)
    return conv.results[0]


class SplitTransposedConvolutionOp(TransformExt.Operation, name="split_transposed_convolution"):
    target: ext.Operand[transform.AnyOpType]
    phases: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    stuffed = [analyze(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                phases = []
                for st in stuffed:
                    phases += rewrite(st, rewriter)
                results.set_ops(op.phases, phases)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def split_transposed_convolution(target: ir.Value) -> ir.Value:
    """Split the convolutions over stuffed inputs in `target` into phases; returns the
    phase convolutions."""
    return SplitTransposedConvolutionOp(target).phases


__all__ = ["SplitTransposedConvolutionOp", "split_transposed_convolution", "phases_of_dim", "Phase",
           "analyze"]
