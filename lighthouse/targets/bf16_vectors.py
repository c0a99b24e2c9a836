"""bf16 vectors of an odd lane count, which LLVM's x86 backend cannot legalize: it splits a
9-, 17- or 33-lane vector into power-of-two parts plus a single lane and aborts the process
on that lane ("Do not know how to soft promote this operator's operand") in a conversion, a
select, or even a plain load or store. Two exact rewrites keep
such vectors out of LLVM: their conversions to and from f32 become integer ops on the bit
patterns (odd_bf16_conversions_as_integer_ops, on arith; every extension from bf16 too, as
its docstring says why), and the data movement that
remains moves the bits as i16 (odd_bf16_vectors_as_i16, on the LLVM dialect). Padding the
odd vectors to a power of two instead does not hold: LLVM's own combines narrow the padded
ops back to the odd width.
bf16 scalars and one-lane vectors (an n-D vector of an odd innermost dim reaches LLVM as
1-D ones of that width) are no safer: LLVM's vectorizers join them, in the scalar loops of
ops left unvectorized too, into bf16 vectors of any width, and a strided read among them
becomes shuffles of bf16 vectors the backend cannot select ("Cannot select: v16bf16 =
X86ISD::VPERM2X128"); their conversions become the same integer ops.
On a CPU without avx512_bf16 both rewrites apply to bf16 vectors of every lane count: LLVM
has no bf16 conversion instruction there and calls `__truncsfbf2`, a libgcc function the
JIT does not resolve ("Symbols not found: [ __truncsfbf2 ]"), for each lane it converts to
bf16, also where it promotes the lanes of a bf16 vector it only moves (an insert, a
shuffle) to f32 and back.
"""

from __future__ import annotations

from torch_mlir import ir

from transform_ext.common import defining_op

from ..errors import UnsupportedError


def _bf16_lanes(t: ir.Type) -> int | None:
    """The lane count of the 1-D vectors a bf16 vector reaches LLVM as (its innermost dim:
    an n-D vector is lowered to an array of them; 1 for a bf16 scalar); None for other
    types."""
    if isinstance(t, ir.BF16Type):
        return 1
    if not isinstance(t, ir.VectorType) or not isinstance(ir.VectorType(t).element_type, ir.BF16Type):
        return None
    shape = ir.VectorType(t).shape
    return shape[-1] if shape else 1


def _odd_lanes(t: ir.Type) -> bool:
    """A bf16 vector of an odd lane count, one lane included (a strided pooling's taps are
    one-lane vectors inserted and extracted one by one: "soft promote" on the insert)."""
    n = _bf16_lanes(t)
    return isinstance(t, ir.VectorType) and n is not None and n % 2 == 1


def _scalar_or_odd_bf16(t: ir.Type) -> bool:
    """A bf16 scalar, or a bf16 vector of an odd lane count (one lane included, and an n-D
    vector whose innermost dim is odd: vector<8x17x1xbf16> reaches LLVM as 136
    vector<1xbf16>)."""
    n = _bf16_lanes(t)
    return n is not None and n % 2 == 1


def _ragged_bf16(t: ir.Type) -> bool:
    """A bf16 vector whose lane count is not a multiple of 8: LLVM splits it into 8-lane
    parts and a rest, and aborts on some rests of even width too (a 10-lane conversion
    whose loads it forwarded from scalar stores: "soft promote")."""
    n = _bf16_lanes(t)
    return n is not None and n % 8 != 0


def _shuffled_from_odd_bf16(value: ir.Value) -> bool:
    """Is `value` lanes a vector.shuffle picks out of an odd-lane bf16 vector (a strided
    pooling's taps)? LLVM folds the shuffle into its conversion and aborts on the odd
    width ("soft promote")."""
    op = defining_op(value)
    return (isinstance(op, ir.Operation) and op.name == "vector.shuffle"
            and any(_scalar_or_odd_bf16(v.type) for v in op.operands))


