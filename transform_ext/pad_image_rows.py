"""pad_image_rows: a convolution reads its image from a buffer whose innermost dim is
`padding` elements longer.

    Y = conv(X, W), X [.., n]   ->   Y = conv(X', W), X' [.., n + p], X'[.., 0:n] = X

The elements past n are never read: the output's extents fix the taps a convolution reads,
and a linalg convolution's image may be longer than they need. Why: when the image's row
and channel strides are near multiples of the 4 KiB an L1 cache way spans, the rows one
register tile reads (its input channels and window rows) fall into a few of L1's sets,
which hold only as many lines as L1 has ways; each register tile then re-reads them from L2.
A longer row spreads them over the sets.

X' is built where X is:
- X = tensor.insert_slice x into linalg.fill(c) (torch-mlir's zero padding): the same
  fill and insert on a longer tensor (no extra pass);
- otherwise X is copied into the first n elements of each row of a longer tensor.empty.

Targets: linalg convolutions (transform_ext.analysis.convolution) with static shapes whose
image's innermost dim is an image dim; anything else is a silenceable failure naming the op
(nothing rewritten). The target handles stay valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .analysis.convolution import NotConvolution, convolution_dims
from .common import (Illegal, RewritesTargets, Success, defining_op, fail, i64_array,
                     payload_ops)
from .dialect import TransformExt

NAME = "pad_image_rows"


def _legal(op: ir.Operation) -> int:
    """The image operand's index, or Illegal."""
    try:
        dims = convolution_dims(op)
    except NotConvolution as exc:
        raise Illegal(op, f"not a convolution ({exc})") from None
    image = op.operands[dims.input_index]
    t = image.type
    if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape:
        raise Illegal(op, f"its image has type {t} (wants a static ranked tensor)")
    if t.rank - 1 not in dims.exprs:
        raise Illegal(op, "the innermost dim of its image is not an image dim")
    return dims.input_index


def _longer(t: ir.RankedTensorType, padding: int) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(t.shape[:-1]) + [t.shape[-1] + padding], t.element_type)


def filled_insert(image: ir.Value) -> tuple[ir.Operation, ir.Operation] | None:
    """(insert, fill) when `image` is x inserted into a linalg.fill (torch-mlir's zero
    padding: X' is then built longer, no copy), else None."""
    insert = defining_op(image)
    if insert is None or insert.name != "tensor.insert_slice":
        return None
    fill = defining_op(insert.operands[1])
    if fill is None or fill.name != "linalg.fill" or len(fill.operands) != 2:
        return None
    return insert, fill


def _padded_fill(image: ir.Value, padding: int) -> ir.Value | None:
    """X' of an X that is x inserted into a fill (module docstring), None otherwise."""
    found = filled_insert(image)
    if found is None:
        return None
    insert, fill = found
    view = insert.opview
    with ir.InsertionPoint(insert), insert.location:
        t = _longer(image.type, padding)
        empty = tensor.EmptyOp(t.shape, t.element_type).result
        filled = linalg.fill(fill.operands[0], outs=[empty])
        return tensor.InsertSliceOp(insert.operands[0], filled, list(view.offsets),
                                    list(view.sizes), list(view.strides),
                                    view.static_offsets, view.static_sizes,
                                    view.static_strides).result


def _copied(op: ir.Operation, image: ir.Value, padding: int) -> ir.Value:
    """X' holding a copy of X in the first elements of its rows."""
    t = image.type
    with ir.InsertionPoint(op), op.location:
        longer = _longer(t, padding)
        empty = tensor.EmptyOp(longer.shape, longer.element_type).result
        rank = t.rank
        return tensor.InsertSliceOp(image, empty, [], [], [], i64_array([0] * rank),
                                    i64_array(t.shape), i64_array([1] * rank)).result


def _erase_unused(value: ir.Value, rewriter) -> None:
    """Erase the op defining `value` when nothing reads its results, then its operands'
    producers in turn (the zero padding X' replaced)."""
    producer = defining_op(value)
    if producer is None or producer.name not in ("tensor.insert_slice", "linalg.fill",
                                                  "tensor.empty"):
        return
    if any(len(list(r.uses)) for r in producer.results):
        return
    operands = list(producer.operands)
    rewriter.erase_op(producer)
    for operand in operands:
        _erase_unused(operand, rewriter)


def pad(op: ir.Operation, index: int, padding: int, rewriter) -> None:
    """Read `op`'s image (operand `index`) from the longer X' (module docstring)."""
    image = op.operands[index]
    longer = _padded_fill(image, padding)
    if longer is None:
        longer = _copied(op, image, padding)
    op.operands[index] = longer
    _erase_unused(image, rewriter)


class PadImageRowsOp(TransformExt.Operation, name=NAME):
    target: ext.Operand[transform.AnyOpType]
    padding: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                padding = ir.IntegerAttr(op.padding).value
                targets = payload_ops(state, op.target)
                try:
                    indices = [_legal(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target, index in zip(targets, indices):
                    pad(target, index, padding, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def pad_image_rows(target: ir.Value, padding: int) -> PadImageRowsOp:
    """Read the images of the convolutions `target` from rows `padding` elements longer
    (module docstring)."""
    if padding < 1:
        raise ValueError(f"padding must be >= 1, got {padding}")
    return PadImageRowsOp(target, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), padding))


__all__ = ["PadImageRowsOp", "filled_insert", "pad_image_rows"]
