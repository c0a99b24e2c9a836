"""write_results_in_place: a result computed in a local buffer and copied whole into its
out-parameter through reshapes is computed in the out-parameter.

    %buf = memref.alloc() : memref<S>
    ..                                         (computes %buf)
    %v = memref.expand_shape / memref.collapse_shape %buf   (one or more reshapes)
    memref.copy %v, %out                       (%out a function argument)
  =>
    %buf = <the inverse reshapes of %out> : memref<S>
    ..

After buffer-results-to-out-params a result returned through a reshape (attention's
[B*H, S, D] -> [B, H, S, D], a unit batch dim folded by a schedule) ends as such a copy:
the kernel then writes the caller's tensor directly, with no second result-sized buffer
and no copy (on a GPU a host-side copy of device memory would need a kernel of its own).
Exact when nothing else reads or writes %out and nothing writes %buf after the copy: %out
then holds what the copy would have written. Legal for a copy directly in a function's
entry block when: %out is an argument of that block and the copy is its only use; its
source is a chain of memref.expand_shape / memref.collapse_shape ops, each result used
once, from a memref.alloc in the entry block; the buffer has a static shape, the identity
layout and the default memory space; every other user of the buffer lies (with its
function-level ancestor) before the copy, and none is a memref.copy.

Rewritten: every legal memref.copy directly in the entry block of the target functions; the
others are left alone. A target that is not a func.func is a silenceable failure (nothing
rewritten); a declaration has nothing to rewrite. The copies, reshapes and allocs are
erased; the target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import (Illegal, RewritesTargets, Success, block_ops, defining_op, fail,
                     payload_ops, users)
from .dialect import TransformExt

NAME = "transform_ext.write_results_in_place"
RESHAPES = ("memref.expand_shape", "memref.collapse_shape")


def _function_level(op: ir.Operation, block: ir.Block):
    """The ancestor of `op` (or `op`) directly in `block`, None when there is none."""
    while op is not None:
        if op.block == block:
            return op
        op = op.parent
    return None


def in_place_plan(copy: ir.Operation, func: ir.Operation):
    """(alloc, reshapes from the copy back to the alloc) when `copy` is legal (see the
    module docstring), else None."""
    entry = func.regions[0].blocks[0]
    source, out = copy.operands
    if not (isinstance(out, ir.BlockArgument) and out.owner == entry and len(list(out.uses)) == 1):
        return None
    chain, value = [], source
    while (owner := defining_op(value)) is not None and owner.name in RESHAPES \
            and len(list(value.uses)) == 1:
        chain.append(owner)
        value = owner.operands[0]
    alloc = defining_op(value)
    if not chain or alloc is None or alloc.name != "memref.alloc" or alloc.block != entry:
        return None
    buffer = ir.MemRefType(value.type)
    if (not buffer.has_static_shape or buffer.affine_map != ir.AffineMap.get_identity(buffer.rank)
            or buffer.memory_space is not None):
        return None
    order = block_ops(entry)
    others = [u for u in users(value) if u != chain[-1]]
    if any(u.name == "memref.copy" for u in others):
        return None
    for user in others:
        top = _function_level(user, entry)
        if top is None or order.index(top) > order.index(copy):
            return None
    return alloc, chain


def _inverse_reshape(reshape: ir.Operation, view: ir.Value) -> ir.Value:
    """The reshape undoing `reshape` (of a static identity-layout buffer), applied to `view`."""
    source = ir.MemRefType(reshape.operands[0].type)
    attrs = {"reassociation": reshape.attributes["reassociation"]}
    if reshape.name == "memref.expand_shape":
        name = "memref.collapse_shape"
    else:
        name = "memref.expand_shape"
        attrs["static_output_shape"] = ir.DenseI64ArrayAttr.get(list(source.shape))
    result = ir.MemRefType.get(list(source.shape), source.element_type)
    return ir.Operation.create(name, results=[result], operands=[view], attributes=attrs).result


class WriteResultsInPlaceOp(TransformExt.Operation, name="write_results_in_place"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a func.func")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for func in targets:
                    if not func.regions[0].blocks:
                        continue
                    entry = func.regions[0].blocks[0]
                    for copy in [o for o in block_ops(entry) if o.name == "memref.copy"]:
                        plan = in_place_plan(copy, func)
                        if plan is None:
                            continue
                        alloc, chain = plan
                        with ir.InsertionPoint(alloc), alloc.location:
                            view = copy.operands[1]
                            for reshape in chain:
                                view = _inverse_reshape(reshape, view)
                        rewriter.erase_op(copy)
                        for reshape in chain:
                            rewriter.erase_op(reshape)
                        rewriter.replace_op(alloc, [view])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def write_results_in_place(target: ir.Value) -> WriteResultsInPlaceOp:
    """Compute the reshaped results of the functions in `target` in their out-parameters."""
    return WriteResultsInPlaceOp(target)


__all__ = ["WriteResultsInPlaceOp", "in_place_plan", "write_results_in_place"]