def odd_bf16_conversions_as_integer_ops(payload: ir.Module, *, all_lane_counts: bool = False) -> int:
    """Conversions from and to bf16 scalars and bf16 vectors of an odd lane count
    (_scalar_or_odd_bf16) or any other lane count not a multiple of 8 (_ragged_bf16)
    through f32, with the bf16 <-> f32 step as integer ops on the
    bits: extf(x) = bitcast(zext(bits(x)) << 16); truncf(y) rounds to nearest even,
    bits = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 for u = bits(y), and a NaN gives the quiet
    NaN 0x7FC0, as torch's conversion. Other sources and destinations (f64, integers)
    convert to or from f32 first, as torch's bfloat16 does. Scalars and one-lane vectors
    too: LLVM's vectorizers join them (the scalar loops of ops left unvectorized, their
    loads folded into bf16 loads) into bf16 vectors of any width and shuffle them for
    strided reads, which the x86 backend cannot select ("X86ISD::VPERM2X128", "soft
    promote"); as integer ops they are i16 and i32 lanes. So are the conversions of lanes a
    vector.shuffle picks out of an odd-lane vector (_shuffled_from_odd_bf16). With `all_lane_counts` (a CPU
    without a bf16 conversion instruction: module docstring), the conversions of bf16
    vectors of any lane count too. Every extension from bf16, on every host: it costs the
    same shift, and an fpext LLVM sees invites its combines to narrow an f32 max or min of
    it with a bf16-exact constant (an exp's clamp at -87.5) into a bf16 one, which x86
    emulates with conversions both ways and 16-bit blends (a bf16 cross-entropy backward:
    71.6 -> 56.6 ms on 2 threads). Returns the number rewritten."""
    from torch_mlir.dialects import arith

    targets = []

    def visit(op):
        if op.name in ("arith.extf", "arith.truncf", "arith.sitofp", "arith.uitofp",
                       "arith.fptosi", "arith.fptoui") and (
                _scalar_or_odd_bf16(op.operands[0].type) or _scalar_or_odd_bf16(op.results[0].type)
                or _ragged_bf16(op.operands[0].type) or _ragged_bf16(op.results[0].type)
                or _shuffled_from_odd_bf16(op.operands[0])
                or (all_lane_counts and (_bf16_lanes(op.operands[0].type) is not None
                                         or _bf16_lanes(op.results[0].type) is not None))
                or (op.name == "arith.extf" and _bf16_lanes(op.operands[0].type) is not None)):
            targets.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        i16, i32, f32 = (ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32),
                         ir.F32Type.get())
        for op in targets:
            source = op.operands[0].type
            if isinstance(source, ir.VectorType):
                shape = ir.VectorType(source).shape
                v16, v32, vf32 = (ir.VectorType.get(shape, t) for t in (i16, i32, f32))
            else:
                v16, v32, vf32 = i16, i32, f32

            def splat(value):
                if v32 == i32:
                    return arith.constant(i32, ir.IntegerAttr.get(i32, value))
                return arith.constant(v32, ir.DenseElementsAttr.get_splat(v32, ir.IntegerAttr.get(i32, value)))

            def from_bf16(x):
                wide = arith.extui(v32, arith.bitcast(v16, x))
                return arith.bitcast(vf32, arith.shli(wide, splat(16)))

            def to_bf16(y, result_t):
                u = arith.bitcast(v32, y)
                odd = arith.andi(arith.shrui(u, splat(16)), splat(1))
                rounded = arith.shrui(arith.addi(u, arith.addi(odd, splat(0x7FFF))), splat(16))
                nan = arith.cmpf(arith.CmpFPredicate.UNO, y, y)
                return arith.bitcast(result_t, arith.trunci(v16, arith.select(nan, splat(0x7FC0), rounded)))

            with ir.InsertionPoint(op), op.location:
                x, result_t = op.operands[0], op.results[0].type
                if _bf16_lanes(x.type) is not None:  # bf16 -> f32 -> the destination
                    y = from_bf16(x)
                    if op.name == "arith.extf":
                        value = y if result_t == vf32 else arith.extf(result_t, y)
                    else:
                        value = ir.Operation.create(op.name, results=[result_t], operands=[y]).result
                else:  # the source -> f32 -> bf16
                    if op.name in ("arith.sitofp", "arith.uitofp"):
                        y = ir.Operation.create(op.name, results=[vf32], operands=[x]).result
                    else:
                        y = x if x.type == vf32 else arith.truncf(vf32, x)
                    value = to_bf16(y, result_t)
            op.results[0].replace_all_uses_with(value)
            op.erase()
    return len(targets)


# LLVM-dialect ops that only move the lanes of a vector (no arithmetic on their values).
_MOVES = {"llvm.load", "llvm.store", "llvm.shufflevector", "llvm.insertelement",
          "llvm.extractelement", "llvm.select", "llvm.mlir.poison", "llvm.mlir.undef",
          "llvm.mlir.zero", "llvm.mlir.constant", "llvm.intr.masked.load",
          "llvm.intr.masked.store", "llvm.intr.masked.gather", "llvm.intr.masked.scatter",
          "llvm.bitcast", "llvm.br", "llvm.cond_br"}


