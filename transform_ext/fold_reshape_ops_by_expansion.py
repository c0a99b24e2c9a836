"""fold_reshape_ops_by_expansion: move tensor.collapse_shape / expand_shape across linalg ops
by expanding the ops' iteration spaces (linalg's reshape-by-expansion folding).

  producer collapse:  L(collapse(x), y) = collapse(L'(x, expand(y)))
  consumer expand:    expand(L(x)) = L'(expand(x))
A loop d of L whose tensor dim the reshape splits into sizes (s_1, ..., s_r) becomes r loops
of L' with those extents (same iterator type); every operand dim indexed by d is expanded
the same way, `linalg.index d` in the body becomes the linearized index
((i_1 s_2 + i_2) s_3 + ...) s_r + i_r, and results L does not hand to the folded expand are
collapsed back. Element (i_1, ..., i_r) of L' is element sum_j i_j prod_{l>j} s_l of L, which
is exactly how collapse/expand_shape lay out dims, so every value is computed from the same
inputs as before. Pairs expand(collapse(x)) and collapse(expand(x)) that restore x's type
with the same reassociation fold to x, and an expanded tensor.empty is a new tensor.empty. Applied to a fixed point on the targets' bodies; the
reshapes end up at the graph's boundaries (function arguments and results) or at ops that
cannot absorb them. SDPA's batch matmuls, wrapped in 4-D -> 3-D -> 4-D reshapes by the
importer, become 4-D contractions in one iteration space with their neighbours.

Folded when: L is a linalg op on ranked static tensors whose indexing maps are loop dims or
constants (projected permutations with broadcast constants); each loop dim appears at most
once per map; with `keep_reduction_loops`, a collapse is not folded into a contraction's
reduction loops (the flatten before a linear layer stays a reshape of its input: the
matmul family packs the weight's transpose in place); the reshape is static; a reshape group that is split covers a loop dim (or a
constant index whose group is all ones); the collapse (or the expanded result) has no
other user (as upstream's default control); and, unlike upstream, no other input that
would need a reshape too is read by other ops (the reshape would be stuck there, between
the value's producer and its other users: SDPA's row max, expanded by a unit dim, keeps its
expand instead of pushing it onto the scores). Named ops other than linalg.fill become
linalg.generic (a batch matmul with two batch dims is no named op); fill stays a fill.
Anything else is left alone. A target that is itself a reshape op the op cannot fold is a
silenceable failure naming the reason (a collapse given as a target is folded into each of
its users, however many); other targets are containers whose bodies are rewritten. The result holds the targets (a folded reshape target is dropped from it).
"""

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.maps import Const, affine_map, make_map, terms
from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, body_of, build_generic, clone_body,
                     defining_op, fail, is_linalg, iterator_kinds, payload_ops, reassociation_attr,
                     user_op, walk_ops)
from .dialect import TransformExt

NAME = "transform_ext.fold_reshape_ops_by_expansion"
_RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")
_MAX_FOLDS = 10_000


class CannotFold(Exception):
    pass


@dataclass
class Fold:
    """Fold `reshape` into linalg op `op` through operand number `operand` (an input fed by a
    collapse, or an output whose result feeds an expand)."""

    op: ir.Operation
    operand: int
    reshape: ir.Operation


def reassociation(reshape: ir.Operation) -> list[list[int]]:
    attr = reshape.attributes["reassociation"]
    return [[ir.IntegerAttr(i).value for i in group] for group in attr]


def _static_shape(t: ir.Type) -> list[int] | None:
    if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape:
        return None
    return list(t.shape)


def _op_iterators(op: ir.Operation) -> list[str]:
    if op.name == "linalg.generic":
        return iterator_kinds(op)
    return loop_structure(op).iterators


def check_op(op: ir.Operation) -> list[list]:
    """The operand terms of a linalg op that can be expanded; raises CannotFold."""
    if not is_linalg(op) or not op.regions or not len(op.regions[0].blocks):
        raise CannotFold(f"{op.name} is not a linalg op with a body")
    for v in list(op.operands) + list(op.results):
        if isinstance(v.type, ir.ShapedType) and _static_shape(v.type) is None:
            raise CannotFold(f"{op.name} has an operand or result that is not a static tensor ({v.type})")
    all_terms = []
    for m in linalg.get_indexing_maps(op):
        ts = terms(affine_map(m))
        if ts is None:
            raise CannotFold(f"{op.name} has a composite indexing map {affine_map(m)}")
        dims = [t for t in ts if not isinstance(t, Const)]
        if len(dims) != len(set(dims)):
            raise CannotFold(f"{op.name} reads a loop dim twice in {affine_map(m)}")
        all_terms.append(ts)
    return all_terms


