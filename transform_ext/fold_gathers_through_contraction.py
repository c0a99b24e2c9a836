"""fold_gathers_through_contraction: a gather from a matrix product reads a dot product.

A linalg.generic R (all loops parallel) reads in its body one element S[i, j] of
S = A B, a contraction with one m, one n and one k dim into zeros (the logits h W^T of a
linear layer; the target logit of a cross-entropy gathers S[r, y_r]). Since

    S[i, j] = sum_k A[i, k] B[k, j]     (each operand through its own indexing map)

the extract becomes one more input of R, T[l] = sum_k A[.., k] B[k, ..] at R's loop point
l, computed by a new linalg.generic D over R's loops and k: D's body computes the indices
as R's body does (the ops they depend on, cloned), gathers one element of each operand of
S per k (tensor.extract; an operand made by a 2-D linalg.transpose is read from its source
with the indices swapped, so W^T need not exist), and accumulates them with S's own body
(its casts, f32 accumulation); an unread empty [K] input holds k's extent. R no longer
reads S: with every gather folded, S can be
computed per tile. Exact up to the order of the sum over k.

Targets: functions; the gathers are the tensor.extract ops directly in the bodies of the
linalg.generic ops of their entry block, from a result of a linalg contraction of the
function with two inputs, one m, n and k dim each, a zero init and static shapes. Legality
first (a silenceable failure names the op, nothing rewritten): R's loops all parallel with
static extents, its output maps permutations; the indices computed from R's inputs, loop
indices and values defined outside R. The target handle stays valid (the rewritten ops are
replaced in other handles).
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.classify import is_contraction
from .analysis.logits import transposed_source
from .analysis.structure import dim_positions, loop_structure
from .common import (Illegal, RewritesTargets, Success, body_of, build_generic, clone_op,
                     defining_op, fail, is_zero, payload_ops, rebuild_generic, terminator)
from .dialect import TransformExt
from .fold_gathers_through_elementwise import check_has_body, extracts_in, linalg_ops_of

NAME = "transform_ext.fold_gathers_through_contraction"


def gathered_contraction(extract: ir.Operation) -> ir.Operation | None:
    """The contraction whose result `extract` reads, when it is one this op folds."""
    source = defining_op(extract.operands[0])
    if source is None or not is_contraction(source):
        return None
    ls = loop_structure(source)
    if ls.num_inputs != 2 or ls.num_outputs != 1 or not ls.is_static:
        return None
    dims = ls.contraction_dims()
    if dims["batch"] or any(len(dims[k]) != 1 for k in "mnk"):
        return None
    if not is_zero(source.operands[ls.num_inputs]):
        return None
    return source


def _index_slice(reader: ir.Operation, values) -> list[ir.Operation]:
    """The ops of `reader`'s body the values depend on, in body order; Illegal when one
    depends on an output block argument or has a region."""
    block = body_of(reader)
    n_inputs = loop_structure(reader).num_inputs
    needed: set = set()
    pending = list(values)
    while pending:
        value = pending.pop()
        if isinstance(value, ir.BlockArgument):
            if value.owner == block and value.arg_number >= n_inputs:
                raise Illegal(reader, "a gather's index reads the accumulator")
            continue
        op = value.owner
        op = getattr(op, "operation", op)
        if op.parent != reader or op in needed:
            continue
        if len(op.regions):
            raise Illegal(reader, f"a gather's index is computed by {op.name}, which has a region")
        needed.add(op)
        pending.extend(op.operands)
    return [o.operation for o in block.operations if o.operation in needed]


def plan(func: ir.Operation) -> list[tuple[ir.Operation, list[ir.Operation]]]:
    """(reader, its gathers from contractions) pairs; Illegal when one cannot be folded."""
    found = []
    for reader in linalg_ops_of(func):
        extracts = [e for e in extracts_in(reader) if gathered_contraction(e) is not None]
        if not extracts:
            continue
        if reader.name != "linalg.generic":
            raise Illegal(reader, "gathers from a contraction in a named op")
        ls = loop_structure(reader)
        if ls.reduction_dims or not ls.is_static:
            raise Illegal(reader, "a reader of a gathered contraction must have static, "
                                  "parallel loops only")
        if not all(m.is_permutation for m in ls.maps[ls.num_inputs:]):
            raise Illegal(reader, "its outputs are not written through permutations")
        for extract in extracts:
            _index_slice(reader, list(extract.operands)[1:])
        found.append((reader, extracts))
    return found


def _read_operand(value: ir.Value, indices: list[ir.Value]) -> ir.Value:
    """One element of an operand of the contraction, read through a transpose when a 2-D
    linalg.transpose makes it."""
    traced = transposed_source(value)
    if traced is not None:
        return tensor.ExtractOp(traced[0], [indices[1], indices[0]]).result
    return tensor.ExtractOp(value, indices).result


def _dot_product(reader: ir.Operation, extract: ir.Operation) -> ir.Value:
    """D: the gathered element per loop point of `reader` (see the module docstring)."""
    source = gathered_contraction(extract)
    sls = loop_structure(source)
    k = sls.contraction_dims()["k"][0]
    rls = loop_structure(reader)
    n_loops = rls.num_loops
    slice_ops = _index_slice(reader, list(extract.operands)[1:])
    block = body_of(reader)
    args_read = sorted({v.arg_number for op in slice_ops for v in op.operands
                        if isinstance(v, ir.BlockArgument) and v.owner == block} |
                       {v.arg_number for v in list(extract.operands)[1:]
                        if isinstance(v, ir.BlockArgument) and v.owner == block})
    extend = lambda m: ir.AffineMap.get(n_loops + 1, 0, list(m.results))
    bound = ir.AffineMap.get(n_loops + 1, 0, [ir.AffineDimExpr.get(n_loops)])
    out_map = ir.AffineMap.get(n_loops + 1, 0, [ir.AffineDimExpr.get(d) for d in range(n_loops)])
    acc_type = ir.RankedTensorType(source.results[0].type).element_type
    f_body = body_of(source)
    with ir.InsertionPoint(reader), reader.location:
        # k's extent: an unread [K] tensor (the gathers read the operands, not the loops)
        depth = tensor.EmptyOp([sls.ranges[k]], acc_type).result
        inputs = [reader.operands[i] for i in args_read] + [depth]
        maps = [extend(rls.maps[i]) for i in args_read] + [bound]
        empty = tensor.EmptyOp(list(rls.ranges), acc_type).result
        init = _zeros_like(source, empty)

        def body(args):
            mapping = {block.arguments[i]: args[j] for j, i in enumerate(args_read)}
            for op in slice_ops:
                clone_op(op, mapping)
            indices = [mapping.get(v, v) for v in list(extract.operands)[1:]]
            loop_index = {d: indices[p] for p, d in enumerate(dim_positions(sls.output_map(0)))}
            loop_index[k] = linalg.IndexOp(ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                              n_loops)).result
            elements = [_read_operand(source.operands[i],
                                      [loop_index[d] for d in dim_positions(sls.maps[i])])
                        for i in range(2)]
            f_map = {f_body.arguments[0]: elements[0], f_body.arguments[1]: elements[1],
                     f_body.arguments[2]: args[len(inputs)]}
            for op in list(f_body.operations)[:-1]:
                clone_op(op.operation, f_map)
            return [f_map.get(v, v) for v in terminator(f_body).operands]

        generic = build_generic(inputs, [init], maps + [out_map],
                                rls.iterators + ["reduction"], body)
    return generic.results[0]


def _zeros_like(source: ir.Operation, empty: ir.Value) -> ir.Value:
    """A zero fill of `empty`, with the scalar the contraction's own zero fill uses."""
    init = defining_op(source.operands[loop_structure(source).num_inputs])
    if init is not None and init.name == "linalg.fill":
        return linalg.fill(init.operands[0], outs=[empty])
    t = ir.RankedTensorType(empty.type).element_type
    return linalg.fill(arith.ConstantOp(t, ir.FloatAttr.get(t, 0.0)).result, outs=[empty])