def odd_bf16_vectors_as_i16(payload: ir.Module, *, all_lane_counts: bool = False) -> int:
    """Retype every odd-lane bf16 vector value (with `all_lane_counts`, every bf16 vector
    value: module docstring) that only loads, stores, shuffles, inserts,
    extracts, selects, branches carry or constants define to the i16 vector of the same
    bits; the other bf16 operands and results of those ops (a power-of-two vector that a
    shuffle narrows, a scalar inserted or extracted) are bitcast at the boundary. Any other
    op on such a value is an UnsupportedError (LLVM would abort the process), raised before
    anything is rewritten. Returns the number of values retyped."""
    odd: list[ir.Value] = []
    movers: list[ir.Operation] = []
    others: list[str] = []
    pinned: set = set()  # values an op other than a move reads or defines

    def _odd_bf16_vector(t: ir.Type) -> bool:
        return _bf16_vector(t) if all_lane_counts else _odd_lanes(t)

    def visit(op):
        if op.name in ("llvm.func", "builtin.module"):
            return ir.WalkResult.ADVANCE
        touches = any(_odd_bf16_vector(v.type) for v in list(op.operands) + list(op.results))
        for region in op.regions:
            for block in region.blocks:
                odd.extend(a for a in block.arguments if _odd_bf16_vector(a.type))
        if touches:
            known = op.name in _MOVES or _row_of_constant(op, _odd_bf16_vector)
            (movers.append(op) if known else others.append(op.name))
            if not known:
                pinned.update(v for v in list(op.operands) + list(op.results)
                              if _odd_bf16_vector(v.type))
        odd.extend(v for v in op.results if _odd_bf16_vector(v.type))
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    if all_lane_counts:  # a power-of-two vector an intrinsic reads (vdpbf16ps) stays bf16
        odd = [v for v in odd if v not in pinned]
        others = [name for name in others if any(_odd_lanes(v.type) for v in pinned)]
    if others:
        raise UnsupportedError(f"bf16 vectors of an odd lane count reach "
                               f"{', '.join(sorted(set(others)))}, which LLVM's x86 backend "
                               f"cannot compile")
    if not odd:
        return 0
    from torch_mlir.dialects import llvm

    with payload.context, ir.Location.unknown():
        i16 = ir.IntegerType.get_signless(16)
        bf16 = ir.BF16Type.get()

        def as_i16(t: ir.Type) -> ir.Type:
            return ir.VectorType.get(ir.VectorType(t).shape, i16) if isinstance(t, ir.VectorType) else i16

        def is_bf16(t: ir.Type) -> bool:
            return t == bf16 or (isinstance(t, ir.VectorType) and ir.VectorType(t).element_type == bf16)

        for value in odd:
            op = defining_op(value)
            if op is not None and (op.name == "llvm.mlir.constant"
                                   or _row_of_constant(op, _odd_bf16_vector)):
                if op.name == "llvm.mlir.constant":
                    attr, row = ir.DenseElementsAttr(op.attributes["value"]), 0
                else:  # one row of a multi-dimensional constant (an llvm.array of vectors)
                    constant = defining_op(op.operands[0])
                    attr = ir.DenseElementsAttr(constant.attributes["value"])
                    shape, row = list(attr.type.shape), 0
                    for d, p in zip(shape, ir.DenseI64ArrayAttr(op.attributes["position"])):
                        row = row * d + p
                with ir.InsertionPoint(op), op.location:
                    bits = _bf16_bits(attr, as_i16(value.type), row)
                    value.replace_all_uses_with(llvm.ConstantOp(as_i16(value.type), bits).result)
                movers = [m for m in movers if m != op]
                op.erase()
                continue
            value.set_type(as_i16(value.type))
        for op in movers:
            if op.name in ("llvm.br", "llvm.cond_br"):
                continue  # block arguments were retyped with the values they carry
            if op.name == "llvm.bitcast" and op.operands[0].type == op.results[0].type:
                op.results[0].replace_all_uses_with(op.operands[0])  # bf16 <-> i16: now i16 both
                op.erase()
                continue
            with op.location:
                for i, operand in enumerate(list(op.operands)):
                    if is_bf16(operand.type):
                        with ir.InsertionPoint(op):
                            op.operands[i] = llvm.bitcast(as_i16(operand.type), operand)
                for result in op.results:
                    if is_bf16(result.type):
                        original = result.type
                        result.set_type(as_i16(original))
                        with ir.InsertionPoint.after(op):
                            cast = llvm.bitcast(original, result)
                        result.replace_all_uses_except(cast, cast.owner.operation)
    return len(odd)


