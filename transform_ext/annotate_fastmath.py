"""annotate_fastmath: add fast-math flags to the arith and math ops under the targets.

Every op of the arith and math dialects that carries a `fastmath` attribute (addf, mulf,
divf, maximumf, cmpf, extf, truncf, exp, log, tanh, sqrt, ...) nested in the target ops
gets the union of its flags and `flags`. What each flag allows, and when it changes results:
  afn       approximate math functions (exp, log, tanh ... lowered by cheaper sequences):
            results move by a few ulp; infinities and NaNs still behave (exp(-inf) = 0).
            The flag the schedules use.
  contract  fuse a * b + c into an FMA: one rounding instead of two (more accurate, but not
            bit-identical to the unfused sum).
  reassoc   reorder (a + b) + c as a + (b + c): reductions vectorized and summed in another
            order round differently (relative error grows with the length); it also lets
            LLVM rewrite exp(a) / exp(b) as exp(a - b), which may overflow differently.
  arcp      x / y as x * (1 / y): one more rounding.
  nsz       the sign of a zero may be lost (1 / -0 = -inf becomes +inf).
  nnan      NaN operands or results are poison: maximumf stops propagating NaN, x != x is
            folded to false, select(isnan(x), ...) guards are dropped.
  ninf      infinite operands or results are poison: SDPA's -inf masks (exp(-inf) = 0,
            x == -inf for fully masked rows, max(-inf, ...)) silently give wrong answers.
  fast      all of the above.
nnan and ninf are only correct when no NaN / infinity can reach the op; the op refuses
them on an op that reads a NaN / infinite constant, directly or as a linalg body argument
whose operand is one (the -inf init of a max reduction, the -inf of a masked-row compare):
a silenceable failure naming the op, nothing changed.
The target handle is only read; ops are updated in place.
"""

import math

from torch_mlir import ir
from torch_mlir.dialects import arith as _arith  # noqa: F401  (registers the op views)
from torch_mlir.dialects import ext, transform
from torch_mlir.dialects import math as _math  # noqa: F401

from .common import (Illegal, RewritesTargets, Success, constant_value, fail, is_linalg,
                     payload_ops, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.annotate_fastmath"
FLAGS = ("reassoc", "nnan", "ninf", "nsz", "arcp", "contract", "afn")


def parse_flags(flags) -> list[str]:
    """'afn,contract' / ['afn', 'contract'] / 'fast' -> the flags, in canonical order."""
    items = flags.split(",") if isinstance(flags, str) else list(flags)
    items = [f.strip() for f in items if f.strip()]
    out = set()
    for f in items:
        if f == "fast":
            out.update(FLAGS)
        elif f == "none":
            continue
        elif f in FLAGS:
            out.add(f)
        else:
            raise ValueError(f"unknown fastmath flag {f!r}; flags are: {', '.join(FLAGS)}, fast")
    return [f for f in FLAGS if f in out]


def _has_fastmath(op: ir.Operation) -> bool:
    dialect = op.name.split(".", 1)[0]
    return dialect in ("arith", "math") and hasattr(type(op.opview), "fastmath")


def current_flags(op: ir.Operation) -> list[str]:
    if "fastmath" not in op.attributes:
        return []
    text = str(op.attributes["fastmath"])
    inner = text[text.index("<") + 1:text.rindex(">")]
    return parse_flags(inner)


def _non_finite_constant(value: ir.Value):
    """'NaN' / 'inf' / '-inf' when `value` is such a constant, or the body argument of a
    linalg op whose operand is (e.g. a max reduction's -inf init)."""
    if isinstance(value, ir.BlockArgument):
        owner = value.owner.owner
        owner = getattr(owner, "operation", owner)
        if owner is None or not is_linalg(owner) or value.arg_number >= len(owner.operands):
            return None
        value = owner.operands[value.arg_number]
    attr = constant_value(value)
    if isinstance(attr, ir.FloatAttr):
        v = attr.value
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
    return None


def check(op: ir.Operation, flags: list[str]) -> None:
    for v in op.operands:
        kind = _non_finite_constant(v)
        if kind == "NaN" and "nnan" in flags:
            raise Illegal(op, "nnan on an op that reads a NaN constant")
        if kind in ("inf", "-inf") and "ninf" in flags:
            raise Illegal(op, f"ninf on an op that reads the constant {kind}")


class AnnotateFastmathOp(TransformExt.Operation, name="annotate_fastmath"):
    target: ext.Operand[transform.AnyOpType]
    flags: ir.StringAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                ops = []
                try:
                    flags = parse_flags(ir.StringAttr(op.flags).value)
                    for target in targets:
                        for inner in walk_ops(target, _has_fastmath):
                            check(inner, flags)
                            ops.append(inner)
                except ValueError as exc:
                    op.location.emit_error(f"{NAME}: {exc}")
                    return transform.DiagnosedSilenceableFailure.DefiniteFailure
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for inner in ops:
                    merged = parse_flags(current_flags(inner) + flags)
                    if merged != current_flags(inner):
                        text = ",".join(merged)
                        inner.attributes["fastmath"] = ir.Attribute.parse(f"#arith.fastmath<{text}>")
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def annotate_fastmath(target: ir.Value, flags) -> None:
    """Add `flags` ('afn', 'afn,contract', ['reassoc', 'nsz'], 'fast') to the fastmath
    attribute of the arith/math ops nested in `target`."""
    text = ",".join(parse_flags(flags))
    AnnotateFastmathOp(target, ir.StringAttr.get(text))


__all__ = ["AnnotateFastmathOp", "annotate_fastmath", "parse_flags", "FLAGS"]
