"""Is a value separable in the running value m of a max/min reduction? And how?

Online fusion (see fuse_dependent_reduction_ops) needs, for an elementwise expression E(x, m)
over data x and the reduction result m (broadcast along the reduced axis), a proof that

    E(x, m) = A(x) * exp(beta * m) [* [m != c]]            (MUL form)

so that moving m from m_old to m_new rescales every earlier contribution by the same factor
exp(beta * (m_new - m_old)) (in the stable form: no exp(-m) alone, which overflows), and the
optional indicator (the fully-masked-row guard `select(m == c, 0, ...)`) contributes nothing
while m == c.

The proof propagates a form per scalar SSA value of the (composed) linalg bodies:
  X            independent of m (data, constants; `const` holds a known numeric value)
  ADD(beta)    a(x) + beta * m
  MUL(beta)    a(x) * exp(beta * m), optionally times an indicator of m
  PRED         a comparison of m itself with a constant (only usable as a select condition)
Rules: add/sub keep ADD (betas add/subtract); multiplying or dividing ADD by a known constant
scales beta; mul/div keep MUL (betas add/subtract); neg keeps both; exp/exp2 turn ADD into
MUL; log turns MUL (without indicator) into ADD; extf/truncf keep the form; select with an
X condition keeps a common form (or MUL against a literal 0); select(PRED, 0, MUL) is MUL with
an indicator. Anything else touching m is not separable and the reason names the op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_mlir import ir

from ..common import defining_op


@dataclass(frozen=True)
class Form:
    kind: str                  # "X" | "ADD" | "MUL" | "PRED"
    beta: float = 0.0
    const: float | None = None  # for X: the known numeric value, if any
    indicator: bool = False

    @staticmethod
    def x(const=None) -> "Form":
        return Form("X", const=const)


class NotSeparable(Exception):
    """The expression is not of a separable form; the message says which op breaks it."""


def _float_const(value: ir.Value) -> float | None:
    op = defining_op(value)
    if op is None or op.name != "arith.constant":
        return None
    attr = op.attributes["value"]
    if isinstance(attr, ir.FloatAttr):
        return attr.value
    if isinstance(attr, ir.IntegerAttr):
        return float(attr.value)
    return None


class FormAnalysis:
    """Computes forms of scalar values inside linalg bodies.

    `leaf(value)` is called for block arguments; it returns the form of the operand the block
    argument stands for (the caller decides what m, data and chained ops are)."""

    def __init__(self, leaf):
        self.leaf = leaf
        self.cache: dict = {}

    def form(self, value: ir.Value) -> Form:
        if value in self.cache:
            return self.cache[value]
        if isinstance(value, ir.BlockArgument):
            result = self.leaf(value)
        else:
            result = self._op_form(value)
        self.cache[value] = result
        return result

    def _op_form(self, value: ir.Value) -> Form:
        op = defining_op(value)
        name = op.name
        if name == "arith.constant":
            return Form.x(_float_const(value))
        args = [self.form(v) for v in op.operands]
        if all(a.kind == "X" for a in args):
            return Form.x(self._fold(name, args))
        if name in ("arith.extf", "arith.truncf"):
            return args[0]
        if name == "arith.negf":
            a = args[0]
            return Form(a.kind, -a.beta, indicator=a.indicator) if a.kind != "PRED" else self._no(op)
        if name in ("arith.addf", "arith.subf"):
            a, b = args
            sign = 1.0 if name == "arith.addf" else -1.0
            if a.kind in ("X", "ADD") and b.kind in ("X", "ADD"):
                return Form("ADD", a.beta + sign * b.beta)
            return self._no(op)
        if name in ("arith.mulf", "arith.divf"):
            a, b = args
            div = name == "arith.divf"
            if a.kind == "ADD" and b.kind == "X" and b.const not in (None, 0.0):
                return Form("ADD", a.beta / b.const if div else a.beta * b.const)
            if not div and b.kind == "ADD" and a.kind == "X" and a.const is not None:
                return Form("ADD", b.beta * a.const)
            if a.kind in ("X", "MUL") and b.kind in ("X", "MUL"):
                if div and b.indicator:
                    return self._no(op)
                beta = a.beta - b.beta if div else a.beta + b.beta
                return Form("MUL", beta, indicator=a.indicator or b.indicator)
            return self._no(op)
        if name in ("math.exp", "math.exp2"):
            a = args[0]
            if a.kind == "ADD":
                scale = math.log(2.0) if name == "math.exp2" else 1.0
                return Form("MUL", a.beta * scale)
            return self._no(op)
        if name == "math.log":
            a = args[0]
            if a.kind == "MUL" and not a.indicator:
                return Form("ADD", a.beta)
            return self._no(op)
        if name == "arith.cmpf":
            lhs, rhs = op.operands
            fl, fr = args
            if (fl.kind == "ADD" and fl.beta == 1.0 and self._is_m(lhs) and fr.kind == "X"
                    and fr.const is not None):
                return Form("PRED")
            if (fr.kind == "ADD" and fr.beta == 1.0 and self._is_m(rhs) and fl.kind == "X"
                    and fl.const is not None):
                return Form("PRED")
            return self._no(op)
        if name == "arith.select":
            c, a, b = args
            if c.kind == "X":
                if a.kind == b.kind == "MUL" and a.beta == b.beta:
                    return Form("MUL", a.beta, indicator=a.indicator or b.indicator)
                if a.kind == "MUL" and b.kind == "X" and b.const == 0.0:
                    return a
                if b.kind == "MUL" and a.kind == "X" and a.const == 0.0:
                    return b
                if a.kind == b.kind == "ADD" and a.beta == b.beta:
                    return a
                return self._no(op)
            if c.kind == "PRED":
                if a.kind == "X" and a.const == 0.0 and b.kind == "MUL":
                    return Form("MUL", b.beta, indicator=True)
                if b.kind == "X" and b.const == 0.0 and a.kind == "MUL":
                    return Form("MUL", a.beta, indicator=True)
            return self._no(op)
        return self._no(op)

    def _is_m(self, value: ir.Value) -> bool:
        """True when `value` is the reduction result itself (a block arg with form ADD(1))."""
        return isinstance(value, ir.BlockArgument) and self.form(value) == Form("ADD", 1.0)

    @staticmethod
    def _fold(name: str, args: list[Form]) -> float | None:
        vals = [a.const for a in args]
        if any(v is None for v in vals):
            return None
        try:
            if name in ("arith.extf", "arith.truncf"):
                return vals[0]
            if name == "arith.negf":
                return -vals[0]
            if name == "arith.mulf":
                return vals[0] * vals[1]
            if name == "arith.divf":
                return vals[0] / vals[1]
            if name == "arith.addf":
                return vals[0] + vals[1]
            if name == "arith.subf":
                return vals[0] - vals[1]
        except (ZeroDivisionError, OverflowError):
            return None
        return None

    @staticmethod
    def _no(op: ir.Operation) -> Form:
        raise NotSeparable(f"{op.name} does not keep a separable dependence on the reduction result")
