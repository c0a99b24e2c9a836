"""deduplicate_generics: linalg.generics that compute the same values become one.

Two linalg.generic ops A (first) and B (later) of one block compute the same values when
they read the same input values through the same indexing maps, have the same iterators,
result types and attributes, their bodies are the same ops on corresponding values, and
neither body reads its output arguments (every loop parallel; the inits then only give the
result's shape and type). CSE cannot merge them when their inits differ, as after
`fuse_into_containing_op` clones one producer twice into a forall, once for a reader inside
and once for a result the forall yields (the f16 query block of an attention whose widened
Q the backward also reads: its scores and row max were computed twice, and the online
softmax found two row maxima). Every use of B becomes a use of A (A is before B in the
block, so it dominates B's uses) and B is erased; a `cse` after it merges their readers.

Targets: the linalg.generics nested in the target ops (any may be merged; nothing is
illegal). The target handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import RewritesTargets, Success, body_of, iterator_kinds, payload_ops, walk_ops
from .dialect import TransformExt

_STRUCTURAL = ("indexing_maps", "iterator_types", "operandSegmentSizes")


def _reads_outputs(op: ir.Operation) -> bool:
    view = op.opview
    args = list(body_of(op).arguments)[len(view.inputs):]
    return any(list(a.uses) for a in args)


def _attributes(op: ir.Operation) -> list[tuple[str, str]]:
    attrs = op.attributes
    return sorted((attrs[i].name, str(attrs[i].attr)) for i in range(len(attrs)))


def _same_bodies(a: ir.Operation, b: ir.Operation) -> bool:
    block_a, block_b = body_of(a), body_of(b)
    ops_a, ops_b = list(block_a.operations), list(block_b.operations)
    if len(ops_a) != len(ops_b):
        return False
    mapping = {arg: other for arg, other in zip(block_a.arguments, block_b.arguments)}
    for x, y in zip(ops_a, ops_b):
        x, y = x.operation, y.operation
        if x.name != y.name or len(x.regions) or len(y.regions) \
                or len(x.operands) != len(y.operands) or _attributes(x) != _attributes(y) \
                or [r.type for r in x.results] != [r.type for r in y.results]:
            return False
        if any(mapping.get(u, u) != v for u, v in zip(x.operands, y.operands)):
            return False
        mapping.update(zip(x.results, y.results))
    return True


def same_values(a: ir.Operation, b: ir.Operation) -> bool:
    """Whether generics `a` and `b` compute the same values (module docstring)."""
    va, vb = a.opview, b.opview
    return (list(va.inputs) == list(vb.inputs)
            and [r.type for r in a.results] == [r.type for r in b.results]
            and set(iterator_kinds(a)) == {"parallel"} and iterator_kinds(b) == iterator_kinds(a)
            and all(str(a.attributes[k]) == str(b.attributes[k]) for k in _STRUCTURAL[:2])
            and [p for p in _attributes(a) if p[0] not in _STRUCTURAL]
            == [p for p in _attributes(b) if p[0] not in _STRUCTURAL]
            and not _reads_outputs(a) and not _reads_outputs(b) and _same_bodies(a, b))


def duplicates(ops: list[ir.Operation]) -> list[tuple[ir.Operation, ir.Operation]]:
    """(B, A) pairs: B, later in its block, computes what A does (A is kept)."""
    kept: list[ir.Operation] = []
    pairs = []
    for op in ops:
        first = next((k for k in kept if k.block == op.block and same_values(k, op)), None)
        if first is None:
            kept.append(op)
        else:
            pairs.append((op, first))
    return pairs


class DeduplicateGenericsOp(TransformExt.Operation, name="deduplicate_generics"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for target in payload_ops(state, op.target):
                    generics = walk_ops(target, lambda o: o.name == "linalg.generic")
                    for later, first in duplicates(generics):
                        rewriter.replace_op(later, list(first.results))
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def deduplicate_generics(target: ir.Value) -> DeduplicateGenericsOp:
    """Merge the generics nested in `target` that compute the same values (module docstring)."""
    return DeduplicateGenericsOp(target)


__all__ = ["DeduplicateGenericsOp", "deduplicate_generics", "same_values"]
