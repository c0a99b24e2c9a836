"""trim_unread_pooling_tails: a pooling of one window along an image dim reads the input
only through that window; the unread tail of the dim is sliced off first.

    y = linalg.pooling_nchw_max(x: [5, 3, 1, 5], w: [1, 4], strides [1, 3]) : [5, 3, 1, 1]
 -> y = linalg.pooling_nchw_max(x[:, :, :, 0:4], w, strides [1, 3])

Along an image dim with one output position the pooling reads x at k * d for k < K (window
extent K, dilation d): positions 0 .. (K - 1) d. Folding the unit output dim turns the read
o * s + k * d into k * d, a projection; the generic's loop extent is then inferred from x's
full extent as well as from the window's, and the op no longer verifies ("inferred
input/output operand #1 has shape's dimension #0 to be 5, but found 4": F.max_pool1d(y, 4,
3) of a row of 5 after a product, where the matmul schedule failed). With the tail sliced
off the two agree. The same elements are read: the result is unchanged.

Targets: the linalg.pooling_* ops (NCHW, NHWC, NCW, NWC, NCDHW, NDHWC layouts) on static
tensors nested in the target ops; only dims with one output position and an unread tail
are sliced. The targets are only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .common import RewritesTargets, Success, payload_ops, walk_ops
from .dialect import TransformExt

NAME = "trim_unread_pooling_tails"

# the image dims of each layout, in the window's order
_IMAGE_DIMS = {"nchw": [2, 3], "nhwc": [1, 2], "ncw": [2], "nwc": [1], "ncdhw": [2, 3, 4],
               "ndhwc": [1, 2, 3]}


def _layout(op: ir.Operation) -> str | None:
    if not op.name.startswith("linalg.pooling_"):
        return None
    layout = op.name[len("linalg.pooling_"):].split("_")[0]
    return layout if layout in _IMAGE_DIMS else None


def trimmed_shape(op: ir.Operation) -> list[int] | None:
    """The input shape `op` reads (module docstring), when smaller than the input's; else
    None."""
    layout = _layout(op)
    if layout is None or len(op.operands) != 3:
        return None
    image, window, out = (v.type for v in op.operands)
    if not all(isinstance(t, ir.RankedTensorType) and t.has_static_shape for t in (image, window, out)):
        return None
    dims = _IMAGE_DIMS[layout]
    dilations = [int(v) for v in ir.DenseIntElementsAttr(op.attributes["dilations"])] \
        if "dilations" in op.attributes else [1] * len(dims)
    shape = list(image.shape)
    for i, d in enumerate(dims):
        reach = (window.shape[i] - 1) * dilations[i] + 1
        if out.shape[d] == 1 and reach < shape[d]:
            shape[d] = reach
    return shape if shape != list(image.shape) else None


class TrimUnreadPoolingTailsOp(TransformExt.Operation, name=NAME):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                poolings = [p for target in payload_ops(state, op.target)
                            for p in walk_ops(target, lambda o: _layout(o) is not None)]
                found = [(p, shape) for p in poolings if (shape := trimmed_shape(p)) is not None]
                for pooling, shape in found:
                    image = pooling.operands[0]
                    with ir.InsertionPoint(pooling), pooling.location:
                        sliced = tensor.ExtractSliceOp(
                            ir.RankedTensorType.get(shape, image.type.element_type), image, [], [], [],
                            [0] * len(shape), shape, [1] * len(shape)).result
                    pooling.operands[0] = sliced
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def trim_unread_pooling_tails(target: ir.Value) -> None:
    """Slice off the unread tails of the poolings nested in `target` (module docstring)."""
    TrimUnreadPoolingTailsOp(target)


__all__ = ["TrimUnreadPoolingTailsOp", "trim_unread_pooling_tails", "trimmed_shape"]
