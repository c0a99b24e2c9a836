"""unmask_extremum_reductions: a masked max/min vector.multi_reduction reduces its source
with the masked-off lanes set to the reduction's neutral element instead.

    %r = vector.mask %m { vector.multi_reduction <maximumf>, %src, %acc [dims] }
      ->  %r = vector.multi_reduction <maximumf>, select(%m, %src, splat(-inf)), %acc [dims]

(+inf for minimumf / minnumf, -inf for maximumf / maxnumf). Exact: -inf never wins a max
(NaN still propagates through maximumf), +inf never wins a min. MLIR's LLVM lowering of a
masked max reduction sets the masked-off lanes to the negative smallest denormal, not
-inf: a max over negative values reduced through a partial vector (a pooling of a
convolution's output 1 lane wide, vectorized 16 wide) returned -1.4e-45 instead.

Targets: any ops; each vector.mask nested in them that wraps a single multi_reduction of
one of those kinds, has no passthru, and whose mask has the source's shape, is rewritten;
other masks are left alone (nothing is illegal). Result: none; the handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .common import RewritesTargets, Success, payload_ops, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.unmask_extremum_reductions"

_NEUTRAL = {"maximumf": float("-inf"), "maxnumf": float("-inf"),
            "minimumf": float("inf"), "minnumf": float("inf")}


def _kind(reduction: ir.Operation) -> str:
    return str(reduction.attributes["kind"]).split("<")[-1].rstrip(">")


def _unmaskable(mask_op: ir.Operation) -> ir.Operation | None:
    """The max/min multi_reduction a vector.mask may be unmasked from, else None."""
    body = [op.operation for op in mask_op.regions[0].blocks[0].operations]
    if len(body) != 2 or body[0].name != "vector.multi_reduction" or len(mask_op.operands) != 1:
        return None
    reduction = body[0]
    if _kind(reduction) not in _NEUTRAL:
        return None
    if list(ir.VectorType(mask_op.operands[0].type).shape) != \
            list(ir.VectorType(reduction.operands[0].type).shape):
        return None
    return reduction


def unmask(root: ir.Operation, rewriter) -> int:
    """Rewrite the masked max/min reductions under `root`; returns how many."""
    count = 0
    for mask_op in walk_ops(root, lambda o: o.name == "vector.mask"):
        reduction = _unmaskable(mask_op)
        if reduction is None:
            continue
        source = reduction.operands[0]
        vtype = ir.VectorType(source.type)
        with ir.InsertionPoint(mask_op), mask_op.location:
            splat = ir.DenseElementsAttr.get_splat(
                vtype, ir.FloatAttr.get(vtype.element_type, _NEUTRAL[_kind(reduction)]))
            kept = arith.select(mask_op.operands[0], source, arith.constant(vtype, splat))
            clone = reduction.clone()
            clone.operands[0] = kept
        rewriter.replace_op(mask_op, list(clone.results))
        count += 1
    return count


class UnmaskExtremumReductionsOp(TransformExt.Operation, name="unmask_extremum_reductions"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for t in payload_ops(state, op.target):
                    unmask(t, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def unmask_extremum_reductions(target: ir.Value) -> UnmaskExtremumReductionsOp:
    """Reduce the masked max/min reductions under `target` over their source with the
    masked-off lanes at the neutral element (module docstring)."""
    return UnmaskExtremumReductionsOp(target)


__all__ = ["UnmaskExtremumReductionsOp", "unmask_extremum_reductions", "unmask"]
