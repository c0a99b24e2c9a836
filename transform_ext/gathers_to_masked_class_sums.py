"""gathers_to_masked_class_sums: a gather from a matrix product reads a masked sum over its
columns.

A linalg.generic R (all loops parallel) reads in its body one element S[i, j] of
S = A B, a contraction with one m, one n and one k dim into zeros (the logits h W^T of a
linear layer; the target logit of a cross-entropy gathers S[r, y_r]), at a row index i
that is one of R's loop indices (linalg.index p) and a computed column index j. Since

    S[i, j] = sum_c (c == j ? S[i, c] : 0)     (c over S's columns; one term is S[i, j])

the extract becomes one more input of R, T[l] = that sum at R's loop point l, computed by
a new linalg.generic D over R's loops and c (a reduction): D's body computes j as R's body
does (the ops it depends on, cloned), compares it with c and adds S[i, c] or zero. D reads
S only along its columns, like the row max and the exp-sum of a log-softmax: it joins
their loop over column tiles when S is computed per tile, and no element of S is read at
a computed index (a GPU kernel then needs no scattered read of the logits). Exact: the
sum adds one element and zeros (select, not a product, so a non-finite S[i, c] elsewhere
in the row stays out).

Targets: functions; the gathers are the tensor.extract ops directly in the bodies of the
linalg.generic ops of their entry block, from a result of a linalg contraction of the
function with two inputs, one m, n and k dim each, a zero init and static shapes
(transform_ext.fold_gathers_through_contraction's gathers). Legality first (a silenceable
failure names the op, nothing rewritten): R's loops all parallel with static extents, its
output maps permutations, the row index a loop index of R, the column index computed from
R's inputs, loop indices and values defined outside R.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, RewritesTargets, Success, body_of, build_generic, clone_op,
                     defining_op, fail, payload_ops)
from .dialect import TransformExt
from .fold_gathers_through_contraction import _index_slice, gathered_contraction, plan, rewrite
from .fold_gathers_through_elementwise import check_has_body

NAME = "transform_ext.gathers_to_masked_class_sums"


def _row_loop(reader: ir.Operation, extract: ir.Operation) -> int:
    """The loop of `reader` whose index is the gather's row index; Illegal when the row
    index is no loop index of `reader` or S's columns are not its second dim."""
    row = defining_op(extract.operands[1])
    if row is None or row.name != "linalg.index" or row.parent != reader:
        raise Illegal(reader, "a gather's row index is not a loop index of its reader")
    sls = loop_structure(gathered_contraction(extract))
    if dim_positions(sls.output_map(0)).index(sls.contraction_dims()["n"][0]) != 1:
        raise Illegal(reader, "a gather from a contraction whose columns are not its second dim")
    return ir.IntegerAttr(row.attributes["dim"]).value


def _masked_sum(reader: ir.Operation, extract: ir.Operation) -> ir.Value:
    """D: the gathered element per loop point of `reader` (see the module docstring)."""
    source = gathered_contraction(extract)
    sls = loop_structure(source)
    rls = loop_structure(reader)
    n_loops = rls.num_loops
    row = _row_loop(reader, extract)
    column = extract.operands[2]
    slice_ops = _index_slice(reader, [column])
    block = body_of(reader)
    args_read = sorted({v.arg_number for op in slice_ops for v in op.operands
                        if isinstance(v, ir.BlockArgument) and v.owner == block} |
                       ({column.arg_number} if isinstance(column, ir.BlockArgument)
                        and column.owner == block else set()))
    extend = lambda m: ir.AffineMap.get(n_loops + 1, 0, list(m.results))
    s_map = ir.AffineMap.get(n_loops + 1, 0, [ir.AffineDimExpr.get(row),
                                               ir.AffineDimExpr.get(n_loops)])
    out_map = ir.AffineMap.get(n_loops + 1, 0, [ir.AffineDimExpr.get(d) for d in range(n_loops)])
    acc_type = ir.RankedTensorType(source.results[0].type).element_type
    index = ir.IndexType.get()
    with ir.InsertionPoint(reader), reader.location:
        empty = tensor.EmptyOp(list(rls.ranges), acc_type).result
        zero = arith.ConstantOp(acc_type, ir.FloatAttr.get(acc_type, 0.0)).result
        init = linalg.fill(zero, outs=[empty])
        inputs = [reader.operands[i] for i in args_read] + [source.results[0]]
        maps = [extend(rls.maps[i]) for i in args_read] + [s_map]

        def body(args):
            mapping = {block.arguments[i]: args[j] for j, i in enumerate(args_read)}
            for op in slice_ops:
                clone_op(op, mapping)
            j = mapping.get(column, column)
            if j.type != index:
                j = arith.IndexCastOp(index, j).result
            c = linalg.IndexOp(ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                  n_loops)).result
            hit = arith.CmpIOp(arith.CmpIPredicate.eq, c, j).result
            term = arith.SelectOp(hit, args[len(inputs) - 1], zero).result
            return [arith.AddFOp(args[len(inputs)], term).result]

        generic = build_generic(inputs, [init], maps + [out_map],
                                rls.iterators + ["reduction"], body)
    return generic.results[0]


class GathersToMaskedClassSumsOp(TransformExt.Operation, name="gathers_to_masked_class_sums"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    plans = []
                    for target in targets:
                        check_has_body(target)
                        found = plan(target)
                        for reader, extracts in found:
                            for extract in extracts:
                                _row_loop(reader, extract)
                        plans.append(found)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for found in plans:
                    for reader, extracts in found:
                        rewrite(reader, extracts, rewriter, _masked_sum)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def gathers_to_masked_class_sums(target: ir.Value) -> GathersToMaskedClassSumsOp:
    """Rewrite the gathers from contractions in `target`'s linalg ops as masked sums over
    the columns (see the module docstring)."""
    return GathersToMaskedClassSumsOp(target)


__all__ = ["GathersToMaskedClassSumsOp", "gathers_to_masked_class_sums"]