def expansion_of(op: ir.Operation, operand: int, groups: list[list[int]],
                 expanded_shape: list[int]) -> dict[int, list[int]]:
    """{loop dim: sizes} that makes operand `operand` of `op` take the expanded shape."""
    ts = check_op(op)[operand]
    if len(ts) != len(groups):
        raise CannotFold("the reshape's rank does not match the operand's indexing map")
    expand: dict[int, list[int]] = {}
    for t, group in zip(ts, groups):
        sizes = [expanded_shape[i] for i in group]
        if len(sizes) == 1:
            continue
        if isinstance(t, Const):
            if any(s != 1 for s in sizes) or t.value != 0:
                raise CannotFold("the reshape splits a dim that is indexed by a constant")
            continue
        expand[t] = sizes
    return expand


def _check_other_inputs(op: ir.Operation, operand: int, expand: dict[int, list[int]]) -> None:
    """A fold must not put a reshape on an input that other ops also read: it could not move
    further and would sit between that value's producer and its other users."""
    n_in = len(op.operands) - len(op.results)
    for i, ts in enumerate(check_op(op)[:n_in]):
        if i == operand or not any(t in expand for t in ts if not isinstance(t, Const)):
            continue
        value = op.operands[i]
        producer = defining_op(value)
        if producer is None or producer.name in ("tensor.empty", "tensor.collapse_shape"):
            continue
        if len(list(value.uses)) > 1:
            raise CannotFold(f"it would reshape input {i} of {op.name}, which other ops also read")


def _check_reduction_loops(op: ir.Operation, expand: dict[int, list[int]]) -> None:
    """A collapse is not folded into a contraction by splitting its reduction loops (the
    flatten before a linear layer): the weight's transpose would be split the same way,
    and could then not fold into the contraction's operand packing (CvT's 4 MiB weight
    was transposed anew per call)."""
    if not loop_structure(op).is_contraction:
        return
    iterators = _op_iterators(op)
    if any(iterators[d] == "reduction" for d in expand):
        raise CannotFold(f"it would split the reduction loops of the contraction {op.name}")


def plan_fold(reshape: ir.Operation, multi_use: bool = False,
              keep_reduction_loops: bool = False) -> list[Fold]:
    """Folds that absorb `reshape` (one per consumer for a collapse; the producer for an
    expand); raises CannotFold with the reason when there is none. `multi_use` allows a
    collapse with several users (each user absorbs it; used for reshapes given as targets)."""
    if _static_shape(reshape.operands[0].type) is None or _static_shape(reshape.results[0].type) is None:
        raise CannotFold("the reshape is not static")
    groups = reassociation(reshape)
    if reshape.operands[0].type.rank == 0 or reshape.results[0].type.rank == 0:
        raise CannotFold("it reshapes to or from rank 0 (only unit dims: nothing to fold)")
    if reshape.name == "tensor.expand_shape":
        producer = defining_op(reshape.operands[0])
        if producer is None or not is_linalg(producer):
            raise CannotFold("its source is not the result of a linalg op")
        if len(list(reshape.operands[0].uses)) != 1:
            raise CannotFold(f"the {producer.name} result it expands has other users")
        if producer.name == "linalg.fill":
            return [Fold(producer, 1, reshape)]
        n_in = len(producer.operands) - len(producer.results)
        k = reshape.operands[0].result_number
        expand = expansion_of(producer, n_in + k, groups, _static_shape(reshape.results[0].type))
        _check_other_inputs(producer, n_in + k, expand)
        return [Fold(producer, n_in + k, reshape)]
    if len(list(reshape.results[0].uses)) != 1 and not multi_use:
        raise CannotFold("the collapsed value has several users")
    folds = []
    reasons = []
    for use in reshape.results[0].uses:
        user = user_op(use)
        if not is_linalg(user) or user.name == "linalg.fill":
            reasons.append(f"its user {user.name} is not a linalg op it can fold into")
            continue
        n_in = len(user.operands) - len(user.results)
        if use.operand_number >= n_in:
            reasons.append(f"it is the init of {user.name}")
            continue
        try:
            expand = expansion_of(user, use.operand_number, groups, _static_shape(reshape.operands[0].type))
            _check_other_inputs(user, use.operand_number, expand)
            if keep_reduction_loops:
                _check_reduction_loops(user, expand)
        except CannotFold as exc:
            reasons.append(str(exc))
            continue
        folds.append(Fold(user, use.operand_number, reshape))
    if not folds:
        raise CannotFold("; ".join(reasons) or "it has no users")
    return folds


