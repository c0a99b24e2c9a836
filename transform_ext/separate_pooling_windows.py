"""separate_pooling_windows: a pooling over a window of 2 or 3 dims as two poolings, the
window's outer dims first, then its innermost dim on their result.

A max, min or sum pooling is separable: with windows along the input's innermost dim
(output w, stride s, taps j < k, dilation d) and outer dims (output rows o, taps i),
    y[.., o, w] = combine(y[.., o, w], combine_{i, j} f(x[.., o*s_o + i*d_o, w*s + j*d]))
               = combine(y[.., o, w], combine_j t[.., o, w*s + j*d]),
    t[.., o, u] = combine_i f(x[.., o*s_o + i*d_o, u])      for u < (W-1)*s + (k-1)*d + 1,
t starting from the combine's identity. The direct form reads, per tap, the strided lanes of
an input row (a load of (W-1)*s+1 lanes, a shuffle of every s-th, W lanes combined: KernelBench
45's 11 x 11 windows of stride 11 read each row 11 times for 5 useful lanes); t's taps read
whole rows (every lane useful), and only its k taps along w remain strided: kh*kw taps of
strided lanes become kh taps of whole rows and kw strided ones. A stride-1 max then meets
transform_ext.sliding_window_extrema along w. Extrema are exact in any order; a sum is
reassociated (columns first): another rounding within the same error bound.

Separated when the taps saved pay for t's round trip through memory: kh kw >= 2 (kh + kw),
kh the outer windows' taps (measured on this project's host: 2 x 2 and 3 x 3 windows of
stride 2 on rows of 56 and 112 ran 15% to 2.3x slower separated; 4 x 4, 3 x 3 x 3 and
larger windows 7% to 2.4x faster).

Targets: nested in the target ops, linalg.pooling_* and linalg.generic ops with static
tensor operands and one result, whose input 0 map holds, for every reduction dim, one
result o*s + i*d (o a parallel dim of the output, or none) and otherwise sums of parallel
dims or constants; the last result o*s + j*d with o in the output and j of extent > 1, and
another window of extent > 1; a body f(x) then a max, min or sum with the accumulator
(transform_ext/analysis/pooling.py); other inputs (a window's shape) unread. Other ops are
left as they are; never fails. The target handle is only read.
"""

import math
from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.convolution import linear_terms
from .analysis.pooling import EXTREMA, SUMS, PoolingBody, identity_attr, pooling_body
from .analysis.structure import loop_structure
from .common import (RewritesTargets, Success, build_generic, clone_op, is_static_tensor,
                     planned_ops, strided_slice)
from .dialect import TransformExt


@dataclass
class Separation:
    lane: int          # o_w: the output's dim along the input's innermost dim
    stride: int        # s
    window: int        # j
    dilation: int      # d
    span: int          # t's extent along the lane: (W-1)*s + (k-1)*d + 1
    terms: list        # per input 0 result: {dim: coefficient}, or a constant int
    body: PoolingBody  # f(x), then the combine


def separation(op: ir.Operation) -> Separation | None:
    """The plan for a separable pooling (module docstring), None for any other op."""
    if not (op.name.startswith("linalg.pooling_") or op.name == "linalg.generic") \
            or len(op.results) != 1 or not all(is_static_tensor(v) for v in op.operands):
        return None
    ls = loop_structure(op)
    if not ls.is_static or ls.num_inputs < 1 or len(op.operands) != ls.num_inputs + 1:
        return None
    out_map = ls.output_map()
    if not out_map.results or not all(isinstance(e, ir.AffineDimExpr) for e in out_map.results):
        return None
    out_dims = [e.position for e in out_map.results]
    reductions = set(ls.reduction_dims)
    terms, windows = [], []
    for expr in ls.maps[0].results:
        if isinstance(expr, ir.AffineConstantExpr):
            terms.append(expr.value)
            continue
        t = linear_terms(expr)
        if t is None:
            return None
        red = [d for d in t if d in reductions]
        if len(red) > 1 or (red and len(t) > 2):
            return None
        if red:
            windows.append((len(terms), red[0]))
        terms.append(t)
    if sorted(k for _, k in windows) != sorted(reductions):
        return None
    if not windows or windows[-1][0] != len(terms) - 1 or len(terms[-1]) != 2:
        return None
    last = terms[-1]
    window = windows[-1][1]
    (lane, stride), = [(d, c) for d, c in last.items() if d != window]
    if lane not in out_dims or ls.ranges[window] < 2 \
            or not any(ls.ranges[k] > 1 for _, k in windows[:-1]) \
            or any(lane in t for t in terms[:-1] if isinstance(t, dict)):
        return None
    outer_taps = math.prod(ls.ranges[k] for _, k in windows[:-1])
    if outer_taps * ls.ranges[window] < 2 * (outer_taps + ls.ranges[window]):
        return None
    body = pooling_body(op, EXTREMA + SUMS)
    if body is None:
        return None
    dilation = last[window]
    span = (ls.ranges[lane] - 1) * stride + (ls.ranges[window] - 1) * dilation + 1
    return Separation(lane, stride, window, dilation, span, terms, body)


