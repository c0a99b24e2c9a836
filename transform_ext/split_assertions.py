"""split_assertions: a generic computing results and checking assertions becomes two.

torch-mlir guards index reads (the cross-entropy target gather, embedding) with `cf.assert`
inside linalg.generic bodies, which keeps the whole op from vectorizing. A generic

    %r = linalg.generic ins(%x...) outs(%o) { body with cf.assert(p(x, i), msg) }

over loops D becomes, in front of it, a result-less generic over the loops K the inputs
index (K within D; a loop only the output indexes would repeat the same check) that only
evaluates the assertions' backward slice,

    linalg.generic ins(%x...) { cf.assert(p(x, i), msg) }     (maps of %x renumbered to K)

and the original without its cf.asserts. The same checks run on the same values, once per
point of K; the op that does the work vectorizes.

Targets: every result-producing linalg.generic holding a cf.assert nested in (or equal to)
the target ops. Splittable when the assertions read no output (accumulator) argument and no
loop index outside K; nested generics that are not are left alone, a target that is
itself one is a silenceable failure (nothing rewritten). The target handle is only read.
"""


from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, transform

from .common import (Illegal, RewritesTargets, Success, clone_op, defining_op, fail, payload_ops,
                     walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.split_assertions"


def holds_assertions(op: ir.Operation) -> bool:
    """A result-producing linalg.generic whose body holds a cf.assert."""
    return op.name == "linalg.generic" and len(op.results) > 0 and any(
        inner.operation.name == "cf.assert" for inner in op.regions[0].blocks[0].operations)


def _asserts(generic: ir.Operation) -> list[ir.Operation]:
    return [o.operation for o in generic.regions[0].blocks[0].operations
            if o.operation.name == "cf.assert"]


def _backward_slice(roots: list[ir.Operation], body: ir.Block) -> list[ir.Operation]:
    """The ops of `body` that the `roots` depend on, and the roots."""
    wanted = list(roots)
    frontier = list(wanted)
    while frontier:
        op = frontier.pop()
        for v in op.operands:
            owner = defining_op(v)
            if owner is not None and owner.parent == body.owner \
                    and owner not in wanted:
                wanted.append(owner)
                frontier.append(owner)
    return wanted


def _checked_loops(generic: ir.Operation) -> list[int]:
    """K: the loops the inputs' maps index."""
    view = generic.opview
    maps = list(view.indexing_maps)[: len(view.inputs)]
    return sorted({r.position for m in maps for r in m.value.results
                   if isinstance(r, ir.AffineDimExpr)})


def unsplittable_reason(generic: ir.Operation) -> str | None:
    """Why the assertions cannot be split out, or None."""
    body = generic.regions[0].blocks[0]
    needed = _backward_slice(_asserts(generic), body)
    n_inputs = len(generic.opview.inputs)
    if any(isinstance(v, ir.BlockArgument) and v.arg_number >= n_inputs
           for o in needed for v in o.operands):
        return "its assertions read the accumulator"
    indexed = {ir.IntegerAttr(o.attributes["dim"]).value for o in needed if o.name == "linalg.index"}
    if not indexed <= set(_checked_loops(generic)):
        return "its assertions read a loop index no input bounds"
    return None


def split(generic: ir.Operation, erase=lambda op: op.erase()) -> None:
    """Split a splittable `generic` (see the module docstring); `erase(op)` erases its
    cf.asserts (the rewriter's erase_op inside a transform op)."""
    view = generic.opview
    inputs = list(view.inputs)
    maps = list(view.indexing_maps)[: len(inputs)]
    body = generic.regions[0].blocks[0]
    asserts = _asserts(generic)
    needed = _backward_slice(asserts, body)
    kept = _checked_loops(generic)
    n_loops = len(view.iterator_types)
    renumber = ir.AffineMap.get(len(kept), 0, [
        ir.AffineDimExpr.get(kept.index(d)) if d in kept else ir.AffineConstantExpr.get(0)
        for d in range(n_loops)])
    check_maps = [ir.AffineMapAttr.get(ir.AffineMap.get(len(kept), 0, [
        r.compose(renumber) for r in m.value.results])) for m in maps]
    kinds = ir.ArrayAttr.get([view.iterator_types[d] for d in kept])
    with ir.InsertionPoint(generic), generic.location:
        check = linalg.GenericOp([], inputs, [], ir.ArrayAttr.get(check_maps), kinds)
        block = check.regions[0].blocks.append(*[v.type.element_type for v in inputs])
        mapping = {body.arguments[i]: block.arguments[i] for i in range(len(inputs))}
        with ir.InsertionPoint(block):
            for o in body.operations:
                if o.operation not in needed:
                    continue
                clone = clone_op(o.operation, mapping)
                if clone.name == "linalg.index":
                    dim = ir.IntegerAttr(clone.attributes["dim"]).value
                    clone.attributes["dim"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                                 kept.index(dim))
            linalg.YieldOp([])
    for a in asserts:
        erase(a)


class SplitAssertionsOp(TransformExt.Operation, name="split_assertions"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if holds_assertions(target) and (reason := unsplittable_reason(target)):
                            raise Illegal(target, reason)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                found = [g for t in targets for g in walk_ops(t, holds_assertions)
                         if unsplittable_reason(g) is None]
                for generic in found:
                    split(generic, rewriter.erase_op)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def split_assertions(target: ir.Value) -> SplitAssertionsOp:
    """Split the cf.asserts out of the result-producing generics nested in `target`."""
    return SplitAssertionsOp(target)


__all__ = ["SplitAssertionsOp", "split_assertions", "split", "holds_assertions",
           "unsplittable_reason"]