_MEMORY = ("llvm.load", "llvm.store", "llvm.intr.masked.load", "llvm.intr.masked.store")


def bf16_memory_as_i16(payload: ir.Module) -> int:
    """Loads and stores of bf16 (scalars and vectors of any lane count, masked or not) move
    the bits as i16: LLVM's x86 backend has no masked bf16 memory ops and scalarizes them
    into bf16 scalar loads and stores it cannot select ("Cannot select: store (s16)"), and
    its loop vectorizer turns a scalar bf16 copy loop (a strided copy, the zero-stuffed input
    of a transposed convolution) into bf16 vectors of odd widths it aborts on. Exact: the
    same bits move, a bitcast on each side (a load and store pair of a copy then meet as
    i16 alone). Returns the number rewritten."""
    from torch_mlir.dialects import llvm

    targets = []

    def visit(op):
        if op.name in _MEMORY and any(_bf16_typed(v.type)
                                      for v in list(op.operands) + list(op.results)):
            targets.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    with payload.context:
        i16 = ir.IntegerType.get_signless(16)

        def as_i16(t: ir.Type) -> ir.Type:
            return ir.VectorType.get(ir.VectorType(t).shape, i16) if isinstance(t, ir.VectorType) else i16

        for op in targets:
            with op.location:
                for i, operand in enumerate(list(op.operands)):
                    if _bf16_typed(operand.type):
                        with ir.InsertionPoint(op):
                            op.operands[i] = llvm.bitcast(as_i16(operand.type), operand)
                for result in op.results:
                    if _bf16_typed(result.type):
                        original = result.type
                        result.set_type(as_i16(original))
                        with ir.InsertionPoint.after(op):
                            cast = llvm.bitcast(original, result)
                        result.replace_all_uses_except(cast, cast.owner.operation)
    return len(targets)


def _bf16_typed(t: ir.Type) -> bool:
    return isinstance(t, ir.BF16Type) or _bf16_vector(t)


def _bf16_vector(t: ir.Type) -> bool:
    return isinstance(t, ir.VectorType) and isinstance(ir.VectorType(t).element_type, ir.BF16Type)


def _row_of_constant(op, retyped) -> bool:
    """Is `op` an llvm.extractvalue of one bf16 vector `retyped` takes out of a dense
    constant?"""
    if op.name != "llvm.extractvalue" or not retyped(op.results[0].type):
        return False
    source = defining_op(op.operands[0])
    return (isinstance(source, ir.Operation) and source.name == "llvm.mlir.constant"
            and isinstance(source.attributes["value"], ir.DenseElementsAttr))


def _bf16_bits(attr: ir.DenseElementsAttr, wide: ir.VectorType, row: int = 0) -> ir.DenseElementsAttr:
    """The dense i16 attribute holding the bf16 bit patterns of `attr` (of its row `row`,
    of as many elements as `wide` holds, when `attr` has more). Read from the attribute's
    text: the bindings give no bf16 values (decimal literals, 0x bit patterns, or a hex blob
    of the raw little-endian bits)."""
    import re

    import numpy as np
    import torch

    text = str(attr)
    inner = text[text.index("dense<") + 6:text.rindex(">")]
    if inner.startswith('"0x'):
        bits = np.frombuffer(bytes.fromhex(inner[3:inner.rindex('"')]), dtype="<i2").tolist()
    else:
        bits = []
        for token in re.findall(r"0x[0-9A-Fa-f]+|[-+]?[0-9][0-9.]*(?:[eE][-+]?[0-9]+)?", inner):
            if token.startswith("0x"):
                bits.append(np.array(int(token, 16), dtype=np.uint16).view(np.int16).item())
            else:
                bits.append(torch.tensor(float(token)).to(torch.bfloat16).view(torch.int16).item())
    i16 = wide.element_type
    if attr.is_splat or len(bits) == 1:
        return ir.DenseElementsAttr.get_splat(wide, ir.IntegerAttr.get(i16, bits[0]))
    n = int(np.prod(wide.shape))
    row_bits = bits[row * n:(row + 1) * n]
    return ir.DenseElementsAttr.get(np.array(row_bits, dtype=np.int16).reshape(wide.shape), type=wide)