def rewrite(reader: ir.Operation, extracts: list[ir.Operation], rewriter,
            element=None) -> None:
    """`reader` reading, for each of its gathers, the value `element(reader, extract)`
    computes (default: the dot product) as an input in place of the gather."""
    element = element or _dot_product
    dots = [element(reader, e) for e in extracts]
    ls = loop_structure(reader)
    block = body_of(reader)
    identity = ir.AffineMap.get_identity(ls.num_loops)
    n_in = ls.num_inputs

    def mapping_of(args):
        mapping = {block.arguments[i]: args[i] for i in range(n_in)}
        for j in range(ls.num_outputs):
            mapping[block.arguments[n_in + j]] = args[n_in + len(dots) + j]
        for k, extract in enumerate(extracts):
            mapping[extract.results[0]] = args[n_in + k]
        return mapping

    rebuild_generic(reader, list(reader.operands)[:n_in] + dots,
                    ls.maps[:n_in] + [identity] * len(dots), mapping_of, rewriter, skip=extracts)


class FoldGathersThroughContractionOp(TransformExt.Operation,
                                      name="fold_gathers_through_contraction"):
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
                        plans.append(plan(target))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for found in plans:
                    for reader, extracts in found:
                        rewrite(reader, extracts, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fold_gathers_through_contraction(target: ir.Value) -> FoldGathersThroughContractionOp:
    """Fold the gathers from contractions in `target`'s linalg ops (see the module
    docstring)."""
    return FoldGathersThroughContractionOp(target)


__all__ = ["FoldGathersThroughContractionOp", "fold_gathers_through_contraction"]
