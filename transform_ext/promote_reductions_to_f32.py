"""promote_reductions_to_f32: an f16/bf16 reduction accumulates in f32 and rounds once.

For a linalg.generic reducing into an f16/bf16 result r = reduce(init, f(x)) (a sum, a
max, a contraction), as torch's CPU kernels compute it:

    r' = reduce_f32(extf(init), f_f32(x)),    r = truncf(r')

The body is recomputed in f32 (compute_elementwise_in_f32's widen_body: narrow block
arguments extended where read, narrow constants widened, extf/truncf pairs between them
folded, the narrow output arguments become f32 accumulators); each narrow init is extended
by an elementwise generic in front of the op, the result is f32 and an elementwise generic
after it rounds it back (round to nearest even) for its users. Other results are kept.
More exact than the narrow accumulation, never less: the rounding happens once.

A named pooling op (linalg.pooling_*, reducing a window: y = max/sum over the window of
x) is rebuilt as the same named op with the f32 init and result instead: its body casts the
narrow input itself (extf), and it stays the op the generic schedule decomposes and
vectorizes (a generic with its strided window map does not vectorize).

Targets: linalg.generic ops with results, a reduction iterator and an f16/bf16 result, and
named poolings with an f16/bf16 result (match_narrow_reductions finds them; else a
silenceable failure naming the op, nothing rewritten). The generics change in place, the
poolings are replaced by their f32 form through the rewriter (the handle follows them).
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .common import Illegal, RewritesTargets, Success, fail, payload_ops
from .compute_elementwise_in_f32 import is_narrow, widen_body
from .dialect import TransformExt
from .match_narrow_reductions import is_narrow_generic_reduction

NAME = "transform_ext.promote_reductions_to_f32"


def _map_tensor(value: ir.Value, out_type, fn) -> ir.Value:
    """An elementwise generic applying `fn` to every element of `value`."""
    rank = out_type.rank
    identity = ir.AffineMapAttr.get(ir.AffineMap.get_identity(rank))
    empty = tensor.EmptyOp(list(out_type.shape), out_type.element_type).result
    iters = ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * rank)
    g = linalg.GenericOp([out_type], [value], [empty], ir.ArrayAttr.get([identity, identity]), iters)
    block = g.regions[0].blocks.append(value.type.element_type, out_type.element_type)
    with ir.InsertionPoint(block):
        linalg.YieldOp([fn(block.arguments[0])])
    return g.result


# The named pooling ops (each has a builder of the same name in the linalg bindings).
NAMED_POOLINGS = tuple(f"linalg.{name}" for name in dir(linalg) if name.startswith("pooling_"))


def is_narrow_named_pooling(op: ir.Operation) -> bool:
    """A named linalg pooling op with an f16/bf16 result."""
    return (op.name in NAMED_POOLINGS and len(op.results) == 1
            and is_narrow(op.results[0].type.element_type))


def _promote_pooling(op: ir.Operation, rewriter) -> None:
    """Rebuild the narrow pooling `op` with an f32 init and result, rounded after it."""
    f32 = ir.F32Type.get()
    narrow_t = op.results[0].type
    wide_t = ir.RankedTensorType.get(list(narrow_t.shape), f32, narrow_t.encoding)
    build = getattr(linalg, op.name.removeprefix("linalg."))
    window = {k: list(ir.DenseIntElementsAttr(op.attributes[k])) for k in ("strides", "dilations")}
    with ir.InsertionPoint(op), op.location:
        init = _map_tensor(op.opview.outputs[0], wide_t, lambda a: arith.extf(f32, a))
        wide = build(*op.opview.inputs, outs=[init], **window)
        back = _map_tensor(wide, narrow_t, lambda a: arith.truncf(narrow_t.element_type, a))
    rewriter.replace_op(op, [back])


def promote(op: ir.Operation) -> None:
    """Accumulate the narrow reduction `op` in f32 (see the module docstring)."""
    f32 = ir.F32Type.get()
    n_in = len(op.opview.inputs)
    widen_body(op, round_results=False)
    # outputs: f32 init, f32 result, truncated back after the op
    for k in range(len(op.results)):
        r = op.results[k]
        if not is_narrow(r.type.element_type):
            continue
        narrow_t = r.type
        wide_t = ir.RankedTensorType.get(list(narrow_t.shape), f32, narrow_t.encoding)
        init_index = n_in + k
        with ir.InsertionPoint(op), op.location:
            init = op.operands[init_index]
            op.operands[init_index] = _map_tensor(init, wide_t, lambda a: arith.extf(f32, a))
        r.set_type(wide_t)
        with ir.InsertionPoint.after(op), op.location:
            back = _map_tensor(r, narrow_t, lambda a: arith.truncf(narrow_t.element_type, a))
        r.replace_all_uses_except(back, back.owner.operation)


class PromoteReductionsToF32Op(TransformExt.Operation, name="promote_reductions_to_f32"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context, op.location:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if not (is_narrow_generic_reduction(target)
                                or is_narrow_named_pooling(target)):
                            raise Illegal(target, "not a linalg.generic or named pooling "
                                                  "reducing into an f16 or bf16 result")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    if target.name == "linalg.generic":
                        promote(target)
                    else:
                        _promote_pooling(target, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def promote_reductions_to_f32(target: ir.Value) -> PromoteReductionsToF32Op:
    """Accumulate the narrow reductions of `target` (generics, named poolings) in f32."""
    return PromoteReductionsToF32Op(target)


__all__ = ["PromoteReductionsToF32Op", "promote_reductions_to_f32", "promote",
           "is_narrow_named_pooling", "NAMED_POOLINGS"]
