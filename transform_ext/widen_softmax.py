"""widen_softmax: the probabilities of a softmax written by hand in f16/bf16 kept in f32.

torch rounds P = E / l to f16/bf16 before P V (which reads it back through extf), a rounding
the online softmax cannot reproduce (P is never formed); SDPA keeps P in f32. The scores keep
torch's roundings (S = trunc(Q K^T), the scale and mask in bf16: elementwise ops the key
loop computes per tile), so the result differs from torch's by P's rounding only.

In each target function with exactly one max reduction m (the row max), forward from m in
block order, over the single-result linalg.generic ops depending on m:
  - a truncf-only generic of an f32 value x (y = trunc(x)) has x as its f32 shadow;
  - an op reading shadowed values only through extf (ext(y)) reads the shadows instead
    (the extf goes): ext(trunc(x)) -> x;
  - an elementwise op computing in f16/bf16 from shadowed values is recomputed in f32
    (constants keep their rounded value; unshadowed narrow inputs, a bf16 mask, are
    extended), and its result gets that f32 shadow.
Narrow values still read elsewhere keep their ops (dead ones go with canonicalization).
A function without one max reduction is left as it is. A target that is not a function
is a silenceable failure naming it (nothing rewritten). The target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, tensor, transform

from .analysis.attention import depends_into
from .analysis.classify import reduction_combiner
from .analysis.structure import is_linalg_op, loop_structure
from .common import (Illegal, RewritesTargets, Success, block_ops, build_generic, fail,
                     iterator_kinds, payload_ops)
from .dialect import TransformExt

NAME = "transform_ext.widen_softmax"
_NARROW = ("f16", "bf16")


def widen(func: ir.Operation, rewriter) -> None:
    maxes = [op for op in block_ops(func) if is_linalg_op(op) and reduction_combiner(op) == "max"]
    if len(maxes) != 1:
        return
    row_max = maxes[0]
    f32 = ir.F32Type.get()
    shadow: dict = {}
    for op in block_ops(func):
        if op.name != "linalg.generic" or len(op.results) != 1 or op is row_max or \
                not depends_into(op, row_max):
            continue
        ls = loop_structure(op)
        inputs = list(op.operands)[:ls.num_inputs]
        if _is_truncation(op) and str(inputs[0].type.element_type) == "f32":
            shadow[op.results[0]] = inputs[0]
            continue
        read = [i for i, v in enumerate(inputs) if v in shadow]
        if not read:
            continue
        with op.location:
            if all(_read_through_extf(op, i) for i in read):
                new = _read_shadows(op, read, shadow)
                rewriter.replace_op(op, [new.results[0]])
            elif ls.is_elementwise and str(op.results[0].type.element_type) in _NARROW:
                wide = _recompute_in_f32(op, read, shadow, f32)
                if wide is not None:
                    shadow[op.results[0]] = wide.results[0]


def _is_truncation(op: ir.Operation) -> bool:
    """An elementwise generic yielding truncf of its one input (a rounding to f16/bf16)."""
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    return loop_structure(op).is_elementwise and loop_structure(op).num_inputs == 1 and \
        len(ops) == 2 and ops[0].name == "arith.truncf" and ops[0].operands[0] == body.arguments[0] \
        and ops[1].operands[0] == ops[0].results[0]


def _read_through_extf(op: ir.Operation, index: int) -> bool:
    """Does `op`'s body read input `index` only as arith.extf to f32?"""
    arg = op.regions[0].blocks[0].arguments[index]
    uses = [u.owner for u in arg.uses]
    return bool(uses) and all(getattr(u, "name", None) == "arith.extf" and
                              str(u.results[0].type) == "f32" for u in uses)


