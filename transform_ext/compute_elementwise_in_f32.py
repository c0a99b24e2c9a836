"""compute_elementwise_in_f32: each f16/bf16 elementwise op computes in f32 and rounds once.

torch's eager CPU kernels compute an f16/bf16 op in f32 ("opmath", a Python scalar operand
as an f32 value) and round its result: `x * 0.1 + 1` in bf16 is
round(round(x * 0.1f) + 1). torch-mlir imports each such aten op as an elementwise
linalg.generic whose body computes in the narrow type; LLVM, which has no such arithmetic,
gets it extended op by op with casts marked `contract`, and after fusion canonicalization
folds the extf(truncf(v)) between two ops: the chain then rounds once where torch rounds
after every op (an ulp apart, which a layer norm over three elements turns into 0.1).

Rewritten: each all-parallel linalg.generic whose body computes (an arith or math op with
an f16/bf16 result) on narrow values. In its body
- narrow block arguments are extended to f32 where they are read;
- narrow constants, and f64/f32 constants rounded to the narrow type (torch-mlir's form of
  a Python scalar), become f32 constants;
- arith/math ops with narrow results compute in f32 on the widened operands; an exact op
  (select, negf, absf, max/min, cmpf, copysign) whose operands are all narrow values of the
  payload stays as it is (a masked_fill stays the select the attention matchers know);
- each narrow yielded value is rounded once (`arith.truncf`, round to nearest even as
  torch's conversion). The casts carry no fastmath flags, so nothing folds them away across
  fused ops: every op rounds at its boundary, as in torch.
A conversion inside the body (truncf of a computed value, sitofp) stays a rounding point;
a value another op reads in the narrow type is rounded for it. Bodies without narrow
arithmetic (pure conversions, copies, f32 bodies) are left as they are.

Targets: the generics nested in the target ops (usually func.func); every such body can be
rewritten, so there is nothing to reject. The handle is only read; bodies change in place.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .common import (RewritesTargets, Success, constant_value, erase_dead_body_ops, iterator_kinds,
                     payload_ops, walk_ops)
from .dialect import TransformExt

NARROW_FLOATS = ("bf16", "f16")

# arith ops computed in f32 on widened operands (math.* ops all are)
_ARITHMETIC = {"arith.addf", "arith.subf", "arith.mulf", "arith.divf", "arith.remf",
               "arith.negf", "arith.maximumf", "arith.minimumf", "arith.maxnumf",
               "arith.minnumf", "arith.select"}
# ops whose narrow result is exact: computed in f32 only when an operand already is
_EXACT = {"arith.select", "arith.negf", "arith.maximumf", "arith.minimumf", "arith.maxnumf",
          "arith.minnumf", "arith.cmpf", "math.absf", "math.copysign"}


def is_narrow(t: ir.Type) -> bool:
    return str(t) in NARROW_FLOATS


def _computes_on_narrow(op: ir.Operation) -> bool:
    return any((inner.name in _ARITHMETIC or inner.name.startswith("math."))
               and any(is_narrow(r.type) for r in inner.results)
               for inner in op.regions[0].blocks[0].operations)


def widen_body(op: ir.Operation, *, round_results: bool) -> None:
    """Recompute the body of linalg op `op` in f32 (see the module docstring). With
    `round_results`, narrow yielded values are truncated to their result type; without, the
    narrow output block arguments become f32 and f32 is yielded (the caller retypes the
    results: a reduction accumulating in f32)."""
    f32 = ir.F32Type.get()
    n_in = len(op.opview.inputs)
    body = op.regions[0].blocks[0]
    first = body.operations[0]
    original = [inner.operation for inner in body.operations]
    wide: dict = {}  # narrow value -> its f32 value
    retyped: dict = {}  # value computed in f32 in place -> its narrow type

    def widened(v: ir.Value, at: ir.Operation) -> ir.Value:
        if v in wide:
            return wide[v]
        if not is_narrow(v.type):
            return v
        with ir.InsertionPoint(at), op.location:
            return arith.extf(f32, v)

    for j, arg in enumerate(body.arguments):
        if not is_narrow(arg.type):
            continue
        if j < n_in or round_results:
            if any(True for _ in arg.uses):
                with ir.InsertionPoint(first), op.location:
                    wide[arg] = arith.extf(f32, arg)
        else:
            retyped[arg] = arg.type
            arg.set_type(f32)
            wide[arg] = arg
    for inner in original:
        name = inner.name
        if name == "linalg.yield":
            for k, v in enumerate(inner.operands):
                narrow = op.results[k].type.element_type
                if not is_narrow(narrow):
                    continue
                if round_results:
                    if v in wide:
                        with ir.InsertionPoint(inner), op.location:
                            inner.operands[k] = arith.truncf(narrow, wide[v])
                else:
                    inner.operands[k] = widened(v, inner)
            continue
        if name == "arith.constant" and is_narrow(inner.results[0].type):
            value = ir.FloatAttr(inner.attributes["value"]).value
            with ir.InsertionPoint(inner), op.location:
                wide[inner.results[0]] = arith.ConstantOp(f32, ir.FloatAttr.get(f32, value)).result
            continue
        if name == "arith.truncf" and is_narrow(inner.results[0].type):
            src = inner.operands[0]
            if constant_value(src) is not None:  # a scalar: torch's opmath keeps it in f32
                with ir.InsertionPoint(inner), op.location:
                    wide[inner.results[0]] = src if src.type == f32 else arith.truncf(f32, src)
            continue
        if name == "arith.extf" and inner.operands[0] in wide:
            src = wide[inner.operands[0]]
            if inner.results[0].type == f32:
                inner.results[0].replace_all_uses_with(src)
                inner.erase()
            else:
                inner.operands[0] = src
            continue
        if name in _EXACT and not any(v in retyped for v in inner.operands):
            continue
        if (name in _ARITHMETIC or name.startswith("math.")) and any(
                is_narrow(r.type) for r in inner.results):
            for i, v in enumerate(inner.operands):
                w = widened(v, inner)
                if w is not v:
                    inner.operands[i] = w
            for r in inner.results:
                if is_narrow(r.type):
                    retyped[r] = r.type
                    r.set_type(f32)
                    wide[r] = r
            continue
        if name == "arith.cmpf":
            for i, v in enumerate(inner.operands):
                inner.operands[i] = widened(v, inner)
            continue
        for i, v in enumerate(inner.operands):  # a narrow reader: rounded for it
            if v in retyped:
                with ir.InsertionPoint(inner), op.location:
                    inner.operands[i] = arith.truncf(retyped[v], v)
    erase_dead_body_ops(body)  # the narrow constants and extensions nobody reads


class ComputeElementwiseInF32Op(TransformExt.Operation, name="compute_elementwise_in_f32"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                found = [g for t in targets for g in walk_ops(
                    t, lambda o: o.name == "linalg.generic"
                    and all(k == "parallel" for k in iterator_kinds(o))
                    and _computes_on_narrow(o))]
                for g in found:
                    widen_body(g, round_results=True)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def compute_elementwise_in_f32(target: ir.Value) -> ComputeElementwiseInF32Op:
    """Recompute the f16/bf16 elementwise generics nested in `target` in f32, rounding each
    result once (see the module docstring)."""
    return ComputeElementwiseInF32Op(target)


__all__ = ["ComputeElementwiseInF32Op", "compute_elementwise_in_f32", "widen_body",
           "NARROW_FLOATS", "is_narrow"]
