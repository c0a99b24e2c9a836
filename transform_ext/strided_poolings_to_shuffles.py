"""strided_poolings_to_shuffles: one window tap of a pooling tile as a load and a shuffle.

A pooling tile with one window tap (every reduction loop of extent 1) whose only loop of
extent > 1 is W output lanes along the innermost dims of its output and its input,
    y[w] = combine(y[w], x[s * w])        for w < W (stride s),
reads every s-th element of its input slice. The vectorizer unrolls a named 1-D pooling
of stride s > 1 into W one-lane extracts and combines (its convolution path steps the
outputs one by one), and leaves a linalg.generic with such a window map (torch-mlir's
3-D pooling: x[.., 2 * d3 + 3 * d6]) scalar. Here the tile becomes
    v = vector.transfer_read x[0, .., 0] : vector<1x..x((W-1)*s+1)>  (one contiguous read)
    p = vector.shuffle v, v [0, s, 2s, ..., (W-1)*s] : vector<W>     (the strided lanes;
                                                                      none for s = 1)
    y' = body(p, y)                                                   (W lanes at once)
which LLVM lowers to whole-vector loads and lane permutes. The pooling's body (a max, min
or sum; the input widened by extf when the accumulator is wider) is applied lanewise: its
scalar arith ops are rebuilt on vectors of W lanes. Exact: the same ops on the same
elements. The window offsets and the dilation are in the slice (one tap).

Targets: nested in the target ops, named linalg.pooling_ncw_* ops of stride > 1 (the
vectorizer's shifted load covers stride 1) and linalg.generic ops, each with static tensor
operands, one result, reduction loops of extent 1, one lane loop as above (input 0 indexed
by s * w, plus a window tap (a reduction dim), in its innermost dim and by dims of extent 1
in the others, at least one of them a window o * s' + i * d' when the innermost has no tap
(the outer windows of a separated pooling, transform_ext.separate_pooling_windows); the
other inputs, a window's shape, unread) and a body of single-result
arith ops on the input and the accumulator. Other ops are left as they are; never fails.
The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform, vector

from .analysis.convolution import linear_terms
from .analysis.structure import loop_structure
from .common import RewritesTargets, Success, is_static_tensor, planned_ops
from .dialect import TransformExt

def pooling_tap(op: ir.Operation) -> tuple[int, int] | None:
    """(W, s) of a one-tap pooling tile (module docstring), None for any other op."""
    named = op.name.startswith("linalg.pooling_ncw_")
    if not (named or op.name == "linalg.generic") or len(op.results) != 1:
        return None
    if not all(is_static_tensor(v) for v in op.operands):
        return None
    ls = loop_structure(op)
    if not ls.is_static or not ls.reduction_dims or any(ls.ranges[d] != 1 for d in ls.reduction_dims):
        return None
    wide = [d for d, r in enumerate(ls.ranges) if r != 1]
    out_map, in_map = ls.output_map(), ls.maps[0]
    if len(wide) != 1 or not isinstance(out_map.results[-1], ir.AffineDimExpr) \
            or out_map.results[-1].position != wide[0]:
        return None
    lane = wide[0]
    terms = linear_terms(in_map.results[-1])
    if terms is None or lane not in terms or any(d != lane and d not in ls.reduction_dims for d in terms):
        return None
    window_taps = len(terms) > 1
    for expr in in_map.results[:-1]:
        others = linear_terms(expr)
        if (others is None and not isinstance(expr, ir.AffineConstantExpr)) \
                or (others is not None and lane in others):
            return None
        window_taps |= others is not None and len(others) > 1 and any(d in ls.reduction_dims for d in others)
    if not window_taps:
        return None
    in_shape = ir.RankedTensorType(op.operands[0].type).shape
    width, stride = ls.ranges[lane], terms[lane]
    if any(n != 1 for n in in_shape[:-1]) or in_shape[-1] < (width - 1) * stride + 1:
        return None
    if (named and stride == 1) or not _lanewise_body(op):
        return None
    return width, stride


def _lanewise_body(op: ir.Operation) -> bool:
    """Is the body of `op` single-result arith ops on the input and the accumulator?"""
    body = op.regions[0].blocks[0]
    known = {body.arguments[0], body.arguments[len(op.operands) - 1]}
    for inner in list(body.operations)[:-1]:
        if not inner.name.startswith("arith.") or len(inner.results) != 1 or inner.regions \
                or any(v not in known for v in inner.operands):
            return False
        known.add(inner.results[0])
    return list(body.operations)[-1].operands[0] in known


def _read(source: ir.Value, lanes: int, rank: int, zero: ir.Value) -> ir.Value:
    """The `lanes` first elements of the innermost dim of `source` (all other dims 1), as a
    1-D vector (`zero`: the index 0)."""
    elem = ir.RankedTensorType(source.type).element_type
    rows = vector.transfer_read(ir.VectorType.get([1] * (rank - 1) + [lanes], elem), source,
                                [zero] * rank, ir.AffineMap.get_minor_identity(rank, rank),
                                arith.constant(elem, 0.0), [True] * rank)
    return vector.shape_cast(ir.VectorType.get([lanes], elem), rows)


def _rewrite(op: ir.Operation, tap: tuple[int, int], rewriter) -> None:
    width, stride = tap
    x, init = op.operands[0], op.operands[len(op.operands) - 1]
    x_rank, out_rank = ir.RankedTensorType(x.type).rank, ir.RankedTensorType(init.type).rank
    out_elem = ir.RankedTensorType(init.type).element_type
    body = op.regions[0].blocks[0]
    with ir.InsertionPoint(op), op.location:
        zero = arith.constant(ir.IndexType.get(), 0)
        row = _read(x, (width - 1) * stride + 1, x_rank, zero)
        picked = row if stride == 1 else vector.shuffle(row, row, [w * stride for w in range(width)])
        lanes = {body.arguments[0]: picked,
                 body.arguments[len(op.operands) - 1]: _read(init, width, out_rank, zero)}
        for inner in list(body.operations)[:-1]:
            attrs = inner.attributes
            lanewise = ir.Operation.create(
                inner.name, results=[ir.VectorType.get([width], inner.results[0].type)],
                operands=[lanes[v] for v in inner.operands],
                attributes={attrs[i].name: attrs[i].attr for i in range(len(attrs))})
            lanes[inner.results[0]] = lanewise.results[0]
        combined = lanes[list(body.operations)[-1].operands[0]]
        rows = vector.shape_cast(ir.VectorType.get([1] * (out_rank - 1) + [width], out_elem), combined)
        written = vector.transfer_write(init.type, rows, init, [zero] * out_rank,
                                        ir.AffineMap.get_minor_identity(out_rank, out_rank),
                                        [True] * out_rank)
    rewriter.replace_op(op, [written])


class StridedPoolingsToShufflesOp(TransformExt.Operation, name="strided_poolings_to_shuffles"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for p, tap in planned_ops(state, op.target, pooling_tap):
                    _rewrite(p, tap, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def strided_poolings_to_shuffles(target: ir.Value) -> StridedPoolingsToShufflesOp:
    """Rewrite the one-tap pooling tiles nested in `target` (module docstring)."""
    return StridedPoolingsToShufflesOp(target)


__all__ = ["StridedPoolingsToShufflesOp", "strided_poolings_to_shuffles", "pooling_tap"]
