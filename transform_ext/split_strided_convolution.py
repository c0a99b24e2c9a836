"""split_strided_convolution: a convolution strided along its innermost image dim becomes one
convolution of stride 1 per phase of its image along that dim, accumulating in turn.

Along the innermost image dim of X (stride s > 1, dilation d, window K, output extent O):

    Y[o] = I[o] + sum_k X[o s + k d] W[k]

The taps k with k d = p (mod s) read phase p of X, X_p[w] = X[w s + p]: they are
k = k0 + t m (m < M_p, t = s / gcd(d, s)), reading X_p[o + b + m e] with e = t d / s and
b = (k0 d - p) / s. X is deinterleaved once into X_s[.., p, w] = X[.., w s + p] (a
linalg.generic; X zero-padded to a multiple of s first), and

    Y_0 = I,   Y_{p+1} = Y_p + sum_m X_s[.., p, o + b + m e] W[k0 + t m]   (phases with taps)

each a convolution of stride 1 and dilation e along that dim (the other dims keep their
strides) whose accumulator is the previous phase's result, so that the register tile of
each reads contiguous image rows. Exact: the same products, summed phase by phase (a
reassociation of the sum over k).

Targets: convolutions (transform_ext.analysis.convolution) whose image's innermost dim is an
image dim of stride > 1. Otherwise a silenceable failure naming the op and the reason,
nothing rewritten. Result `phases`: the phase convolutions (linalg.generic), first phase
first. The target handle is consumed.
"""

from math import gcd

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .analysis.convolution import NotConvolution, convolution_dims
from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, build_generic, clone_body, fail,
                     i64_array, payload_ops, strided_slice, zero_padded)
from .dialect import TransformExt

NAME = "transform_ext.split_strided_convolution"


def analyze(op: ir.Operation):
    """(dims, position of the strided image dim in X) of a legal target; Illegal otherwise."""
    try:
        dims = convolution_dims(op)
    except NotConvolution as exc:
        raise Illegal(op, f"is not a convolution ({exc})") from None
    x_map = loop_structure(op).maps[dims.input_index]
    last = len(x_map.results) - 1
    if last not in dims.exprs:
        raise Illegal(op, "the innermost dim of its image is not an image dim")
    if dims.exprs[last].stride == 1:
        raise Illegal(op, "its innermost image dim has stride 1")
    for v in op.operands:
        if not isinstance(v.type, ir.RankedTensorType):
            raise Illegal(op, f"has an operand of type {v.type} (wants ranked tensors)")
    return dims, last


def lane_phases(K: int, d: int, s: int) -> list[tuple[int, int, int, int, int]]:
    """(p, k0, M, t, e) of the phases with taps (module docstring), p ascending."""
    t = s // gcd(d, s)
    out = []
    for p in range(s):
        taps = [k for k in range(K) if (k * d) % s == p]
        if taps:
            out.append((p, taps[0], len(taps), t, t * d // s))
    return out


def _deinterleave(x: ir.Value, axis: int, s: int) -> ir.Value:
    """X_s[.., p, w] = X[.., w s + p] along `axis` (X zero-padded to a multiple of s)."""
    t = x.type
    shape = list(t.shape)
    rank = len(shape)
    width = -(-shape[axis] // s)
    high = [0] * rank
    high[axis] = width * s - shape[axis]
    x = zero_padded(x, [0] * rank, high)
    out_shape = shape[:axis] + [s, width] + shape[axis + 1:]
    empty = tensor.EmptyOp(out_shape, t.element_type).result
    n = rank + 1
    dims = [ir.AffineDimExpr.get(i) for i in range(n)]
    in_exprs = dims[:axis] + [dims[axis + 1] * s + dims[axis]] + dims[axis + 2:]
    maps = [ir.AffineMap.get(n, 0, in_exprs), ir.AffineMap.get_identity(n)]
    return build_generic([x], [empty], maps, ["parallel"] * n, lambda args: [args[0]]).results[0]


def rewrite(op: ir.Operation, dims, position: int, rewriter) -> list[ir.Operation]:
    ls = loop_structure(op)
    x_map, w_map, y_map = ls.maps[dims.input_index], ls.maps[dims.filter_index], ls.output_map(0)
    we = dims.exprs[position]
    K = dims.ranges[we.window] if we.window is not None else 1
    s, O = we.stride, dims.ranges[we.image]
    w_axis = [e.position for e in w_map.results].index(we.window) if we.window is not None else None
    x, w = op.operands[dims.input_index], op.operands[dims.filter_index]
    block = op.regions[0].blocks[0]
    phases = []
    with ir.InsertionPoint(op), op.location:
        x_s = _deinterleave(x, position, s)
        acc = op.operands[2]
        s_shape = list(x_s.type.shape)
        for p, k0, M, t, e in lane_phases(K, we.dilation, s):
            b = (k0 * we.dilation - p) // s
            sizes = s_shape[:position] + [1, O + (M - 1) * e] + s_shape[position + 2:]
            offsets = [0] * len(s_shape)
            offsets[position], offsets[position + 1] = p, b
            row_shape = sizes[:position] + sizes[position + 1:]
            image = tensor.ExtractSliceOp(
                ir.RankedTensorType.get(row_shape, x.type.element_type), x_s, [], [], [],
                i64_array(offsets), i64_array(sizes), i64_array([1] * len(sizes))).result
            w_q = w
            if w_axis is not None:
                shape = list(w.type.shape)
                w_offsets, w_sizes, w_strides = [0] * len(shape), list(shape), [1] * len(shape)
                w_offsets[w_axis], w_sizes[w_axis], w_strides[w_axis] = k0, M, t
                w_q = strided_slice(w, w_offsets, w_sizes, w_strides)
            expr = ir.AffineDimExpr.get(we.image)
            if we.window is not None:
                expr = expr + ir.AffineDimExpr.get(we.window) * e
            exprs = list(x_map.results)
            exprs[position] = expr
            maps = [None, None, y_map]
            maps[dims.input_index] = ir.AffineMap.get(x_map.n_dims, 0, exprs)
            maps[dims.filter_index] = w_map
            inputs = [None, None]
            inputs[dims.input_index], inputs[dims.filter_index] = image, w_q

            def body(args):
                return clone_body(op, dict(zip(block.arguments, args)))

            conv = build_generic(inputs, [acc], maps, ls.iterators, body)
            acc = conv.results[0]
            phases.append(conv.operation)
    rewriter.replace_op(op, [acc])
    return phases


class SplitStridedConvolutionOp(TransformExt.Operation, name="split_strided_convolution"):
    target: ext.Operand[transform.AnyOpType]
    phases: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    checked = [(t, *analyze(t)) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                phases = []
                for target, dims, position in checked:
                    phases += rewrite(target, dims, position, rewriter)
                results.set_ops(op.phases, phases)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def split_strided_convolution(target: ir.Value) -> ir.Value:
    """Split the convolutions in `target` strided along their innermost image dim into
    phases; returns the phase convolutions."""
    return SplitStridedConvolutionOp(target).phases


__all__ = ["SplitStridedConvolutionOp", "split_strided_convolution", "lane_phases", "analyze"]
