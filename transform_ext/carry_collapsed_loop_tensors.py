"""carry_collapsed_loop_tensors: an scf.for tensor iter_arg that the body reads only through
`tensor.collapse_shape` and yields as `tensor.expand_shape` of the same reassociation (a
tile whose unit dims were folded) is carried collapsed.

    %r = scf.for .. iter_args(%a = %init) -> (tensor<W>) {
      %c = tensor.collapse_shape %a R : tensor<W> into tensor<N>     (every use of %a)
      ..
      %e = tensor.expand_shape %y R : tensor<N> into tensor<W>
      scf.yield %e
    }
  =>
    %i = tensor.collapse_shape %init R
    %r' = scf.for .. iter_args(%a' = %i) -> (tensor<N>) { .. (%c is %a') ..  scf.yield %y }
    %r = tensor.expand_shape %r' R : tensor<N> into tensor<W>

Exact: collapse and expand of one reassociation are inverse bijections of the elements, so
the loop carries the same values in the other shape (the expand left unused in the body is
for canonicalization to remove). Then the subset hoisting sees the tile's reads and writes
and carries it as a vector. Legal for an iter_arg when: it is a statically shaped tensor,
it has uses and all of them are collapse_shape ops with one reassociation R, and the value
yielded for it is an expand_shape with reassociation R.

Rewritten: the legal iter_args of every scf.for nested in (or equal to) the targets, to a
fixed point; other iter_args and loops are left alone, except that a target that is itself
an scf.for without a legal iter_arg is a silenceable failure (nothing rewritten). Loops are
rewritten in place (handles to them stay valid); the target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .common import (Illegal, RewritesTargets, Success, defining_op, fail, ops_named,
                     payload_ops, terminator, users)
from .dialect import TransformExt

NAME = "transform_ext.carry_collapsed_loop_tensors"


def collapsed_iter_arg(loop: ir.Operation, i: int):
    """(collapse users, yielded expand) when iter_arg `i` of `loop` is carried collapsed,
    else None."""
    body = loop.regions[0].blocks[0]
    arg = body.arguments[1 + i]
    if not isinstance(arg.type, ir.RankedTensorType) or not arg.type.has_static_shape:
        return None
    uses = users(arg)
    if not uses or any(u.name != "tensor.collapse_shape" for u in uses):
        return None
    reassociation = uses[0].attributes["reassociation"]
    if any(u.attributes["reassociation"] != reassociation for u in uses):
        return None
    expand = defining_op(terminator(body).operands[i])
    if (expand is None or expand.name != "tensor.expand_shape"
            or expand.attributes["reassociation"] != reassociation):
        return None
    return uses, expand


def _carry_collapsed(loop: ir.Operation, i: int, uses, expand, rewriter) -> None:
    body = loop.regions[0].blocks[0]
    arg = body.arguments[1 + i]
    reassociation = uses[0].attributes["reassociation"]
    collapsed_type = uses[0].results[0].type
    with ir.InsertionPoint(loop), loop.location:
        init = tensor.CollapseShapeOp(collapsed_type, loop.operands[3 + i], reassociation).result
    loop.operands[3 + i] = init
    arg.set_type(collapsed_type)
    for u in uses:
        rewriter.replace_op(u, [arg])
    terminator(body).operands[i] = expand.operands[0]
    result = loop.results[i]
    wide_type = result.type
    result_uses = list(result.uses)
    result.set_type(collapsed_type)
    with ir.InsertionPoint.after(loop), loop.location:
        wide = tensor.ExpandShapeOp(wide_type, result, reassociation, [],
                                    expand.attributes["static_output_shape"]).result
    for use in result_uses:
        use.owner.operands[use.operand_number] = wide


class CarryCollapsedLoopTensorsOp(TransformExt.Operation, name="carry_collapsed_loop_tensors"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name == "scf.for" and not any(
                                collapsed_iter_arg(target, i) for i in range(len(target.results))):
                            raise Illegal(target, "no tensor iter_arg is read only through "
                                                  "tensor.collapse_shape and yielded as "
                                                  "tensor.expand_shape of the same reassociation")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    changed = True
                    while changed:
                        changed = False
                        for loop in ops_named(target, "scf.for"):
                            for i in range(len(loop.results)):
                                found = collapsed_iter_arg(loop, i)
                                if found is not None:
                                    _carry_collapsed(loop, i, *found, rewriter)
                                    changed = True
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def carry_collapsed_loop_tensors(target: ir.Value) -> CarryCollapsedLoopTensorsOp:
    """Carry the collapsed tiles of the scf.for loops in `target` collapsed (in place)."""
    return CarryCollapsedLoopTensorsOp(target)


__all__ = ["CarryCollapsedLoopTensorsOp", "carry_collapsed_loop_tensors", "collapsed_iter_arg"]
