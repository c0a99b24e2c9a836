"""widen_contraction_operands: a contraction of 16-bit operands becomes one of f32 operands.

For a contraction C = C + sum_k A B with an f32 accumulator C and A or B of f16/bf16 (its
body extends them to f32 before multiplying), each 16-bit operand X is replaced by an
elementwise extension X' = f32(X) over X's shape, and the contraction is rebuilt as a
linalg.generic with the same indexing maps and iterator types on the f32 operands and the
body `acc + a * b`. Exact: every f16 and bf16 value is an f32 value; bf16 is the upper
half of an f32, so it is extended by shifting its bits up by 16 (which vectorizes to a
zero-extend and a shift, where LLVM's own bf16 extension goes element by element), f16 by
`arith.extf`. The matmul schedule packs the extended operands, so the kernel and its
packed panels are f32 and each 16-bit element is extended once, while packing.

Targets: linalg ops with two inputs and one output that are contractions (linalg's
contraction interface: a sum of products), with ranked tensor operands of f32, f16 or bf16
and an f32 result (else a silenceable failure naming the op, nothing rewritten). A target
whose inputs are both f32 is left as it is.

Results: `contraction`, per target the rebuilt generic (or the target left as it is);
`lhs` and `rhs`, the extensions of input 0 and input 1 of the targets that had one (either
may be empty). The target handle is consumed.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, ReplacesTargets, Success, fail, payload_ops
from .dialect import TransformExt

NAME = "transform_ext.widen_contraction_operands"
_FLOATS = ("f32", "f16", "bf16")


def _check(op: ir.Operation) -> None:
    if not is_linalg_op(op):
        raise Illegal(op, "not a linalg op")
    ls = loop_structure(op)
    if ls.num_inputs != 2 or ls.num_outputs != 1:
        raise Illegal(op, "does not have two inputs and one output")
    if not ls.is_contraction:
        raise Illegal(op, "is not a contraction")
    for v in list(op.operands) + list(op.results):
        if not isinstance(v.type, ir.RankedTensorType):
            raise Illegal(op, f"has an operand or result of type {v.type} (wants ranked tensors)")
        if str(v.type.element_type) not in _FLOATS:
            raise Illegal(op, f"has element type {v.type.element_type} (wants f32, f16 or bf16)")
    if str(op.results[0].type.element_type) != "f32":
        raise Illegal(op, f"accumulates in {op.results[0].type.element_type} (wants f32)")


def _elementwise(value: ir.Value, result_type: ir.Type, body) -> ir.Operation:
    """linalg.generic applying `body(element)` to every element of `value`."""
    t = value.type
    rank = len(t.shape)
    identity = ir.AffineMapAttr.get(ir.AffineMap.get_identity(rank))
    empty = tensor.EmptyOp(t.shape, result_type)
    op = linalg.GenericOp([ir.RankedTensorType.get(t.shape, result_type)], [value], [empty.result],
                          ir.ArrayAttr.get([identity, identity]),
                          ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * rank))
    block = op.regions[0].blocks.append(t.element_type, result_type)
    with ir.InsertionPoint(block):
        linalg.YieldOp([body(block.arguments[0])])
    return op.operation


def extend_to_f32(x: ir.Value) -> ir.Value:
    """x (f16 or bf16) as f32, exactly (bf16: its bits shifted up by 16)."""
    f32 = ir.F32Type.get()
    if not isinstance(x.type, ir.BF16Type):
        return arith.ExtFOp(f32, x).result
    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    bits = arith.ExtUIOp(i32, arith.BitcastOp(i16, x).result).result
    shifted = arith.ShLIOp(bits, arith.ConstantOp(i32, 16).result).result
    return arith.BitcastOp(f32, shifted).result


def widen(op: ir.Operation, rewriter) -> tuple[ir.Operation, list[ir.Operation | None]]:
    """Rebuild contraction `op` on f32 operands (see the module docstring); returns the new
    contraction and the extension of each input (None where it was f32)."""
    f32 = ir.F32Type.get()
    ls = loop_structure(op)
    with ir.InsertionPoint(op), op.location:
        inputs, extensions = [], []
        for index in (0, 1):
            value = op.operands[index]
            extension = None
            if value.type.element_type != f32:
                extension = _elementwise(value, f32, extend_to_f32)
                value = extension.results[0]
            inputs.append(value)
            extensions.append(extension)
        maps = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in ls.maps])
        iterators = ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{it}>")
                                      for it in ls.iterators])
        widened = linalg.GenericOp([op.results[0].type], inputs, [op.operands[2]], maps, iterators)
        block = widened.regions[0].blocks.append(f32, f32, f32)
        with ir.InsertionPoint(block):
            product = arith.MulFOp(block.arguments[0], block.arguments[1]).result
            linalg.YieldOp([arith.AddFOp(block.arguments[2], product).result])
    rewriter.replace_op(op, [widened.results[0]])
    return widened.operation, extensions


class WidenContractionOperandsOp(TransformExt.Operation, name="widen_contraction_operands"):
    target: ext.Operand[transform.AnyOpType]
    contraction: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    lhs: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    rhs: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        _check(target)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                f32 = ir.F32Type.get()
                contractions, lhs, rhs = [], [], []
                for target in targets:
                    if all(v.type.element_type == f32 for v in list(target.operands)[:2]):
                        contractions.append(target)
                        continue
                    new, (a, b) = widen(target, rewriter)
                    contractions.append(new)
                    lhs += [a] if a is not None else []
                    rhs += [b] if b is not None else []
                results.set_ops(op.contraction, contractions)
                results.set_ops(op.lhs, lhs)
                results.set_ops(op.rhs, rhs)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def widen_contraction_operands(target: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Rebuild the contractions in `target` on f32 operands; returns (the contractions, the
    extensions of their input 0, of their input 1)."""
    op = WidenContractionOperandsOp(target)
    return op.contraction, op.lhs, op.rhs


__all__ = ["extend_to_f32", "WidenContractionOperandsOp", "widen_contraction_operands", "widen"]