# ----------------------------------------------------------------------------- rewriting


def _expand_value(value: ir.Value, groups: list[list[int]], shape: list[int]) -> ir.Value:
    if all(len(g) == 1 for g in groups):
        return value
    t = value.type
    result = ir.RankedTensorType.get(shape, t.element_type, t.encoding)
    producer = defining_op(value)
    if producer is not None and producer.name == "tensor.empty":
        return tensor.EmptyOp(shape, t.element_type).result
    return tensor.ExpandShapeOp(result, value, reassociation_attr(groups), [], shape).result


def _collapse_value(value: ir.Value, groups: list[list[int]], result_type: ir.Type) -> ir.Value:
    if all(len(g) == 1 for g in groups):
        return value
    return tensor.CollapseShapeOp(result_type, value, reassociation_attr(groups)).result




def _fold_fill(fold: Fold, rewriter) -> bool:
    fill, expand = fold.op, fold.reshape
    groups = reassociation(expand)
    shape = _static_shape(expand.results[0].type)
    with ir.InsertionPoint(expand), expand.location:
        init = _expand_value(fill.operands[1], groups, shape)
        new = fill.clone()
    new.operands[1] = init
    new.results[0].set_type(init.type)
    rewriter.replace_op(expand, [new.results[0]])
    if not list(fill.results[0].uses):
        rewriter.erase_op(fill)
    return True


def _apply(fold: Fold, rewriter) -> bool:
    """Rewrite; True when the reshape is gone afterwards."""
    op, reshape = fold.op, fold.reshape
    if op.name == "linalg.fill":
        return _fold_fill(fold, rewriter)
    all_terms = check_op(op)
    groups = reassociation(reshape)
    is_collapse = reshape.name == "tensor.collapse_shape"
    expanded_shape = _static_shape((reshape.operands[0] if is_collapse else reshape.results[0]).type)
    expand = expansion_of(op, fold.operand, groups, expanded_shape)
    iterators = _op_iterators(op)
    new_dims: list[list[int]] = []
    sizes: list[list[int]] = []
    for d in range(len(iterators)):
        n = len(expand.get(d, [None]))
        start = sum(len(x) for x in new_dims)
        new_dims.append(list(range(start, start + n)))
        sizes.append(expand.get(d, []))
    n_new = sum(len(x) for x in new_dims)
    new_iterators = [iterators[d] for d in range(len(iterators)) for _ in new_dims[d]]
    n_in = len(op.operands) - len(op.results)

    operands, maps, operand_groups = [], [], []
    with ir.InsertionPoint(op), op.location:
        for i, (value, ts) in enumerate(zip(op.operands, all_terms)):
            if i == fold.operand:
                new_terms = []
                for t, g in zip(ts, groups):
                    new_terms += [t] * len(g) if isinstance(t, Const) else [new_dims[t][j] for j in range(len(g))]
                opnd_groups = groups
                new_value = reshape.operands[0] if is_collapse else _expand_value(value, groups, expanded_shape)
            else:
                new_terms, opnd_groups, shape = [], [], []
                for j, t in enumerate(ts):
                    start = len(new_terms)
                    if isinstance(t, Const) or t not in expand:
                        new_terms.append(t if isinstance(t, Const) else new_dims[t][0])
                        shape.append(value.type.shape[j] if isinstance(value.type, ir.ShapedType) else 1)
                    else:
                        new_terms += new_dims[t]
                        shape += expand[t]
                    opnd_groups.append(list(range(start, len(new_terms))))
                new_value = (_expand_value(value, opnd_groups, shape)
                             if isinstance(value.type, ir.ShapedType) else value)
            operands.append(new_value)
            maps.append(make_map(n_new, new_terms))
            operand_groups.append(opnd_groups)

        old_args = list(body_of(op).arguments)

        def body(args):
            mapping = dict(zip(old_args, args))
            values = clone_body(op, mapping)
            return values

        new = build_generic(operands[:n_in], operands[n_in:], maps, new_iterators, body, name_from=op)
        _rewrite_index_ops(new, new_dims, sizes)

        replacements = []
        for k, result in enumerate(op.results):
            new_result = new.results[k]
            if not is_collapse and fold.operand == n_in + k:
                replacements.append(None)
                continue
            replacements.append(_collapse_value(new_result, operand_groups[n_in + k], result.type))
    if not is_collapse:
        k = fold.operand - n_in
        folded_result = new.results[k]
        rewriter.replace_op(reshape, [folded_result])
        if list(op.results[k].uses):
            with ir.InsertionPoint(op), op.location:
                replacements[k] = _collapse_value(folded_result, operand_groups[fold.operand],
                                                  op.results[k].type)
        else:
            replacements[k] = op.operands[fold.operand]  # unused: any value of the type
    rewriter.replace_op(op, replacements)
    if is_collapse and list(reshape.results[0].uses):
        return False
    if is_collapse:
        rewriter.erase_op(reshape)
    return True


