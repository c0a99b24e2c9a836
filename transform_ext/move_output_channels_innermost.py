"""move_output_channels_innermost: a convolution computed with its output channels as the
innermost dim of its filter and of its result, the result transposed back.

For a convolution (transform_ext.analysis.convolution) with one output channel dim f,
    Y[b, f, o] = I[b, f, o] + sum_{c, k} X[b, c, o s + k t] W[f, c, k]
(dims in any order within each operand) becomes
    W_t = W with f's axis moved last,   I_t = I with f's axis moved last,
    Y_t[b, o, f] = I_t[b, o, f] + sum_{c, k} X[b, c, o s + k t] W_t[c, k, f],
    Y = Y_t with its last axis moved back to f's place,
the first two moves `linalg.transpose`s (an axis moved past several others moves past
them collapsed into one, the result expanded back: the schedules transpose that in square
tiles), the last a linalg.generic over Y_t's dims that reads Y_t with the identity map
and writes Y through the permutation (the convolution
schedule tiles it with the convolution's output tiles, as an epilogue); the convolution
a linalg.generic whose loops are its parallel dims but f in order, then f, then its
reduction dims in order. When the convolution alone reads I and I is a fill or a
broadcast (a generic of parallel loops writing I through the identity map, each input
read along fewer dims, no linalg.index: the bias), I_t is that op rebuilt in the new
layout instead of a transpose: it stays a producer the schedule computes per register
tile, not a transposed copy of the whole start. Exact: the same
products summed in the same order per element. A vector along f is then contiguous in W_t
and Y_t: the convolution schedule's register tile can take the output channels as its
lanes when the image's innermost dim is narrow (a few masked lanes per row).

Targets: static convolutions with exactly one output channel dim, that dim not already
innermost in both the filter and the result; else a silenceable failure naming the op and
the reason, nothing rewritten. Result `convolution`: the rebuilt convolutions (their
results feed the transposes back). The target handle is consumed.
"""

import math

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .analysis.convolution import NotConvolution, convolution_dims
from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, build_generic, clone_body,
                     defining_op, fail, payload_ops, reassociation_attr, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.move_output_channels_innermost"
# attributes of named convolutions and generics that the rebuilt generic does not take over
_INHERENT = {"indexing_maps", "iterator_types", "operandSegmentSizes", "strides", "dilations",
             "linalg.memoized_indexing_maps"}


def _check(op: ir.Operation):
    try:
        dims = convolution_dims(op)
    except NotConvolution as exc:
        raise Illegal(op, f"is not a convolution ({exc})") from None
    for v in list(op.operands) + list(op.results):
        if not isinstance(v.type, ir.RankedTensorType):
            raise Illegal(op, f"has an operand or result of type {v.type} (wants ranked tensors)")
    if len(dims.out_channel) != 1:
        raise Illegal(op, f"has {len(dims.out_channel)} output channel dims (wants one)")
    f = dims.out_channel[0]
    ls = loop_structure(op)
    innermost = [ls.maps[dims.filter_index].results[-1], ls.output_map(0).results[-1]]
    if all(isinstance(e, ir.AffineDimExpr) and e.position == f for e in innermost):
        raise Illegal(op, f"has its output channel dim d{f} innermost already")
    return dims


def _to_last(values: list, axis: int) -> list:
    return [v for i, v in enumerate(values) if i != axis] + [values[axis]]


def _transposed(value: ir.Value, permutation: list[int]) -> ir.Value:
    """linalg.transpose of `value`: result dim i is `value`'s dim permutation[i]. An axis
    moved last past several others (a 3 x 3 filter's [F, C, 3, 3] -> [C, 3, 3, F]) moves
    past them collapsed into one, the result expanded back: [F, 9 C] -> [9 C, F] is a
    transpose the schedules tile in square blocks (transform_ext.analysis.tiles.
    transposed_dim), where [F, C, 3, 3] read F's lanes one element per 9 C."""
    t = value.type
    rank = len(permutation)
    axis = permutation[-1]
    if permutation == _to_last(list(range(rank)), axis) and rank - axis > 2:
        groups = [[i] for i in range(axis + 1)] + [list(range(axis + 1, rank))]
        flat = list(t.shape[:axis + 1]) + [math.prod(t.shape[axis + 1:])]
        collapsed = tensor.CollapseShapeOp(ir.RankedTensorType.get(flat, t.element_type),
                                           value, reassociation_attr(groups)).result
        moved = _transposed(collapsed, _to_last(list(range(axis + 2)), axis))
        shape = [t.shape[p] for p in permutation]
        back = [[i] for i in range(axis)] + [list(range(axis, rank - 1)), [rank - 1]]
        return tensor.ExpandShapeOp(ir.RankedTensorType.get(shape, t.element_type), moved,
                                    reassociation_attr(back), [], shape).result
    shape = [t.shape[p] for p in permutation]
    empty = tensor.EmptyOp(shape, t.element_type).result
    op = linalg.transpose(value, outs=[empty], permutation=permutation)
    return op.results[0] if isinstance(op, ir.OpView) else op