def _read_shadows(op: ir.Operation, read: list[int], shadow: dict) -> ir.Operation:
    """`op` rebuilt with inputs `read` replaced by their f32 shadows, their extf dropped."""
    ls = loop_structure(op)
    operands = list(op.operands)
    new_inputs = [shadow[v] if i in read else v for i, v in enumerate(operands[:ls.num_inputs])]
    body = op.regions[0].blocks[0]

    def build(args):
        mapping = dict(zip(body.arguments, args))
        for i in read:
            for use in list(body.arguments[i].uses):
                mapping[use.owner.results[0]] = args[i]
        for inner in list(body.operations)[:-1]:
            inner = inner.operation
            if inner.name == "arith.extf" and inner.results[0] in mapping:
                continue
            clone = inner.clone()
            for j, v in enumerate(clone.operands):
                if v in mapping:
                    clone.operands[j] = mapping[v]
            for old, res in zip(inner.results, clone.results):
                mapping[old] = res
        yielded = body.operations[len(body.operations) - 1].operands
        return [mapping.get(v, v) for v in yielded]

    with ir.InsertionPoint(op):
        return build_generic(new_inputs, operands[ls.num_inputs:], ls.maps,
                             iterator_kinds(op), build, name_from=op)


def _recompute_in_f32(op, read: list[int], shadow: dict, f32) -> ir.Operation | None:
    """Elementwise `op` recomputed in f32 from the shadows of inputs `read` (None when its
    body holds anything but arith/math ops, or reads its init)."""
    ls = loop_structure(op)
    body = op.regions[0].blocks[0]
    if list(body.arguments[ls.num_inputs].uses) or any(
            not o.operation.name.startswith(("arith.", "math.", "linalg.yield"))
            for o in body.operations):
        return None
    operands = list(op.operands)
    new_inputs = [shadow[v] if i in read else v for i, v in enumerate(operands[:ls.num_inputs])]

    def is_narrow(v):
        return str(v.type) in _NARROW

    def build(args):
        mapping = dict(zip(list(body.arguments)[:ls.num_inputs], args[:ls.num_inputs]))
        for inner in list(body.operations)[:-1]:
            inner = inner.operation
            ins = [mapping.get(v, v) for v in inner.operands]
            if inner.name == "arith.truncf" and str(ins[0].type) == "f32":
                mapping[inner.results[0]] = ins[0]
                continue
            if inner.name == "arith.extf" and str(ins[0].type) == "f32":
                mapping[inner.results[0]] = ins[0]
                continue
            if inner.name == "arith.constant" and is_narrow(inner.results[0]):
                value = ir.FloatAttr(inner.attributes["value"]).value
                mapping[inner.results[0]] = arith.ConstantOp(f32, ir.FloatAttr.get(f32, value)).result
                continue
            if any(str(v.type) == "f32" for v in ins):
                ins = [arith.extf(f32, v) if is_narrow(v) else v for v in ins]
            clone = inner.clone()
            for j, v in enumerate(ins):
                clone.operands[j] = v
            for old, res in zip(inner.results, clone.results):
                if is_narrow(res) and any(str(v.type) == "f32" for v in ins):
                    res.set_type(f32)
                mapping[old] = res
        out = mapping.get(body.operations[len(body.operations) - 1].operands[0])
        return [out if str(out.type) == "f32" else arith.extf(f32, out)]

    t = op.results[0].type
    with ir.InsertionPoint(op):
        init = tensor.EmptyOp(list(t.shape), f32).result
        return build_generic(new_inputs, [init], ls.maps, iterator_kinds(op), build, name_from=op)


class WidenSoftmaxOp(TransformExt.Operation, name="widen_softmax"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                for target in targets:
                    if target.name != "func.func" or not len(target.regions[0].blocks):
                        return fail(NAME, Illegal(target, "not a function with a body"))
                for target in targets:
                    widen(target, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def widen_softmax(func: ir.Value) -> None:
    """Keep a hand-written f16/bf16 softmax's probabilities in f32 in each function of
    `func` (see the module docstring)."""
    WidenSoftmaxOp(func)


__all__ = ["WidenSoftmaxOp", "widen_softmax"]
