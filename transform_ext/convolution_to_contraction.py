"""convolution_to_contraction: a convolution with a window of one element is a contraction
over a strided slice of its image.

With every window dim k_i of extent 1 (k_i = 0), the image read X[.., o_i s_i + k_i t_i, ..]
is X_s[.., o_i, ..] with X_s = X[.., 0 : s_i O_i : s_i, ..] (tensor.extract_slice, strides
s_i), and the filter read W[.., k_i, ..] is W'[..] with W' = W without its unit window dims
(a rank-reducing tensor.extract_slice). The op is rebuilt as a linalg.generic over the other
dims, reading X_s and W' through projected permutations, with the same body:

    Y[b, g, f, o] += X[b, g, c, o s + k t] W[g, f, c, k]  (k = 0)
    ->  Y[b, g, f, o] += W'[g, f, c] X_s[b, g, c, o]

which linalg's vectorizer takes (a convolution's window expressions it does not). The
convolution schedule tiles the window dims by 1 first, so the register tile of a
convolution is this contraction, vectorized as the matmul micro-kernel.

Targets: convolutions (transform_ext.analysis.convolution: named linalg conv ops or
generics of that form) on ranked static tensors whose window dims all have extent 1 (else
a silenceable failure naming the op and the reason, nothing rewritten). Result:
`contraction`, the rebuilt generics. The target handle is consumed.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, tensor, transform

from .analysis.convolution import NotConvolution, convolution_dims
from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, build_generic, clone_body,
                     defining_op, fail, i64_array, payload_ops, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.convolution_to_contraction"
# attributes of named convolutions and generics that the rebuilt generic does not take over
_INHERENT = {"indexing_maps", "iterator_types", "operandSegmentSizes", "strides", "dilations",
             "linalg.memoized_indexing_maps"}


def _check(op: ir.Operation):
    try:
        dims = convolution_dims(op, static=False)
    except NotConvolution as exc:
        raise Illegal(op, f"is not a convolution ({exc})") from None
    wide = [f"d{k}" for k in dims.window if k is not None and dims.ranges[k] != 1]
    if wide:
        raise Illegal(op, f"has window dims of extent other than 1 ({', '.join(wide)}; tile "
                          f"them by 1 first)")
    for v in list(op.operands) + list(op.results):
        if not isinstance(v.type, ir.RankedTensorType):
            raise Illegal(op, f"has an operand or result of type {v.type} (wants ranked tensors)")
    return dims


def _size(value: ir.Value, axis: int):
    """The extent of `value` along `axis`: an int when static, else a tensor.dim."""
    t = value.type
    if not t.is_dynamic_dim(axis):
        return t.get_dim_size(axis)
    return tensor.DimOp(value, arith.ConstantOp(ir.IndexType.get(), axis).result).result


def _slice(source: ir.Value, sizes: list, strides: list[int], keep: list[bool]) -> ir.Value:
    """tensor.extract_slice of `source` at offset 0 with these sizes (ints, or index values
    when dynamic) and strides, dropping the dims where `keep` is False (they have size 1)."""
    t = source.type
    dynamic = ir.ShapedType.get_dynamic_size()
    static = [s if isinstance(s, int) else dynamic for s in sizes]
    result = ir.RankedTensorType.get([s for s, k in zip(static, keep) if k], t.element_type)
    rank = len(sizes)
    return tensor.ExtractSliceOp(result, source, [], [s for s in sizes if not isinstance(s, int)],
                                 [], i64_array([0] * rank), i64_array(static),
                                 i64_array(strides)).result


def rewrite(op: ir.Operation, dims, rewriter) -> ir.Operation:
    """The contraction replacing convolution `op` (module docstring)."""
    ls = loop_structure(op)
    dropped = {k for k in dims.window if k is not None}
    kept = [d for d in range(ls.num_loops) if d not in dropped]
    new_dim = {d: i for i, d in enumerate(kept)}

    def dim(d):
        return ir.AffineDimExpr.get(new_dim[d])

    with ir.InsertionPoint(op), op.location:
        x, w, y = (op.operands[dims.input_index], op.operands[dims.filter_index], op.operands[2])
        x_map, w_map = ls.maps[dims.input_index], ls.maps[dims.filter_index]
        y_map = ls.output_map(0)
        y_axis = {e.position: axis for axis, e in enumerate(y_map.results)}
        sizes, strides, x_exprs = [], [], []
        for pos, e in enumerate(x_map.results):
            if pos in dims.exprs:
                we = dims.exprs[pos]
                sizes.append(_size(y, y_axis[we.image]))
                strides.append(we.stride)
                x_exprs.append(dim(we.image))
            else:
                sizes.append(_size(x, pos))
                strides.append(1)
                x_exprs.append(dim(e.position))
        x_slice = _slice(x, sizes, strides, [True] * len(sizes))
        w_keep = [e.position not in dropped for e in w_map.results]
        w_slice = w if all(w_keep) else _slice(
            w, [_size(w, axis) for axis in range(len(w_keep))], [1] * len(w_keep), w_keep)
        w_exprs = [dim(e.position) for e in w_map.results if e.position not in dropped]
        y_exprs = [dim(e.position) for e in y_map.results]
        n = len(kept)
        # the broadcast operand first: the filter, unless it indexes the output's innermost
        # dim (its lanes: the output channels, transform_ext.move_output_channels_innermost)
        lanes = y_exprs[-1]
        first, second = (w_slice, w_exprs), (x_slice, x_exprs)
        if lanes in w_exprs:
            first, second = second, first
        maps = [ir.AffineMap.get(n, 0, exprs) for exprs in (first[1], second[1], y_exprs)]
        iterators = [ls.iterators[d] for d in kept]
        block = op.regions[0].blocks[0]
        x_arg, w_arg, y_arg = (block.arguments[dims.input_index],
                               block.arguments[dims.filter_index], block.arguments[2])

        def body(args):  # named convolutions hold the same multiply-accumulate region
            w_new, x_new = (args[0], args[1]) if first[0] is w_slice else (args[1], args[0])
            yielded = clone_body(op, {w_arg: w_new, x_arg: x_new, y_arg: args[2]})
            _broadcast_operand_first(args[0])
            return yielded

        new = build_generic([first[0], second[0]], [y], maps, iterators, body)
        attrs = op.attributes
        for i in range(len(attrs)):
            if attrs[i].name not in _INHERENT:
                new.attributes[attrs[i].name] = attrs[i].attr
    rewriter.replace_op(op, list(new.results))
    return new.operation


def _broadcast_operand_first(arg: ir.Value) -> None:
    """Swap the operands of the body's multiplication (exact: it commutes) so that the
    element (possibly extended) of block argument `arg` comes first: linalg's vectorizer
    makes the first factor the lhs of the vector.contract, the operand whose elements are
    broadcast."""
    for mul in walk_ops(arg.owner.owner, lambda o: o.name == "arith.mulf"):
        first = mul.operands[0]
        owner = defining_op(first)
        while owner is not None and owner.name in ("arith.extf", "arith.truncf"):
            first = owner.operands[0]
            owner = defining_op(first)
        if first != arg:
            a, b = mul.operands[0], mul.operands[1]
            mul.operands[0], mul.operands[1] = b, a


class ConvolutionToContractionOp(TransformExt.Operation, name="convolution_to_contraction"):
    target: ext.Operand[transform.AnyOpType]
    contraction: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    checked = [(t, _check(t)) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.contraction, [rewrite(t, d, rewriter) for t, d in checked])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def convolution_to_contraction(target: ir.Value) -> ir.Value:
    """Rebuild the unit-window convolutions of `target` as contractions; returns them."""
    return ConvolutionToContractionOp(target).contraction


__all__ = ["ConvolutionToContractionOp", "convolution_to_contraction"]