def _start_transposed(init: ir.Value, permutation: list[int]) -> ir.Value:
    """I_t (module docstring): the fill or broadcast computing I rebuilt with result dim i
    from I's dim permutation[i], else a linalg.transpose of I."""
    producer = defining_op(init)
    if producer is None or len(list(init.uses)) != 1:
        return _transposed(init, permutation)
    t = init.type
    shape = [t.shape[p] for p in permutation]
    if producer.name == "linalg.fill":
        fill = linalg.fill(producer.operands[0], outs=[tensor.EmptyOp(shape, t.element_type).result])
        return fill.results[0] if isinstance(fill, ir.OpView) else fill
    if producer.name != "linalg.generic" or len(producer.results) != 1 or \
            walk_ops(producer, lambda o: o.name == "linalg.index"):
        return _transposed(init, permutation)
    ls = loop_structure(producer)
    n = ls.num_loops
    inputs = list(producer.operands[:-1])
    # a broadcast: each input reads fewer dims than I has (a bias along the channels), so
    # the rebuilt op reads no whole tensor across its layout
    if any(it != "parallel" for it in ls.iterators) or \
            ls.output_map(0) != ir.AffineMap.get_identity(n) or \
            any(len(m.results) >= n for m in ls.maps[:len(inputs)]):
        return _transposed(init, permutation)
    # I's loop dim j is I_t's dim permutation.index(j)
    to_new = ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(permutation.index(j)) for j in range(n)])
    maps = [_renumbered(m, to_new) for m in ls.maps[:len(inputs)]] + [ir.AffineMap.get_identity(n)]
    block = producer.regions[0].blocks[0]

    def body(args):
        return clone_body(producer, dict(zip(block.arguments, args)))

    empty = tensor.EmptyOp(shape, t.element_type).result
    return build_generic(inputs, [empty], maps, ["parallel"] * n, body).results[0]


def _renumbered(amap: ir.AffineMap, to_old: ir.AffineMap, perm: list[int] | None = None) -> ir.AffineMap:
    """`amap` over the new dims (its results permuted by `perm`)."""
    results = [e.compose(to_old) for e in amap.results]
    if perm is not None:
        results = [results[p] for p in perm]
    return ir.AffineMap.get(to_old.n_dims, 0, results)


def _copied_back(value: ir.Value, back: list[int]) -> ir.Value:
    """A linalg.generic over `value`'s dims writing result dim i from `value`'s dim
    back[i] (the identity map reading it, the permutation writing)."""
    t = value.type
    n = len(t.shape)
    empty = tensor.EmptyOp([t.shape[b] for b in back], t.element_type).result
    maps = [ir.AffineMap.get_identity(n),
            ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(b) for b in back])]
    copy = build_generic([value], [empty], maps, ["parallel"] * n, lambda args: [args[0]])
    return copy.results[0]


def _axis_of(amap: ir.AffineMap, dim: int) -> int:
    return next(i for i, e in enumerate(amap.results)
                if isinstance(e, ir.AffineDimExpr) and e.position == dim)


def rewrite(op: ir.Operation, dims, rewriter) -> ir.Operation:
    """The convolution in channels-last form replacing `op` (module docstring)."""
    ls = loop_structure(op)
    f = dims.out_channel[0]
    parallel = [d for d in range(ls.num_loops) if ls.iterators[d] == "parallel" and d != f]
    reduction = [d for d in range(ls.num_loops) if ls.iterators[d] == "reduction"]
    order = parallel + [f] + reduction
    n = ls.num_loops
    # old dim d is new dim order.index(d): maps read the new dims through this one
    to_old = ir.AffineMap.get(n, 0, [ir.AffineDimExpr.get(order.index(d)) for d in range(n)])
    w_index, x_index = dims.filter_index, dims.input_index
    w_map, y_map = ls.maps[w_index], ls.output_map(0)
    w_perm = _to_last(list(range(len(w_map.results))), _axis_of(w_map, f))
    y_perm = _to_last(list(range(len(y_map.results))), _axis_of(y_map, f))
    back = [y_perm.index(i) for i in range(len(y_perm))]
    with ir.InsertionPoint(op), op.location:
        x, w, init = op.operands[x_index], op.operands[w_index], op.operands[2]
        maps = [None, None, None]
        maps[x_index] = _renumbered(ls.maps[x_index], to_old)
        maps[w_index] = _renumbered(w_map, to_old, w_perm)
        maps[2] = _renumbered(y_map, to_old, y_perm)
        inputs = [None, None]
        inputs[x_index], inputs[w_index] = x, _transposed(w, w_perm)
        block = op.regions[0].blocks[0]

        def body(args):
            return clone_body(op, dict(zip(block.arguments, args)))

        new = build_generic(inputs, [_start_transposed(init, y_perm)], maps,
                            [ls.iterators[d] for d in order], body)
        attrs = op.attributes
        for i in range(len(attrs)):
            if attrs[i].name not in _INHERENT:
                new.attributes[attrs[i].name] = attrs[i].attr
        result = _copied_back(new.results[0], back)
    rewriter.replace_op(op, [result])
    return new.operation


class MoveOutputChannelsInnermostOp(TransformExt.Operation, name="move_output_channels_innermost"):
    target: ext.Operand[transform.AnyOpType]
    convolution: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    checked = [(t, _check(t)) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.convolution, [rewrite(t, d, rewriter) for t, d in checked])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def move_output_channels_innermost(target: ir.Value) -> ir.Value:
    """Rewrite the convolutions of `target` with their output channels innermost (module
    docstring); returns the rebuilt convolutions."""
    return MoveOutputChannelsInnermostOp(target).convolution


__all__ = ["MoveOutputChannelsInnermostOp", "move_output_channels_innermost"]
