"""fold_empty_iteration_spaces: linalg ops that iterate over nothing become their inits.

A linalg op on tensors computes outs_k = F(ins, outs_k) by running its body once per point
of its iteration space. When a loop has extent 0 (an operand such as a [0, 16] softmax
input, cross-entropy with N = 0, a matmul with K = 0), the body never runs and every result
equals its init operand: `%r = linalg.generic ... outs(%init)` is replaced by `%init`.
Exact for every kind of linalg op (a reduction over an empty dim keeps its identity, e.g.
the zeros of a sum; an empty parallel dim gives an empty result), and it leaves no
zero-size loop nest or zero-length vector for later stages.

linalg.pack and linalg.unpack have no loops of their own (no indexing maps): one whose
result has a static extent of 0 holds no element, so it equals its destination (two
tensors of one type without elements are the same value) and is replaced by it. Other linalg
ops without indexing maps (linalg.softmax, ...) are left alone.

Targets: every linalg op nested in the target ops (or equal to them) with a static loop
extent of 0, and every empty pack / unpack. Legality: the op has tensor semantics (one
result per init); an empty linalg op on buffers is a silenceable failure. The result handle
holds the targets (a target that was folded itself is dropped from it).
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, ReplacesTargets, Success, fail, is_nested_in, payload_ops, walk_ops
from .dialect import TransformExt


_RELAYOUTS = ("linalg.pack", "linalg.unpack")


def has_empty_iteration_space(op: ir.Operation) -> bool:
    if op.name in _RELAYOUTS:
        shaped = op.results[0].type if len(op.results) else op.operands[1].type
        return 0 in ir.ShapedType(shaped).shape
    return is_linalg_op(op) and linalg.get_indexing_maps(op) is not None \
        and 0 in loop_structure(op).ranges


def _inits(op: ir.Operation) -> list[ir.Value]:
    results = list(op.results)
    if not results:
        raise Illegal(op, "iterates over an empty space but works on buffers (no results to "
                          "replace)")
    # pack / unpack: (source, dest, padding value?, tile sizes...); others: inits last
    inits = [op.operands[1]] if op.name in _RELAYOUTS else list(op.operands)[-len(results):]
    if [v.type for v in inits] != [r.type for r in results]:
        raise Illegal(op, "its results do not have the types of its last operands (inits)")
    return inits


class FoldEmptyIterationSpacesOp(TransformExt.Operation, name="fold_empty_iteration_spaces"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                plan = []
                try:
                    for target in targets:
                        for empty in walk_ops(target, has_empty_iteration_space):
                            _inits(empty)
                            plan.append(empty)
                except Illegal as illegal:
                    return fail("transform_ext.fold_empty_iteration_spaces", illegal)
                # an op nested in a folded one goes with it (decided before rewriting)
                outermost = [e for e in plan if not any(is_nested_in(e, other) for other in plan)]
                kept = [t for t in targets if not any(t == e for e in outermost)]
                # users first: an init produced by another folded op is still there
                for empty in reversed(outermost):
                    rewriter.replace_op(empty, _inits(empty))
                results.set_ops(op.result, kept)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def fold_empty_iteration_spaces(target: ir.Value) -> ir.Value:
    """Replace the linalg ops in `target` whose iteration space is empty by their inits."""
    return FoldEmptyIterationSpacesOp(target).result


__all__ = ["FoldEmptyIterationSpacesOp", "fold_empty_iteration_spaces",
           "has_empty_iteration_space"]
