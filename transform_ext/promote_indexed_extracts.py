"""promote_indexed_extracts: a gather at the reading op's own loop indices is an operand read.

In a linalg.generic over loops (d_0, .., d_n), an extract T[e_1, .., e_r] whose indices are
`linalg.index` of distinct loops or index constants reads T through the affine map
    (d_0, .., d_n) -> (e_1, .., e_r)      (linalg.index d_j -> d_j, a constant -> itself)
so the op is rebuilt with T as one more input through that map and the extract replaced by
the new block argument: the same values, read by the op's indexing instead of its body, so
tiling slices T and fusion sees the dependence. Extracts at data-dependent indices
(x[i, y_i]), at a repeated loop index, or of a tensor the body receives as an argument stay.

Targets: function-like ops; the candidates are the linalg.generics of their entry block. A
target without a region is a silenceable failure (nothing rewritten). The target handle is
only read; the rebuilt generics replace the old ones in other handles.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.maps import Const, make_map
from .common import (Illegal, RewritesTargets, Success, body_of, build_generic, defining_op, fail,
                     iterator_kinds, payload_ops, remap_operands, terminator)
from .dialect import TransformExt
from .fold_gathers_through_elementwise import check_has_body, extracts_in, linalg_ops_of

NAME = "transform_ext.promote_indexed_extracts"


def _loop_dim_of(value: ir.Value, block: ir.Block):
    """The loop dim d when `value` is `linalg.index d` of the op owning `block`, a Const for
    an index constant, else None."""
    op = defining_op(value)
    if op is None:
        return None
    if op.name == "arith.constant" and isinstance(value.type, ir.IndexType):
        return Const(ir.IntegerAttr(op.attributes["value"]).value)
    if op.name == "linalg.index" and op.block == block:
        return ir.IntegerAttr(op.attributes["dim"]).value
    return None


def promotable_extracts(op: ir.Operation) -> list:
    """(extract, index terms) of the extracts of `op` that read at its own loop indices."""
    block = body_of(op)
    found = []
    for extract in extracts_in(op):
        source = extract.operands[0]
        if isinstance(source, ir.BlockArgument) and source.owner == block:
            continue
        ts = [_loop_dim_of(v, block) for v in list(extract.operands)[1:]]
        if any(t is None for t in ts):
            continue
        dims = [t for t in ts if not isinstance(t, Const)]
        if len(set(dims)) != len(dims):
            continue
        found.append((extract, ts))
    return found


def _promote(op: ir.Operation, promotable: list, rewriter) -> None:
    view = op.opview
    inputs = list(view.inputs)
    outputs = list(view.outputs)
    maps = [m.value for m in view.indexing_maps]
    n_loops = maps[0].n_dims if maps else len(iterator_kinds(op))
    new_inputs = [e.operands[0] for e, _ in promotable]
    new_maps = [make_map(n_loops, ts) for _, ts in promotable]
    block = body_of(op)
    extract_index = {e: len(inputs) + i for i, (e, _) in enumerate(promotable)}

    def body(args):
        mapping = {block.arguments[i]: args[i] for i in range(len(inputs))}
        for j in range(len(outputs)):
            mapping[block.arguments[len(inputs) + j]] = args[len(inputs) + len(new_inputs) + j]
        for e, pos in extract_index.items():
            mapping[e.results[0]] = args[pos]
        for inner in list(block.operations)[:-1]:
            inner = inner.operation
            if inner in extract_index:
                continue
            clone = inner.clone()
            remap_operands(clone, mapping)
            for old, new in zip(inner.results, clone.results):
                mapping[old] = new
        return [mapping.get(v, v) for v in terminator(block).operands]

    with ir.InsertionPoint(op), op.location:
        new = build_generic(inputs + new_inputs, outputs,
                            maps[:len(inputs)] + new_maps + maps[len(inputs):],
                            iterator_kinds(op), body, name_from=op)
    if len(op.results):
        rewriter.replace_op(op, list(new.results))
    else:
        rewriter.erase_op(op)


class PromoteIndexedExtractsOp(TransformExt.Operation, name="promote_indexed_extracts"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        check_has_body(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for target in targets:
                    for generic in linalg_ops_of(target):
                        if generic.name != "linalg.generic":
                            continue
                        promotable = promotable_extracts(generic)
                        if promotable:
                            _promote(generic, promotable, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def promote_indexed_extracts(target: ir.Value) -> PromoteIndexedExtractsOp:
    """Turn the extracts at their op's own loop indices (in `target`'s ops) into inputs."""
    return PromoteIndexedExtractsOp(target)


__all__ = ["PromoteIndexedExtractsOp", "promote_indexed_extracts", "promotable_extracts"]
