"""filter_ops: the payload ops of a handle that match a name list and/or a structure.

Keeps, in order, the ops of `target` (not their nested ops: use structured.match to walk)
that satisfy every given criterion:
  names        op name is one of them;
  structure    "elementwise": all loops parallel, outputs written through permutations
                   (transform_ext/analysis/classify.is_elementwise);
               "contraction": linalg's contraction interface (matmul-like sums of products);
               "reduction": one result, a reduction loop, and a body that yields
                   combine(acc, t) with one combiner, and not a contraction (a matmul is
                   an add-reduction of products: match it as a contraction); `combiner`
                   (add, mul, max, min, and, or, xor) restricts its kind. Casts around
                   the combiner are looked through (i8-stored bools reduce as
                   extui(andi(trunci x, trunci acc)));
               "reductions": a linalg op with results and a reduction loop that is not a
                   contraction, any number of results (merged sibling reductions).
The result may be empty (matching never fails). Read-only: the target handle stays valid.
"""

from typing import Sequence

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.classify import (COMBINERS, is_contraction, is_elementwise, is_linalg,
                                iterators, reduction_combiner)
from .common import MatchesPayload, Success, payload_ops
from .dialect import TransformExt

STRUCTURES = ("", "elementwise", "contraction", "reduction", "reductions")


def matches(op: ir.Operation, names: list[str], structure: str, combiner: str) -> bool:
    if names and op.name not in names:
        return False
    if structure == "elementwise":
        return is_elementwise(op)
    if structure == "contraction":
        return is_contraction(op)
    if structure == "reductions":
        return (is_linalg(op) and len(op.results) > 0 and "reduction" in iterators(op)
                and not is_contraction(op))
    if structure == "reduction":
        kind = reduction_combiner(op)
        return (kind is not None and (not combiner or kind == combiner)
                and not is_contraction(op))
    return True


class FilterOpsOp(TransformExt.Operation, name="filter_ops"):
    target: ext.Operand[transform.AnyOpType]
    names: ir.StringAttr  # comma-separated ('' = any)
    structure: ir.StringAttr
    combiner: ir.StringAttr
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                names = [n for n in ir.StringAttr(op.names).value.split(",") if n]
                structure = ir.StringAttr(op.structure).value
                combiner = ir.StringAttr(op.combiner).value
                targets = payload_ops(state, op.target)
                kept = [t for t in targets if matches(t, names, structure, combiner)]
                results.set_ops(op.result, kept)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return True

    Effects = MatchesPayload


def filter_ops(target: ir.Value, *, names: Sequence[str] = (), structure: str = "",
               combiner: str = "") -> ir.Value:
    """The ops of `target` matching all given criteria (see the module docstring)."""
    if isinstance(names, str):
        names = [names]
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES[1:]}, got {structure!r}")
    if combiner and combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {tuple(COMBINERS)}, got {combiner!r}")
    if combiner and structure != "reduction":
        raise ValueError("combiner= only applies with structure='reduction'")
    return FilterOpsOp(target, ir.StringAttr.get(",".join(names)),
                       ir.StringAttr.get(structure), ir.StringAttr.get(combiner)).result


def filter_by_name(target: ir.Value, names: str | Sequence[str]) -> ir.Value:
    return filter_ops(target, names=names)


def filter_elementwise(target: ir.Value) -> ir.Value:
    return filter_ops(target, structure="elementwise")


def filter_contractions(target: ir.Value) -> ir.Value:
    return filter_ops(target, structure="contraction")


def filter_reductions(target: ir.Value, combiner: str = "") -> ir.Value:
    return filter_ops(target, structure="reduction", combiner=combiner)


__all__ = ["FilterOpsOp", "filter_ops", "filter_by_name", "filter_elementwise",
           "filter_contractions", "filter_reductions", "matches"]
