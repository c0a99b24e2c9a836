"""What kind of computation a linalg op is: elementwise, contraction, reduction (and with
which combiner). Used by the matcher op `filter_ops` and by schedules."""

from __future__ import annotations

from torch_mlir.dialects import linalg

from ..common import body_of, is_linalg, iterator_kinds, terminator, user_op
from .body import block_arg_number, body_slice, producer_in, strip_casts
from .maps import affine_map
from .structure import loop_structure

COMBINERS = {
    "add": ("arith.addf", "arith.addi"),
    "mul": ("arith.mulf", "arith.muli"),
    "max": ("arith.maximumf", "arith.maxnumf", "arith.maxsi", "arith.maxui"),
    "min": ("arith.minimumf", "arith.minnumf", "arith.minsi", "arith.minui"),
    "and": ("arith.andi",),
    "or": ("arith.ori",),
    "xor": ("arith.xori",),
}
# Casts looked through around a combiner: bool tensors stored as i8 reduce as
# extui(andi(trunci(x), trunci(acc))).
_CASTS = ("arith.extui", "arith.extsi", "arith.trunci", "arith.extf", "arith.truncf")


def iterators(op) -> list[str]:
    op = getattr(op, "operation", op)
    return iterator_kinds(op) if op.name == "linalg.generic" else loop_structure(op).iterators


def is_elementwise(op) -> bool:
    """All loops parallel and every output written through a permutation map (linalg's own
    definition: broadcast inputs such as (d0, d1) -> (d0, 0) are fine; fill, copy and
    transpose count)."""
    op = getattr(op, "operation", op)
    if not is_linalg(op) or not len(op.results):
        return False
    if any(k != "parallel" for k in iterators(op)):
        return False
    maps = [affine_map(m) for m in linalg.get_indexing_maps(op)]
    return all(m.is_permutation for m in maps[len(maps) - len(op.results):])


def is_contraction(op) -> bool:
    """linalg's contraction interface: a sum over reduction dims of a product of two inputs
    (named matmuls and equivalent generics)."""
    op = getattr(op, "operation", op)
    return is_linalg(op) and linalg.isa_contraction_op(op)


def reduction_combiner(op) -> str | None:
    """The combiner kind (a key of COMBINERS) when `op` is a reduction with one result whose
    body yields combine(acc, t), t not reading acc and acc read nowhere else; else None."""
    op = getattr(op, "operation", op)
    if not is_linalg(op) or len(op.results) != 1 or "reduction" not in iterators(op):
        return None
    block = body_of(op)
    acc = block.arguments[len(block.arguments) - 1]
    y = strip_casts(block, terminator(block).operands[0], _CASTS)
    combine = producer_in(block, y)
    if combine is None or len(combine.operands) != 2:
        return None
    kind = next((k for k, names in COMBINERS.items() if combine.name in names), None)
    if kind is None:
        return None
    sides = [strip_casts(block, v, _CASTS) for v in combine.operands]
    acc_sides = [i for i, v in enumerate(sides) if v == acc]
    if len(acc_sides) != 1:
        return None
    other = combine.operands[1 - acc_sides[0]]
    n_acc = block_arg_number(block, acc)
    if n_acc in body_slice(block, [other]).args:
        return None
    # acc may only be read by the combiner (through its casts)
    for use in acc.uses:
        reader = user_op(use)
        if reader == combine:
            continue
        cast_users = list(reader.results[0].uses) if reader.name in _CASTS else []
        if len(cast_users) != 1 or user_op(cast_users[0]) != combine:
            return None
    return kind