def _expr(terms, position: dict[int, int]):
    """The affine expr of `terms` ({dim: coefficient} or a constant) over renumbered dims."""
    if isinstance(terms, int):
        return ir.AffineConstantExpr.get(terms)
    expr = None
    for d, c in terms.items():
        e = ir.AffineDimExpr.get(position[d])
        e = e if c == 1 else ir.AffineMulExpr.get(e, ir.AffineConstantExpr.get(c))
        expr = e if expr is None else ir.AffineAddExpr.get(expr, e)
    return expr


def _combine(body, value, acc):
    combine = body.combine
    operands = [value, acc] if body.input_first else [acc, value]
    return clone_op(combine, dict(zip(combine.operands, operands))).results[0]


def _window_shape(extents: list[int], dims: list[int], position: dict[int, int], loops: int):
    """An unread input that gives the window loops `dims` their `extents` (as a named
    pooling's window operand does), and its map."""
    shape = tensor.EmptyOp(extents, ir.F32Type.get()).result
    return shape, ir.AffineMap.get(loops, 0, [ir.AffineDimExpr.get(position[d]) for d in dims])


def _rewrite(op: ir.Operation, plan: Separation, rewriter) -> None:
    ls = loop_structure(op)
    body = plan.body
    x, init = op.operands[0], op.operands[len(op.operands) - 1]
    out_dims = [e.position for e in ls.output_map().results]
    acc_type = ir.RankedTensorType(init.type).element_type
    with ir.InsertionPoint(op), op.location:
        # t[.., o, u] = combine_i f(x[.., o*s_o + i*d_o, u]): every loop but j, o_w as u
        outer = [d for d in range(ls.num_loops) if d != plan.window]
        pos = {d: i for i, d in enumerate(outer)}
        x_shape = ir.RankedTensorType(x.type).shape
        x = strided_slice(x, [0] * len(x_shape), x_shape[:-1] + [plan.span], [1] * len(x_shape))
        x_map = ir.AffineMap.get(len(outer), 0, [_expr(t, pos) for t in plan.terms[:-1]]
                                 + [ir.AffineDimExpr.get(pos[plan.lane])])
        windows = [d for d in ls.reduction_dims if d != plan.window]
        shape, shape_map = _window_shape([ls.ranges[d] for d in windows], windows, pos, len(outer))
        t_map = ir.AffineMap.get(len(outer), 0, [ir.AffineDimExpr.get(pos[d]) for d in out_dims])
        t_shape = [plan.span if d == plan.lane else ls.ranges[d] for d in out_dims]
        empty = tensor.EmptyOp(t_shape, acc_type).result
        identity = arith.constant(acc_type, identity_attr(body.combine))
        t_init = linalg.fill(identity, outs=[empty])

        def outer_body(args):
            value = args[0]
            for inner in body.convert:
                value = clone_op(inner, {inner.operands[0]: value}).results[0]
            return [_combine(body, value, args[-1])]

        t = build_generic([x, shape], [t_init], [x_map, shape_map, t_map],
                          [ls.iterators[d] for d in outer], outer_body).results[0]
        # y[.., o, w] = combine_j t[.., o, w*s + j*d]: the parallel loops and j
        inner_dims = [d for d in range(ls.num_loops) if d in ls.parallel_dims or d == plan.window]
        pos = {d: i for i, d in enumerate(inner_dims)}
        read = {plan.lane: plan.stride, plan.window: plan.dilation}
        tw_map = ir.AffineMap.get(len(inner_dims), 0, [
            _expr(read, pos) if d == plan.lane else ir.AffineDimExpr.get(pos[d]) for d in out_dims])
        shape, shape_map = _window_shape([ls.ranges[plan.window]], [plan.window], pos, len(inner_dims))
        y_map = ir.AffineMap.get(len(inner_dims), 0, [ir.AffineDimExpr.get(pos[d]) for d in out_dims])
        y = build_generic([t, shape], [init], [tw_map, shape_map, y_map],
                          [ls.iterators[d] for d in inner_dims],
                          lambda args: [_combine(body, args[0], args[-1])]).results[0]
    rewriter.replace_op(op, [y])


class SeparatePoolingWindowsOp(TransformExt.Operation, name="separate_pooling_windows"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for p, plan in planned_ops(state, op.target, separation):
                    _rewrite(p, plan, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def separate_pooling_windows(target: ir.Value) -> SeparatePoolingWindowsOp:
    """Separate the poolings nested in `target` (module docstring) into their outer windows'
    pooling and their innermost window's."""
    return SeparatePoolingWindowsOp(target)


__all__ = ["SeparatePoolingWindowsOp", "separate_pooling_windows", "separation"]
