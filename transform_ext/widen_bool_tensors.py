"""widen_bool_tensors: boolean tensors are stored as i8 (0 or 1), scalars stay i1.

vector<N x i1> loads and stores are bit-packed in LLVM while an i1 tensor in memory holds
one byte per element, so vectorized code would misread them. Every ranked tensor of i1 in
the target functions (arguments, results of ops, region arguments) becomes the same tensor
of i8, with b stored as zext(b):
- a linalg.generic reading an i1 tensor reads i8 and truncates (`arith.trunci`) at the top
  of its body; one yielding into an i1 tensor extends (`arith.extui`) what it yields. Scalar
  operands (a fill value) stay i1;
- an i1 dense constant becomes the i8 constant of 0s and 1s;
- `tensor.extract` of an i1 tensor (in a linalg body too) yields i8 and is truncated
  after; `tensor.insert`,
  `tensor.splat` and `tensor.from_elements` extend their i1 scalars;
- ops that only move or reshape tensors (empty, reshapes, slices, casts, pad, concat, scf
  loops and their yields, func.return) are retyped in place.
Exact: trunci(zext(b)) = b. Function arguments and results keep their byte layout (one
byte per element); the function types follow their bodies.

Targets: func.func ops; all of them are rewritten together. When an op the list above
does not name holds an i1 tensor, nothing is rewritten in any target (no failure: the
payload keeps its i1 tensors). Illegal (a silenceable failure, nothing rewritten): a target
that is not a function with a body ending in func.return, a named linalg op (not a
generic) on i1 tensors: its body is implicit, generalize it first (structured.generalize of
filter_by_element_type). The handle is only read.
"""

import numpy as np
from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .common import Illegal, RewritesTargets, Success, fail, payload_ops
from .dialect import TransformExt
from .refresh_function_type import check_function, refresh_function_type_of

NAME = "transform_ext.widen_bool_tensors"

# Ops that only move or reshape an i1 tensor: retyped in place.
_SHAPE_ONLY = {
    "tensor.empty", "tensor.expand_shape", "tensor.collapse_shape", "tensor.extract_slice",
    "tensor.insert_slice", "tensor.cast", "tensor.reshape", "tensor.pad", "tensor.concat",
    "func.return", "scf.yield", "scf.for", "scf.forall", "scf.if", "tensor.parallel_insert_slice",
    "scf.forall.in_parallel", "bufferization.alloc_tensor",
}
# Ops whose i1 scalars are converted at the boundary.
_ELEMENT_ACCESS = {"arith.constant", "tensor.extract", "tensor.insert", "tensor.splat",
                   "tensor.from_elements"}


def _is_bool_tensor(t: ir.Type) -> bool:
    return isinstance(t, ir.RankedTensorType) and t.element_type == ir.IntegerType.get_signless(1)


def _holds_bool_tensor(op: ir.Operation) -> bool:
    return any(_is_bool_tensor(v.type) for v in list(op.operands) + list(op.results))


def _is_linalg(op: ir.Operation) -> bool:
    return op.name.startswith("linalg.") and op.name not in ("linalg.yield", "linalg.index")


def plan(funcs: list[ir.Operation]) -> tuple[list[ir.Operation], list[str]]:
    """(the ops holding i1 tensors in walk order, the names of those it does not know);
    raises Illegal on a named linalg op on i1 tensors."""
    users: list[ir.Operation] = []
    unknown: list[str] = []
    named: list[ir.Operation] = []

    def gathers(op):  # a tensor.extract of an i1 tensor in a linalg body (a sort's gather)
        if op.name == "tensor.extract" and _is_bool_tensor(op.operands[0].type):
            users.append(op)
        return ir.WalkResult.ADVANCE

    def visit(op):
        if _is_linalg(op):
            if _holds_bool_tensor(op):
                users.append(op)
                if op.name != "linalg.generic":
                    named.append(op)
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        inner.operation.walk(gathers, ir.WalkOrder.PRE_ORDER)
            return ir.WalkResult.SKIP  # bodies hold scalars, but for gathers
        if _holds_bool_tensor(op):
            users.append(op)
            if op.name not in _SHAPE_ONLY and op.name not in _ELEMENT_ACCESS:
                unknown.append(op.name)
        return ir.WalkResult.ADVANCE

    for f in funcs:
        f.walk(visit, ir.WalkOrder.PRE_ORDER)
    if named:
        raise Illegal(named[0], "a named linalg op on i1 tensors (its body is implicit): "
                                "generalize it first")
    return users, unknown


