"""accumulate_in_unpacked_output: a packed contraction whose packed result is only unpacked
accumulates in the unpacked output instead.

    %cp0 = linalg.fill ins(%v) outs(%packed_init)          %c0 = linalg.fill ins(%v) outs(%dest)
    %cp  = linalg.generic ins(%ap, %bp) outs(%cp0)    ->   %c  = linalg.generic' ins(%ap, %bp) outs(%c0)
    %c   = linalg.unpack %cp ... into %dest

The unpack places packed element [o_0, .., o_r-1, i_0, .., i_t-1] at dest[d] with, for a
dest dim d tiled by T_j (inner_dims_pos[j] = d) and packed as outer dim p(d) (outer_dims_perm),
d = o_p(d) T_j + i_j, else d = o_p(d). Without padding (every tiled dest dim equal to its
outer extent times T_j) that is a bijection between the packed and the unpacked elements, so
composing the generic's output map with it gives the same sums of the same terms in the same
order, written where the unpack would have put them: generic' is the generic with the output
map e_p(d) T_j + e_(r+j) (resp. e_p(d)), e the generic's map results. The packed result
never exists: the matmul schedule's register tiles then load and store their accumulators in
C itself across k blocks, with no C_p buffer and no unpack pass. generic' keeps the
generic's other attributes (library_call, doc, the schedule's marks).

Targets: linalg.unpack ops on static tensors, without padding, whose source is the single
result of a linalg.generic read by nothing else, with a projected-permutation output map
and an init that is a linalg.fill read by nothing else; otherwise a silenceable failure
naming the op, nothing rewritten. Results: the new generics, the new fills. The target
handle is consumed (the unpacks are erased, and the generics and fills they read).
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, transform

from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, build_generic, clone_body, defining_op, fail,
                     keep_attributes, payload_ops, users)
from .dialect import TransformExt

NAME = "transform_ext.accumulate_in_unpacked_output"


def _dest_dims(unpack: ir.Operation) -> list[tuple[int, int | None, int]]:
    """Per dim d of the unpack's destination: (p(d), the packed dim of its outer index; j,
    the index of its inner tile, or None when it is not tiled; T_j, else 1)."""
    def ints(name):
        return list(ir.DenseI64ArrayAttr(unpack.attributes[name])) if name in unpack.attributes else None

    rank = len(unpack.results[0].type.shape)
    positions, tiles = ints("inner_dims_pos"), ints("static_inner_tiles")
    perm = ints("outer_dims_perm") or list(range(rank))
    return [(perm.index(d), positions.index(d), tiles[positions.index(d)]) if d in positions
            else (perm.index(d), None, 1) for d in range(rank)]


def check_unpacked_accumulation(unpack: ir.Operation) -> tuple[ir.Operation, ir.Operation]:
    """The (generic, fill) a legal target unpacks; Illegal otherwise."""
    if unpack.name != "linalg.unpack":
        raise Illegal(unpack, "not a linalg.unpack")
    source, dest = unpack.operands[0], unpack.operands[1]
    if not all(isinstance(v.type, ir.RankedTensorType) and v.type.has_static_shape
               for v in (source, dest)):
        raise Illegal(unpack, "its source or destination is not a static tensor")
    generic = defining_op(source)
    if generic is None or generic.name != "linalg.generic" or len(generic.results) != 1:
        raise Illegal(unpack, "its source is not the single result of a linalg.generic")
    if len(users(generic.results[0])) != 1:
        raise Illegal(unpack, "the packed result is read by another op too")
    if not loop_structure(generic).output_map(0).is_projected_permutation:
        raise Illegal(unpack, "the generic's output map is not a projected permutation")
    fill = defining_op(generic.operands[-1])
    if fill is None or fill.name != "linalg.fill" or len(users(fill.results[0])) != 1:
        raise Illegal(unpack, "the generic's init is not a linalg.fill read by it alone")
    packed, shape = list(source.type.shape), list(dest.type.shape)
    for d, (p, _, tile) in enumerate(_dest_dims(unpack)):
        if tile < 0:
            raise Illegal(unpack, "its inner tiles are not static")
        if packed[p] * tile != shape[d]:
            raise Illegal(unpack, f"it drops padding along dim {d} ({packed[p] * tile} packed, "
                                  f"{shape[d]} unpacked)")
    return generic, fill


def unpacked_output_map(unpack: ir.Operation, packed_map: ir.AffineMap) -> ir.AffineMap:
    """The generic's output map `packed_map` composed with the unpack (module docstring)."""
    e = list(packed_map.results)
    rank = len(unpack.results[0].type.shape)
    return ir.AffineMap.get(packed_map.n_dims, 0, [
        e[p] if j is None else e[p] * ir.AffineConstantExpr.get(tile) + e[rank + j]
        for p, j, tile in _dest_dims(unpack)])


def _rewrite(unpack: ir.Operation, generic: ir.Operation, fill: ir.Operation, rewriter):
    ls = loop_structure(generic)
    block = generic.regions[0].blocks[0]
    with ir.InsertionPoint(unpack), unpack.location:
        init = linalg.fill(fill.operands[0], outs=[unpack.operands[1]])
        new = build_generic(list(generic.operands)[:-1], [init], list(ls.maps[:-1]) +
                            [unpacked_output_map(unpack, ls.output_map(0))], ls.iterators,
                            lambda args: clone_body(generic, dict(zip(block.arguments, args))),
                            name_from=generic)
    keep_attributes(generic, new.operation)
    rewriter.replace_op(unpack, new.operation)
    rewriter.erase_op(generic)
    rewriter.erase_op(fill)
    return new.operation, defining_op(init)


class AccumulateInUnpackedOutputOp(TransformExt.Operation, name="accumulate_in_unpacked_output"):
    target: ext.Operand[transform.AnyOpType]
    contraction: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    fill: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    legal = [check_unpacked_accumulation(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                contractions, fills = [], []
                for unpack, (generic, fill) in zip(targets, legal):
                    new, init = _rewrite(unpack, generic, fill, rewriter)
                    contractions.append(new)
                    fills.append(init)
                results.set_ops(op.contraction, contractions)
                results.set_ops(op.fill, fills)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def accumulate_in_unpacked_output(target: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Make the packed contractions unpacked by `target` accumulate in the unpacked output
    (module docstring); returns (the new contractions, their fills)."""
    op = AccumulateInUnpackedOutputOp(target)
    return op.contraction, op.fill


__all__ = ["AccumulateInUnpackedOutputOp", "accumulate_in_unpacked_output", "check_unpacked_accumulation",
           "unpacked_output_map"]
