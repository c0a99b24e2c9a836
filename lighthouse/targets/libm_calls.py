"""f64 math that LLVM's lowering gets wrong or lacks, as calls of the C library.

convert-math-to-llvm computes log1p(x) as log(1 + x) and expm1(x) as exp(x) - 1, which
lose every digit below |x| ~ 1e-8 in f64, and has no lowering of erf, erfc, asinh, acosh,
atanh or cbrt (the JIT failed to create the engine). f32 has its own expansions
(transform_ext.expand_math). Each f64 op here, scalar or vector (one call per lane), becomes
a `func.call` of the libm function of its name, which the JIT resolves in the process.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import func, vector

LIBM = ("log1p", "expm1", "erf", "erfc", "asinh", "acosh", "atanh", "cbrt")


def _declare(module, name: str, f64) -> None:
    for op in module.body.operations:
        if op.operation.name == "func.func" and \
                ir.StringAttr(op.attributes["sym_name"]).value == name:
            return
    with ir.InsertionPoint.at_block_begin(module.body), ir.Location.unknown():
        decl = func.FuncOp(name, ir.FunctionType.get([f64], [f64]))
        decl.attributes["sym_visibility"] = ir.StringAttr.get("private")


def _call(name: str, value, f64):
    return func.CallOp([f64], ir.FlatSymbolRefAttr.get(name), [value]).result


def f64_math_as_libm_calls(module) -> int:
    """Rewrite every f64 math op of LIBM in `module`; return the count."""
    targets = []

    def visit(op):
        name = op.name.removeprefix("math.")
        if op.name.startswith("math.") and name in LIBM:
            t = op.results[0].type
            element = t.element_type if isinstance(t, ir.VectorType) else t
            if isinstance(element, ir.F64Type):
                targets.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if not targets:
        return 0
    with module.context:
        f64 = ir.F64Type.get()
        for op in targets:
            name = op.name.removeprefix("math.")
            _declare(module, name, f64)
            t = op.results[0].type
            with ir.InsertionPoint(op), op.location:
                if not isinstance(t, ir.VectorType):
                    result = _call(name, op.operands[0], f64)
                else:
                    shape = list(t.shape)
                    lanes = 1
                    for n in shape:
                        lanes *= n
                    flat_type = ir.VectorType.get([lanes], f64)
                    flat = vector.shape_cast(flat_type, op.operands[0])
                    acc = flat
                    for i in range(lanes):
                        lane = vector.extract(flat, [], [i])
                        acc = vector.insert(_call(name, lane, f64), acc, [], [i])
                    result = vector.shape_cast(t, acc)
            op.results[0].replace_all_uses_with(result)
            op.erase()
    return len(targets)