def _widen(t: ir.RankedTensorType) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(t.shape), ir.IntegerType.get_signless(8), t.encoding)


def _widen_linalg_body(op: ir.Operation, i1, i8) -> None:
    num_results = len(op.results)
    body = op.regions[0].blocks[0]
    first = body.operations[0] if len(body.operations) else None
    for j, arg in enumerate(body.arguments):
        if j >= len(op.operands) or arg.type != i1:
            continue
        if not isinstance(op.operands[j].type, ir.RankedTensorType):
            continue  # a scalar operand (fill value, ...): stays i1
        arg.set_type(i8)
        with ir.InsertionPoint(first) if first is not None else ir.InsertionPoint(body), op.location:
            narrow = arith.trunci(i1, arg)
        arg.replace_all_uses_except(narrow, narrow.owner.operation)
    terminator = body.operations[len(body.operations) - 1]
    for k in range(num_results):
        r = op.results[k]
        if _is_bool_tensor(r.type):
            v = terminator.operands[k]
            with ir.InsertionPoint(terminator), op.location:
                terminator.operands[k] = arith.extui(i8, v)
            r.set_type(_widen(r.type))


def _widen_constant(op: ir.Operation, i8, rewriter) -> None:
    attr = op.attributes["value"]
    if attr.is_splat:
        values = [1 if bool(attr.get_splat_value().value) else 0]
    else:
        values = [1 if bool(v) else 0 for v in np.array(attr).reshape(-1).tolist()]
    new_t = _widen(op.results[0].type)
    new_attr = (ir.DenseElementsAttr.get_splat(new_t, ir.IntegerAttr.get(i8, values[0]))
                if attr.is_splat else
                ir.DenseIntElementsAttr.get(np.array(values, dtype=np.int8).reshape(new_t.shape),
                                            type=new_t))
    with ir.InsertionPoint(op), op.location:
        new = arith.ConstantOp(new_t, new_attr)
    rewriter.replace_op(op, [new.result])


def _rewrite(funcs: list[ir.Operation], users: list[ir.Operation], rewriter) -> None:
    i1 = ir.IntegerType.get_signless(1)
    i8 = ir.IntegerType.get_signless(8)
    for f in funcs:
        for arg in f.regions[0].blocks[0].arguments:
            if _is_bool_tensor(arg.type):
                arg.set_type(_widen(arg.type))
    for op in users:
        name = op.name
        if _is_linalg(op):
            _widen_linalg_body(op, i1, i8)
        elif name == "arith.constant":
            _widen_constant(op, i8, rewriter)
            continue
        elif name == "tensor.extract":
            result = op.results[0]
            result.set_type(i8)
            with ir.InsertionPoint.after(op), op.location:
                narrow = arith.trunci(i1, result)
            result.replace_all_uses_except(narrow, narrow.owner.operation)
        elif name in ("tensor.insert", "tensor.splat", "tensor.from_elements"):
            with ir.InsertionPoint(op), op.location:
                for i, v in enumerate(op.operands):
                    if v.type == i1:
                        op.operands[i] = arith.extui(i8, v)
        for r in op.results:
            if _is_bool_tensor(r.type):
                r.set_type(_widen(r.type))
        for region in op.regions:
            for block in region.blocks:
                for arg in block.arguments:
                    if _is_bool_tensor(arg.type):
                        arg.set_type(_widen(arg.type))
    for f in funcs:
        refresh_function_type_of(f)


class WidenBoolTensorsOp(TransformExt.Operation, name="widen_bool_tensors"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context, op.location:
                funcs = payload_ops(state, op.target)
                try:
                    for f in funcs:
                        check_function(f)
                    users, unknown = plan(funcs)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                if not unknown:
                    _rewrite(funcs, users, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def widen_bool_tensors(target: ir.Value) -> WidenBoolTensorsOp:
    """Store the i1 tensors of the functions in `target` as i8 (see the module docstring)."""
    return WidenBoolTensorsOp(target)


__all__ = ["WidenBoolTensorsOp", "widen_bool_tensors"]
