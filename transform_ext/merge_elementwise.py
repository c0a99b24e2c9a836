"""merge_elementwise: one linalg.generic computing several elementwise ones side by side.

Ops O_1..O_n, elementwise linalg.generics of one block over the same loop ranges with
identity output maps, become
    G(inputs of all, each (value, map) once) -> (results of O_1, .., results of O_n)
whose body is their bodies one after the other: every element of every result is computed
by the same scalar ops from the same values (exact), in one sweep over the iteration space
(d x and d t of a loss with probability targets: the logits are read once). G sits at the
last O_i's place and replaces them all.

Legality first: at least one op; each a linalg.generic on tensors with all loops parallel
and identity output maps, all in one block, over equal loop ranges; no one reading
another's result, and every input defined before the last one (G reads them there). Else a silenceable failure naming
the op (nothing rewritten). The target handle is consumed; the result holds G.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, body_of, build_generic, clone_op,
                     defining_op, fail, iterator_kinds, payload_ops, terminator)
from .dialect import TransformExt

NAME = "transform_ext.merge_elementwise"


def check_mergeable(ops: list[ir.Operation]) -> None:
    if not ops:
        raise Illegal(None, "no ops to merge")
    first = ops[0]
    last = _last(ops)
    for op in ops:
        if op.name != "linalg.generic" or not len(op.results):
            raise Illegal(op, "not a linalg.generic on tensors")
        if any(k != "parallel" for k in iterator_kinds(op)):
            raise Illegal(op, "not elementwise (a reduction loop)")
        n = len(iterator_kinds(op))
        outs = [m.value for m in op.opview.indexing_maps][len(op.opview.inputs):]
        if any(m != ir.AffineMap.get_identity(n) for m in outs):
            raise Illegal(op, "an output map is not the identity")
        if op.block != first.block:
            raise Illegal(op, "not in the first op's block")
        if loop_structure(op).ranges != loop_structure(first).ranges:
            raise Illegal(op, "its loop ranges differ from the first op's")
        for v in op.opview.inputs:
            p = defining_op(v)
            if p is not None and p in ops:
                raise Illegal(op, f"it reads the result of another merged op ({p.name})")
            if p is not None and p.block == last.block and last.is_before_in_block(p):
                raise Illegal(op, "an input is defined after the last op")


def _last(ops: list[ir.Operation]) -> ir.Operation:
    last = ops[0]
    for op in ops[1:]:
        if last.is_before_in_block(op):
            last = op
    return last


def merge(ops: list[ir.Operation], rewriter=None) -> ir.Operation:
    """The merged op (see the module docstring); replaces `ops` (through `rewriter` inside a
    transform op, else directly). The ops share their loops (the first op's iterator types)
    and each keeps its output maps: reductions merge as well (merge_sibling_reductions)."""
    first = ops[0]
    inputs, in_maps, outputs, out_maps = [], [], [], []
    index = {}
    for op in ops:
        view = op.opview
        maps = [m.value for m in view.indexing_maps]
        for v, m in zip(view.inputs, maps[:len(view.inputs)]):
            key = (v, str(m))
            if key not in index:
                index[key] = len(inputs)
                inputs.append(v)
                in_maps.append(m)
        outputs.extend(view.outputs)
        out_maps.extend(maps[len(view.inputs):])
    last = _last(ops)

    def body(args):
        results = []
        out_pos = len(inputs)
        for op in ops:
            view = op.opview
            block = body_of(op)
            mapping = {}
            for i, (v, m) in enumerate(zip(view.inputs, list(view.indexing_maps))):
                mapping[block.arguments[i]] = args[index[(v, str(m.value))]]
            for j in range(len(view.outputs)):
                mapping[block.arguments[len(view.inputs) + j]] = args[out_pos]
                out_pos += 1
            for inner in list(block.operations)[:-1]:
                clone_op(inner.operation, mapping)
            results.extend(mapping.get(v, v) for v in terminator(block).operands)
        return results

    with ir.InsertionPoint(last), last.location:
        new = build_generic(inputs, outputs, in_maps + out_maps, iterator_kinds(first), body)
    position = 0
    for op in ops:
        values = list(new.results)[position:position + len(op.results)]
        position += len(op.results)
        if rewriter is not None:
            rewriter.replace_op(op, values)
        else:
            for r, v in zip(op.results, values):
                r.replace_all_uses_with(v)
            op.erase()
    return new.operation


class MergeElementwiseOp(TransformExt.Operation, name="merge_elementwise"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                ops = payload_ops(state, op.target)
                try:
                    check_mergeable(ops)
                except Illegal as illegal:
                    if illegal.payload is None:
                        illegal.payload = op.operation
                    return fail(NAME, illegal)
                results.set_ops(op.result, [merge(ops, rewriter)])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def merge_elementwise(target: ir.Value) -> ir.Value:
    """Merge the elementwise ops of `target` into one (see the module docstring)."""
    return MergeElementwiseOp(target).result


__all__ = ["MergeElementwiseOp", "merge_elementwise", "merge", "check_mergeable"]
