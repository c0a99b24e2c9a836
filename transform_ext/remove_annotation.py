"""remove_annotation: the inverse of transform.annotate, on whole regions.

Every op nested in (or equal to) the target ops loses its discardable attribute `name`, if
it has one: the markers a schedule wrote with transform.annotate for its own later steps
(roles, vector sizes, fusion levels) leave no trace in the IR. Ops without the attribute
are left alone. `name` must be dialect-prefixed (`lh.mm_role`), as discardable attributes
are: an op's own (inherent) attributes have no dot in their names, and removing one would
break the op; another name is a silenceable failure at the first target, nothing removed.
The handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import Illegal, RewritesTargets, Success, fail, payload_ops, walk_ops
from .dialect import TransformExt

NAME = "transform_ext.remove_annotation"


class RemoveAnnotationOp(TransformExt.Operation, name="remove_annotation"):
    target: ext.Operand[transform.AnyOpType]
    attribute: ir.StringAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                name = ir.StringAttr(op.attribute).value
                targets = payload_ops(state, op.target)
                if "." not in name and targets:
                    return fail(NAME, Illegal(targets[0], f"'{name}' is not a dialect-prefixed "
                                                          f"(discardable) attribute name"))
                marked = [o for t in targets for o in walk_ops(t, lambda o: name in o.attributes)]
                for o in marked:
                    del o.attributes[name]
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def remove_annotation(target: ir.Value, name: str) -> RemoveAnnotationOp:
    """Remove the attribute `name` from every op in `target` (see the module docstring)."""
    return RemoveAnnotationOp(target, ir.StringAttr.get(name))


__all__ = ["RemoveAnnotationOp", "remove_annotation"]
