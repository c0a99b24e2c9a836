"""fold_scalar_or_splat_constant: inputs of linalg.generic that hold one value everywhere
become that scalar inside the body.

An input x of a generic G is folded when it is
  - a scalar (non-shaped) operand: the body reads the value itself;
  - a splat dense constant (`arith.constant dense<0.125> : tensor<...>`): an
    `arith.constant 0.125` is created before G and the body reads it;
  - the result of `linalg.fill ins(%v)` with %v of x's element type: the body reads %v.
G is rebuilt without x (its operand, indexing map and body argument). Since x[i] = c for
every i, the body computes the same values. Then casts in the body whose operand is a
constant (`arith.truncf %cst : f64 to f32`, extf, sitofp, uitofp) are folded into a constant
of the result type, rounded to nearest-even as the cast would at run time; canonicalization
folds constant arithmetic (addf, mulf, ...) but not an inexact truncf.

Precondition: after dropping the folded inputs, every loop dim of G is still a plain dim
of some operand's indexing map (its extent stays known). An input whose removal would
lose a loop extent is kept; when the target op itself is such a generic the op fails
(silenceable, payload unchanged). Only linalg.generic is rewritten (generalize named ops
first). Targets: generics equal to or nested in the target ops; the result holds the
targets, rewritten generics replaced by their new versions.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, transform

from .analysis.maps import terms
from .common import (Illegal, ReplacesTargets, Success, body_of, build_generic, clone_body,
                     constant_value, defining_op, element_type, fail, iterator_kinds, payload_ops,
                     walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.fold_scalar_or_splat_constant"
_CASTS = ("arith.truncf", "arith.extf", "arith.sitofp", "arith.uitofp")


def _scalar_of(value: ir.Value):
    """('value', v) / ('attr', a) when the input `value` holds one scalar everywhere."""
    if not isinstance(value.type, ir.ShapedType):
        return ("value", value)
    op = defining_op(value)
    if op is None:
        return None
    if op.name == "arith.constant":
        attr = constant_value(value)
        return ("attr", attr) if attr is not None else None
    if op.name == "linalg.fill" and len(op.operands) == 2:
        v = op.operands[0]
        if v.type == element_type(value.type):
            return ("value", v)
    return None


def _covered_loops(maps, keep: list[int]) -> set[int]:
    covered = set()
    for i in keep:
        ts = terms(maps[i])
        if ts is None:
            expr_dims = [e.position for e in maps[i].results if isinstance(e, ir.AffineDimExpr)]
            covered.update(expr_dims)
        else:
            covered.update(t for t in ts if isinstance(t, int))
    return covered


def _foldable_cast(op: ir.Operation):
    """The constant attribute a cast of a constant folds to, else None."""
    if op.name not in _CASTS or len(op.operands) != 1:
        return None
    src = op.operands[0]
    if isinstance(src.type, ir.ShapedType) or defining_op(src) is None:
        return None
    if defining_op(src).name != "arith.constant":
        return None
    attr = constant_value(src)
    result_type = op.results[0].type
    if "roundingmode" in op.attributes and \
            ir.IntegerAttr(op.attributes["roundingmode"]).value != arith.RoundingMode.to_nearest_even:
        return None
    if op.name in ("arith.truncf", "arith.extf") and isinstance(attr, ir.FloatAttr):
        return ir.FloatAttr.get(result_type, attr.value)
    if op.name in ("arith.sitofp", "arith.uitofp") and isinstance(attr, ir.IntegerAttr):
        width = attr.type.width
        raw = attr.value
        if op.name == "arith.uitofp" and raw < 0:
            raw += 1 << width
        if width == 1 or abs(raw) >= 1 << 53:
            return None
        return ir.FloatAttr.get(result_type, float(raw))
    return None


def foldable_casts(generic) -> list[ir.Operation]:
    """Casts of constants in the body of `generic` (not counting ones that need a fold first)."""
    return [op.operation for op in body_of(generic).operations
            if _foldable_cast(op.operation) is not None]


def plan_generic(generic) -> tuple[dict[int, tuple], list[int]]:
    """({input index: scalar} to fold, [inputs that hold a scalar but must stay])."""
    g = generic.opview
    inputs = list(g.inputs)
    maps = [m.value for m in g.indexing_maps]
    n_ops = len(maps)
    n_loops = maps[0].n_dims if maps else 0
    candidates = {i: s for i, v in enumerate(inputs) if (s := _scalar_of(v)) is not None}
    fold: dict[int, tuple] = {}
    blocked: list[int] = []
    for i, scalar in candidates.items():
        keep = [j for j in range(n_ops) if j != i and j not in fold]
        if _covered_loops(maps, keep) >= set(range(n_loops)):
            fold[i] = scalar
        else:
            blocked.append(i)
    return fold, blocked


def _fold_casts(generic: ir.Operation) -> None:
    """Replace casts of constants in the body by constants created before `generic`."""
    changed = True
    while changed:
        changed = False
        for op in list(body_of(generic).operations):
            op = op.operation
            attr = _foldable_cast(op)
            if attr is None:
                continue
            with ir.InsertionPoint(generic), op.location:
                const = arith.ConstantOp(attr.type, attr)
            op.results[0].replace_all_uses_with(const.result)
            op.erase()
            changed = True


def _rebuild(generic, fold: dict[int, tuple], rewriter) -> ir.Operation:
    g = generic.opview
    inputs = list(g.inputs)
    outputs = list(g.outputs)
    maps = [m.value for m in g.indexing_maps]
    keep = [i for i in range(len(inputs)) if i not in fold]
    with ir.InsertionPoint(generic), generic.location:
        scalars = {}
        for i, (kind, what) in fold.items():
            scalars[i] = what if kind == "value" else arith.ConstantOp(what.type, what).result
        old_args = list(body_of(generic).arguments)

        def body(args):
            mapping = {old_args[i]: scalars[i] for i in fold}
            new_positions = keep + list(range(len(inputs), len(old_args)))
            for new_arg, old_pos in zip(args, new_positions):
                mapping[old_args[old_pos]] = new_arg
            return clone_body(generic, mapping)

        new = build_generic([inputs[i] for i in keep], outputs,
                            [maps[i] for i in keep] + maps[len(inputs):],
                            iterator_kinds(generic), body, name_from=generic)
    rewriter.replace_op(generic, list(new.results))
    return new.operation


class FoldScalarOrSplatConstantOp(TransformExt.Operation, name="fold_scalar_or_splat_constant"):
    target: ext.Operand[transform.AnyOpType]
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                plan = []
                try:
                    for target in targets:
                        for g in walk_ops(target, lambda o: o.name == "linalg.generic"):
                            if not all(isinstance(r.type, ir.RankedTensorType) for r in g.results):
                                continue
                            fold, blocked = plan_generic(g)
                            if blocked and g == target:
                                raise Illegal(g, f"inputs {blocked} hold one value but are the only "
                                                 f"operands giving the extent of a loop dim")
                            if fold or foldable_casts(g):
                                plan.append((g, fold))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                replaced = {}
                for g, fold in plan:
                    new = _rebuild(g, fold, rewriter) if fold else g
                    _fold_casts(new)
                    replaced[id(g)] = new
                out = [next((replaced[id(g)] for g, _ in plan if g == t), t) for t in targets]
                results.set_ops(op.result, out)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def fold_scalar_or_splat_constant(target: ir.Value) -> ir.Value:
    """Fold scalar, splat-constant and filled inputs of the generics in `target` into their
    bodies, and casts of constants there; returns the updated targets."""
    return FoldScalarOrSplatConstantOp(target).result


__all__ = ["FoldScalarOrSplatConstantOp", "fold_scalar_or_splat_constant"]