def _rewrite_index_ops(generic, new_dims: list[list[int]], sizes: list[list[int]]) -> None:
    index_type = ir.IndexType.get()
    for index_op in walk_ops(generic, lambda o: o.name == "linalg.index"):
        d = ir.IntegerAttr(index_op.attributes["dim"]).value
        with ir.InsertionPoint(index_op), index_op.location:
            parts = [linalg.IndexOp(n).result for n in new_dims[d]]
            value = parts[0]
            for j in range(1, len(parts)):
                stride = arith.ConstantOp(index_type, sizes[d][j]).result
                value = arith.AddIOp(arith.MulIOp(value, stride).result, parts[j]).result
        index_op.results[0].replace_all_uses_with(value)
        index_op.erase()


def _fold_reshape_pair(reshape: ir.Operation, rewriter) -> bool:
    """expand(collapse(x)) / collapse(expand(x)) with one reassociation and x's type -> x."""
    inner = defining_op(reshape.operands[0])
    if inner is None or inner.name not in _RESHAPES or inner.name == reshape.name:
        return False
    source = inner.operands[0]
    if source.type != reshape.results[0].type or reassociation(inner) != reassociation(reshape):
        return False
    rewriter.replace_op(reshape, [source])
    if not list(inner.results[0].uses):
        rewriter.erase_op(inner)
    return True


def fold_in(target: ir.Operation, rewriter, keep_reduction_loops: bool = False) -> None:
    """Apply the folds to a fixed point under `target`."""
    for _ in range(_MAX_FOLDS):
        reshapes = [r for r in walk_ops(target, lambda o: o.name in _RESHAPES) if r != target]
        if any(_fold_reshape_pair(r, rewriter) for r in reshapes):
            continue
        for r in reshapes:
            try:
                fold = plan_fold(r, keep_reduction_loops=keep_reduction_loops)[0]
            except CannotFold:
                continue
            _apply(fold, rewriter)
            break
        else:
            return
    raise RuntimeError(f"{NAME}: no fixed point after {_MAX_FOLDS} folds")


def fold_reshape_target(reshape: ir.Operation, rewriter) -> None:
    """Fold a reshape given as a target into all its consumers (collapse) or its producer."""
    if _fold_reshape_pair(reshape, rewriter):
        return
    while not _apply(plan_fold(reshape, multi_use=True)[0], rewriter):
        try:
            plan_fold(reshape, multi_use=True)
        except CannotFold:
            return


class FoldReshapeOpsByExpansionOp(TransformExt.Operation, name="fold_reshape_ops_by_expansion"):
    target: ext.Operand[transform.AnyOpType]
    keep_reduction_loops: ir.IntegerAttr  # i1
    result: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for t in targets:
                        if t.name in _RESHAPES:
                            try:
                                plan_fold(t, multi_use=True)
                            except CannotFold as exc:
                                raise Illegal(t, f"cannot fold: {exc}") from None
                except Illegal as illegal:
                    return fail(NAME, illegal)
                kept = []
                for t in targets:
                    if t.name in _RESHAPES:
                        fold_reshape_target(t, rewriter)
                    else:
                        kept.append(t)
                keep = bool(ir.IntegerAttr(op.keep_reduction_loops).value)
                for t in kept:
                    fold_in(t, rewriter, keep)
                results.set_ops(op.result, kept)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def fold_reshape_ops_by_expansion(target: ir.Value, keep_reduction_loops: bool = False) -> ir.Value:
    """Fold reshapes across the linalg ops in `target` by expanding their loops (or fold the
    reshape ops given as targets); returns the container targets. `keep_reduction_loops`:
    no collapse is folded into a contraction's reduction loops inside the containers."""
    flag = ir.IntegerAttr.get(ir.IntegerType.get_signless(1), int(keep_reduction_loops))
    return FoldReshapeOpsByExpansionOp(target, flag).result


__all__ = ["FoldReshapeOpsByExpansionOp", "fold_reshape_ops_by_expansion", "plan_fold"]
