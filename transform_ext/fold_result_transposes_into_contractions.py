"""fold_result_transposes_into_contractions: a contraction whose only reader is a transpose
that moves its innermost dim computes the transposed result itself, its inputs ordered so
that the first one holds the result's rows.

    C = A B,  D = C^T   =>   D[.., j, i] = sum_k B[.., k, j] A[.., i, k]

The contraction's output map is permuted as the transpose permutes C's dims, and its
initial value is transposed the same way (a linalg.transpose of it; a fill folds through
it). Exact: every element is the same sum of the same products in the same order (the
inputs swap places in the body's arguments, not in its arithmetic).

Why: the matmul schedule tiles a product by its output's dims, rows from the first input,
lanes from the second (linalg's inferred m and n). A transpose of C folded into the unpack
left register tiles whose lanes ran along C's rows, transposed by shuffles in the k loop:
(W @ x.T).T ran 10x slower than x @ W^T.

Folded when: the op is a linalg contraction (two inputs, one output, static shapes, every
map a projection of loop dims, no linalg.index), its result's one use is a transpose
(linalg.transpose, or a linalg.generic that only yields its one input read through a
permutation) whose result's innermost dim is not C's innermost dim, and the folded output
reads its batch dims (those both inputs read) first and then one dim of each input.
Other ops are left alone; never fails. The result handle holds the targets (a target that
is itself folded is replaced by the new contraction).
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, linalg, tensor, transform

from .analysis.structure import dim_positions, loop_structure
from .common import (ReplacesTargets, Success, body_of, build_generic, clone_body, defining_op,
                     keep_attributes, payload_ops, users, walk_ops)
from .dialect import TransformExt


def transpose_permutation(op: ir.Operation) -> list[int] | None:
    """perm of a transpose (result dim i is input dim perm[i]): a linalg.transpose, or a
    linalg.generic with one input and one output that yields its input read through a
    permutation, written through the identity; None for any other op."""
    if op.name == "linalg.transpose":
        return list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    if op.name != "linalg.generic" or len(op.operands) != 2 or len(op.results) != 1:
        return None
    block = body_of(op)
    ops = list(block.operations)
    if len(ops) != 1 or list(ops[0].operands) != [block.arguments[0]]:
        return None
    ls = loop_structure(op)
    read, written = dim_positions(ls.maps[0]), dim_positions(ls.maps[1])
    if written != list(range(ls.num_loops)) or sorted(p for p in read if p is not None) != written \
            or None in read:
        return None
    return [read.index(d) for d in written]


def _fold(op: ir.Operation) -> tuple[ir.Operation, list[int], list[int], bool] | None:
    """(the transpose, its permutation, the folded output's loop dims, whether the inputs
    swap) when `op` folds its result's transpose (module docstring), else None."""
    if not op.name.startswith("linalg.") or len(op.results) != 1 or len(op.regions) != 1:
        return None
    ls = loop_structure(op)
    if not ls.is_contraction or not ls.is_static or ls.num_inputs != 2 or ls.num_outputs != 1:
        return None
    if any(inner.operation.name == "linalg.index" for inner in body_of(op).operations):
        return None
    positions = [dim_positions(m) for m in ls.maps]
    if any(p is None for ps in positions for p in ps):
        return None
    readers = users(op.results[0])
    if len(readers) != 1 or len(list(op.results[0].uses)) != 1:
        return None
    transpose = readers[0]
    perm = transpose_permutation(transpose)
    rank = len(positions[2])
    if perm is None or len(perm) != rank or rank < 2 or perm[-1] == rank - 1:
        return None
    folded = [positions[2][p] for p in perm]
    a, b = set(positions[0]), set(positions[1])
    *batch, rows, lanes = folded
    if any(d not in a or d not in b for d in batch):
        return None
    if rows in a and rows not in b and lanes in b and lanes not in a:
        return transpose, perm, folded, False
    if rows in b and rows not in a and lanes in a and lanes not in b:
        return transpose, perm, folded, True
    return None


def _rewrite(op: ir.Operation, found, rewriter) -> ir.Operation:
    """The folded contraction replacing `op` and its transpose, its loops renumbered in the
    folded output's order, the reduction loops after them (the schedules read rows, lanes
    and k in that order)."""
    transpose, perm, folded, swap = found
    ls = loop_structure(op)
    loops = folded + [d for d in range(ls.num_loops) if d not in folded]
    renumbered = {d: i for i, d in enumerate(loops)}

    def remapped(amap):
        return ir.AffineMap.get(ls.num_loops, 0, [ir.AffineDimExpr.get(renumbered[d])
                                                  for d in dim_positions(amap)])

    old_block = body_of(op)
    order = [1, 0] if swap else [0, 1]
    with ir.InsertionPoint(op), op.location:
        init = op.operands[2]
        empty = tensor.EmptyOp([init.type.shape[p] for p in perm], init.type.element_type).result
        new_init = linalg.transpose(init, outs=[empty], permutation=perm).results[0]

        def body(args):
            mapping = {old_block.arguments[order[i]]: args[i] for i in (0, 1)}
            mapping[old_block.arguments[2]] = args[2]
            return clone_body(op, mapping)

        out_map = ir.AffineMap.get(ls.num_loops, 0, [ir.AffineDimExpr.get(i) for i in range(len(folded))])
        maps = [remapped(ls.maps[i]) for i in order] + [out_map]
        new = build_generic([op.operands[i] for i in order], [new_init], maps,
                            [ls.iterators[d] for d in loops], body, name_from=op)
    if op.name == "linalg.generic":
        keep_attributes(op, new.operation)
    rewriter.replace_op(transpose, list(new.results))
    rewriter.erase_op(op)
    return new.operation


class FoldResultTransposesIntoContractionsOp(TransformExt.Operation,
                                             name="fold_result_transposes_into_contractions"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                out = []
                for target in payload_ops(state, op.target):
                    replaced = target
                    folds = [(c, _fold(c)) for c in walk_ops(target, lambda o: o.name.startswith("linalg."))]
                    for candidate, found in folds:  # (a fold erases a transpose, never a candidate)
                        if found is not None:
                            new = _rewrite(candidate, found, rewriter)
                            if candidate == target:
                                replaced = new
                    out.append(replaced)
                results.set_ops(op.result, out)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def fold_result_transposes_into_contractions(target: ir.Value) -> ir.Value:
    """Fold the result transposes of the contractions in `target` (module docstring);
    returns the targets."""
    return FoldResultTransposesIntoContractionsOp(target).result
