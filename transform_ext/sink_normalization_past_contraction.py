"""sink_normalization_past_contraction: normalize the result of a contraction instead of its
operand.

    sum_k (a_k / s) * b_k = (sum_k a_k * b_k) / s        (and the same for a_k * s)

when s does not vary along the reduction dims k. The contraction C (a named contraction or
a linalg.generic whose body is acc + u * v, extf allowed on the factors) reads the
normalized factor either
  - from a producer: an elementwise linalg.generic D yielding x / s or x * s, or
    select(m, 0, x / s); or a select generic select(m, 0, a) whose input a comes from such a
    D (SDPA's fully-masked-row guard: m is "every score of the row is -inf"); or
  - in its own body: u = x / s, x * s or select(m, 0, x / s) computed from C's inputs.
The rewrite replaces the normalizing divf/mulf by x (in a new D or C; inputs no longer
read are dropped; a select stays where it is), and a new elementwise generic N over C's
result computes
    r = c / s  (or c * s),  then  r = select(m, 0, r)  for each mask m,
with s and m recomputed in N from the same inputs (their body slices are cloned). Both
factors are sunk when both are normalized.
The mask must not vary along k either: where m holds, C's row is sum_k 0 * b_k = 0 and N
gives 0 (exact when b is finite); elsewhere the results agree up to rounding (the division
moves from every a_k to the sum). Without the outer select a masked row would give 0 / s,
which is NaN when s is 0 or NaN (SDPA's masked rows have s = NaN).

Preconditions, checked on every target before any rewrite (else a silenceable failure
names the op and the reason, and nothing changes): C is a linalg op on tensors with one
result, maps of loop dims or constants (composite maps are rejected), a body acc + u * v
(a named op with any other body, e.g. a convolution, is rejected), a reduction dim and a
constant-zero init (acc + sum (a / s) b != (acc + sum a b) / s otherwise); at least one
factor is normalized; a divisor s and every mask depend only on inputs whose indexing,
composed into C's loops, avoids every reduction dim, and not on linalg.index; a select's
other branch is a constant zero; D and the select generic are elementwise linalg.generic
ops with one result and a permutation output map; s is not wider than C's accumulator.
Results: the new contractions and the normalization generics N, in target order.
"""

from dataclasses import dataclass, field

from torch_mlir import ir
from torch_mlir.dialects import arith, ext, linalg, tensor, transform

from .analysis.body import Slice, block_arg_number, body_slice, producer_in, strip_casts
from .analysis.maps import Const, affine_map, loop_images, make_map, substitute, terms
from .analysis.structure import loop_structure
from .common import (Illegal, ReplacesTargets, Success, body_of, build_generic, clone_body,
                     constant_value, defining_op, erase_dead_body_ops, fail, is_linalg, is_zero,
                     iterator_kinds, payload_ops, remap_operands, terminator)
from .dialect import TransformExt

NAME = "transform_ext.sink_normalization_past_contraction"


class NotNormalized(Exception):
    """A factor is not normalized. `blocking`: it looks like a normalization but breaks a
    precondition, so the op must fail rather than ignore it."""

    def __init__(self, reason: str, blocking: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.blocking = blocking


@dataclass
class BodyValue:
    """A value of `owner`'s body, computed by `slice` from owner's inputs; `to_c` maps
    owner's loops to terms over the contraction's loops."""

    owner: ir.Operation
    value: ir.Value
    slice: Slice
    to_c: dict


@dataclass
class Factor:
    """A normalized factor of the contraction."""

    operand: int | None          # C input fed by the producer chain; None: in C's body
    owner: ir.Operation          # the op whose body holds `norm` (D, or C itself)
    norm: ir.Operation           # the arith.divf / arith.mulf
    scale: BodyValue
    masks: list = field(default_factory=list)   # (BodyValue, zero_on_true)
    select_generic: ir.Operation | None = None  # between D and C (the mask chain)


@dataclass
class Plan:
    contraction: ir.Operation
    factors: list


# ----------------------------------------------------------------------------- analysis


def _n_inputs(op: ir.Operation) -> int:
    return len(op.operands) - len(op.results)


def _n_loops(op: ir.Operation) -> int:
    return affine_map(linalg.get_indexing_maps(op)[0]).n_dims


def _iterators(op: ir.Operation) -> list[str]:
    return iterator_kinds(op) if op.name == "linalg.generic" else loop_structure(op).iterators


def _simple_terms(op: ir.Operation) -> list[list]:
    out = []
    for m in linalg.get_indexing_maps(op):
        ts = terms(affine_map(m))
        if ts is None:
            raise Illegal(op, f"composite indexing map {affine_map(m)}")
        out.append(ts)
    return out


def _contraction_factors(c: ir.Operation):
    """(u, v) of C's body acc + u * v; raises Illegal otherwise."""
    if not is_linalg(c) or not c.regions or len(c.results) != 1:
        raise Illegal(c, "not a linalg op with one result")
    if not isinstance(c.results[0].type, ir.RankedTensorType):
        raise Illegal(c, "not on tensors")
    block = body_of(c)
    acc = block.arguments[len(block.arguments) - 1]
    what = "its body" if c.name == "linalg.generic" else "the named op's body"
    add = producer_in(block, terminator(block).operands[0])
    t = None
    if add is not None and add.name == "arith.addf":
        a, b = add.operands
        t = b if a == acc else a if b == acc else None
    mul = producer_in(block, t) if t is not None else None
    if mul is None or mul.name != "arith.mulf":
        raise Illegal(c, f"{what} is not a sum of products acc + u * v")
    if len(list(acc.uses)) != 1:
        raise Illegal(c, "the accumulator is read outside the sum")
    return mul.operands[0], mul.operands[1]


def _is_zero_in(owner: ir.Operation, value: ir.Value) -> bool:
    n = block_arg_number(body_of(owner), value)
    if n is not None:
        return n < _n_inputs(owner) and is_zero(owner.operands[n])
    return constant_value(value) is not None and is_zero(value)


class _Context:
    """What the analysis of one contraction needs everywhere."""

    def __init__(self, c: ir.Operation):
        self.c = c
        self.terms = _simple_terms(c)
        out = self.terms[-1]
        self.c_to_n = {t: j for j, t in enumerate(out) if not isinstance(t, Const)}
        self.k_dims = set(range(_n_loops(c))) - set(self.c_to_n)

    def body_value(self, owner, value, to_c, what) -> BodyValue:
        """`value` of owner's body as a BodyValue, checked invariant along every k."""
        block = body_of(owner)
        sl = body_slice(block, [value])
        if sl.reads_index:
            raise NotNormalized(f"the {what} reads linalg.index", True)
        owner_terms = _simple_terms(owner)
        for a in sl.args:
            if a >= _n_inputs(owner):
                raise NotNormalized(f"the {what} reads the output of {owner.name}", True)
            ts_c = substitute(owner_terms[a], to_c)
            if ts_c is None:
                raise NotNormalized(f"cannot relate the indexing of the {what} to the contraction", True)
            varying = [t for t in ts_c if not isinstance(t, Const) and t in self.k_dims]
            if varying:
                raise NotNormalized(f"the {what} varies along the reduction dim d{varying[0]}", True)
        return BodyValue(owner, value, sl, to_c)

    def normalization(self, owner, value, to_c):
        """Analyse `value` of owner's body: (divf/mulf op or None, scale, masks, rest) where
        rest is the value under the selects when there is no divf/mulf."""
        block = body_of(owner)
        value = strip_casts(block, value)
        op = producer_in(block, value)
        masks = []
        while op is not None and op.name == "arith.select":
            cond, t, f = op.operands
            if _is_zero_in(owner, t):
                inner, zero_on_true = f, True
            elif _is_zero_in(owner, f):
                inner, zero_on_true = t, False
            else:
                raise NotNormalized("the select's other branch is not a constant zero", True)
            masks.append((self.body_value(owner, cond, to_c, "select mask"), zero_on_true))
            value = strip_casts(block, inner)
            op = producer_in(block, value)
        if op is None or op.name not in ("arith.divf", "arith.mulf"):
            return None, None, masks, value
        if op.name == "arith.divf":
            return op, self.body_value(owner, op.operands[1], to_c, "divisor"), masks, None
        reasons = []
        for s in (op.operands[1], op.operands[0]):
            try:
                return op, self.body_value(owner, s, to_c, "scale"), masks, None
            except NotNormalized as exc:
                reasons.append(exc.reason)
        raise NotNormalized(f"neither side of the product is invariant along the reduction "
                            f"({reasons[0]})", blocking=bool(masks))


def _elementwise(op: ir.Operation, role: str) -> list[list]:
    if op.name != "linalg.generic" or len(op.results) != 1:
        raise NotNormalized(f"its {role} {op.name} is not a one-result linalg.generic")
    if any(k != "parallel" for k in iterator_kinds(op)):
        raise NotNormalized(f"its {role} is not elementwise")
    ts = _simple_terms(op)
    if any(isinstance(t, Const) for t in ts[-1]) or sorted(ts[-1]) != list(range(_n_loops(op))):
        raise NotNormalized(f"its {role} does not write a permutation of its loops")
    return ts


def _producer(op: ir.Operation, input_number: int) -> ir.Operation:
    p = defining_op(op.operands[input_number])
    if p is None:
        raise NotNormalized(f"input {input_number} of {op.name} has no producer")
    return p


def _factor(ctx: _Context, value: ir.Value) -> Factor:
    c = ctx.c
    identity = {d: d for d in range(_n_loops(c))}
    norm, scale, masks, rest = ctx.normalization(c, value, identity)
    if norm is not None:
        return Factor(None, c, norm, scale, masks)
    arg = block_arg_number(body_of(c), rest)
    if arg is None or arg >= _n_inputs(c):
        raise NotNormalized("it is computed in the body but is not x / s, x * s or "
                            "select(m, 0, x / s)", blocking=bool(masks))
    if masks:
        raise NotNormalized("a select in the body over a value that is not normalized", True)
    d = _producer(c, arg)
    d_terms = _elementwise(d, "producer")
    d_to_c = loop_images(d_terms[-1], ctx.terms[arg])
    if d_to_c is None:
        raise NotNormalized("cannot relate its producer's loops to the contraction's", True)
    norm, scale, masks, rest = ctx.normalization(d, terminator(body_of(d)).operands[0], d_to_c)
    if norm is not None:
        return Factor(arg, d, norm, scale, masks)
    if not masks:
        raise NotNormalized(f"its producer does not yield x / s, x * s or select(m, 0, x / s)")
    a = block_arg_number(body_of(d), rest)
    if a is None or a >= _n_inputs(d):
        raise NotNormalized("its select does not read a normalized input", True)
    inner = _producer(d, a)
    i_terms = _elementwise(inner, "select's producer")
    i_to_d = loop_images(i_terms[-1], d_terms[a])
    if i_to_d is None:
        raise NotNormalized("cannot relate the select's producer to the contraction", True)
    i_to_c = {i: t if isinstance(t, Const) else d_to_c[t] for i, t in i_to_d.items()}
    norm, scale, inner_masks, _ = ctx.normalization(inner, terminator(body_of(inner)).operands[0],
                                                    i_to_c)
    if norm is None:
        raise NotNormalized("its select reads a value that is not x / s or x * s", True)
    return Factor(arg, inner, norm, scale, inner_masks + masks, select_generic=d)


def plan(c: ir.Operation) -> Plan:
    """Analyse contraction `c`; raises Illegal with the reason when it cannot be rewritten."""
    u, v = _contraction_factors(c)
    ctx = _Context(c)
    if not ctx.k_dims:
        raise Illegal(c, "has no reduction dim")
    if not is_zero(c.operands[len(c.operands) - 1]):
        raise Illegal(c, "its init is not a constant zero: acc + sum (a / s) b != (acc + sum a b) / s")
    factors, reasons = [], []
    for value in (u, v):
        try:
            factors.append(_factor(ctx, value))
        except NotNormalized as exc:
            reasons.append(exc)
    blocking = [r for r in reasons if r.blocking]
    if blocking:
        raise Illegal(c, blocking[0].reason)
    if not factors:
        raise Illegal(c, "no factor is normalized: " + "; ".join(r.reason for r in reasons))
    acc_type = c.results[0].type.element_type
    for f in factors:
        s_type = f.scale.value.type
        if s_type != acc_type and not (isinstance(s_type, ir.FloatType) and isinstance(acc_type, ir.FloatType)
                                       and s_type.width < acc_type.width):
            raise Illegal(c, f"the scale's type {s_type} does not extend to the accumulator type {acc_type}")
    return Plan(c, factors)


# ----------------------------------------------------------------------------- rewriting


def _numerator(norm: ir.Operation, scale: ir.Value) -> ir.Value:
    if norm.name == "arith.divf":
        return norm.operands[0]
    return norm.operands[1] if norm.operands[0] == scale else norm.operands[0]


def _without(owner: ir.Operation, factors: list) -> ir.Operation:
    """A linalg.generic before `owner` computing what owner does with each factor's divf/mulf
    replaced by its numerator; inputs it no longer reads are dropped."""
    n_in = _n_inputs(owner)
    n_loops = _n_loops(owner)
    maps = [make_map(n_loops, ts) for ts in _simple_terms(owner)]
    iterators = _iterators(owner)
    skip = {f.norm: _numerator(f.norm, f.scale.value) for f in factors}
    block = body_of(owner)

    def body(args):
        mapping = dict(zip(block.arguments, args))
        for op in list(block.operations)[:-1]:
            op = op.operation
            if op in skip:
                mapping[op.results[0]] = mapping.get(skip[op], skip[op])
                continue
            clone = op.clone()
            remap_operands(clone, mapping)
            for old, new in zip(op.results, clone.results):
                mapping[old] = new
        return [mapping.get(v, v) for v in terminator(block).operands]

    with ir.InsertionPoint(owner), owner.location:
        first = build_generic(list(owner.operands)[:n_in], list(owner.operands)[n_in:], maps,
                              iterators, body, name_from=owner)
        erase_dead_body_ops(body_of(first))
        used = [i for i in range(n_in) if list(body_of(first).arguments[i].uses)]
        if len(used) == n_in:
            return first.operation
        keep = used + list(range(n_in, len(owner.operands)))
        old_args = list(body_of(first).arguments)

        def copy(args):
            return clone_body(first, {old_args[i]: a for i, a in zip(keep, args)})

        new = build_generic([owner.operands[i] for i in used], list(owner.operands)[n_in:],
                            [maps[i] for i in keep], iterators, copy, name_from=owner)
    first.operation.erase()
    return new.operation


def _normalizer(c: ir.Operation, contracted: ir.Value, factors: list) -> ir.Operation:
    """N: r = c / s (or c * s) per factor, then select(m, 0, r) per mask, over C's result."""
    result_type = c.results[0].type
    acc_type = result_type.element_type
    rank = result_type.rank
    ctx = _Context(c)
    inputs, maps, clones = [contracted], [ir.AffineMap.get_identity(rank)], []
    for f in factors:
        for bv in [f.scale] + [m for m, _ in f.masks]:
            owner_terms = _simple_terms(bv.owner)
            first = len(inputs)
            args = sorted(bv.slice.args)
            for a in args:
                inputs.append(bv.owner.operands[a])
                maps.append(make_map(rank, substitute(substitute(owner_terms[a], bv.to_c), ctx.c_to_n)))
            clones.append((bv, {a: first + j for j, a in enumerate(args)}))

    def body(args):
        values = {}
        for bv, arg_pos in clones:
            block = body_of(bv.owner)
            mapping = {block.arguments[a]: args[p] for a, p in arg_pos.items()}
            for op in bv.slice.ops:
                clone = op.clone()
                remap_operands(clone, mapping)
                for old, new in zip(op.results, clone.results):
                    mapping[old] = new
            values[id(bv)] = mapping.get(bv.value, bv.value)
        r = args[0]
        for f in factors:
            s = values[id(f.scale)]
            if s.type != acc_type:
                s = arith.ExtFOp(acc_type, s).result
            op_class = arith.DivFOp if f.norm.name == "arith.divf" else arith.MulFOp
            new = op_class(r, s)
            if "fastmath" in f.norm.attributes:
                new.operation.attributes["fastmath"] = f.norm.attributes["fastmath"]
            r = new.result
        zero = arith.ConstantOp(acc_type, ir.FloatAttr.get(acc_type, 0.0)).result
        for f in factors:
            for m, zero_on_true in f.masks:
                cond = values[id(m)]
                r = (arith.SelectOp(cond, zero, r) if zero_on_true else arith.SelectOp(cond, r, zero)).result
        return [r]

    with ir.InsertionPoint(c), c.location:
        init = tensor.EmptyOp(list(result_type.shape), acc_type).result
        maps.append(ir.AffineMap.get_identity(rank))
        return build_generic(inputs, [init], maps, ["parallel"] * rank, body).operation


def _rewrite(p: Plan, rewriter) -> tuple[ir.Operation, ir.Operation]:
    c = p.contraction
    operand_values = {}
    for f in p.factors:
        if f.operand is None:
            continue
        new_d = _without(f.owner, [f])
        value = new_d.results[0]
        if f.select_generic is not None:
            m = f.select_generic
            with ir.InsertionPoint(m), m.location:
                new_m = m.clone()
            for i in range(_n_inputs(m)):
                if m.operands[i] == f.owner.results[0]:
                    new_m.operands[i] = value
            value = new_m.results[0]
        operand_values[f.operand] = value
    in_body = [f for f in p.factors if f.operand is None]
    if in_body:
        new_c = _without(c, in_body)
        mapping = _kept_inputs(c, new_c)
        for i, v in operand_values.items():
            new_c.operands[mapping[i]] = v
    else:
        with ir.InsertionPoint(c), c.location:
            new_c = c.clone()
        for i, v in operand_values.items():
            new_c.operands[i] = v
    n = _normalizer(c, new_c.results[0], p.factors)
    chains = [(f.select_generic, f.owner) for f in p.factors if f.operand is not None]
    rewriter.replace_op(c, [new_c.results[0]])
    new_c.results[0].replace_all_uses_except(n.results[0], n)
    for select_generic, owner in chains:
        for op in (select_generic, owner):
            if op is not None and op.results and not list(op.results[0].uses):
                rewriter.erase_op(op)
    return new_c, n


def _kept_inputs(old: ir.Operation, new: ir.Operation) -> dict[int, int]:
    """Old input number -> new input number for inputs `new` still has (same values)."""
    out = {}
    j = 0
    new_inputs = list(new.operands)[:_n_inputs(new)]
    for i, v in enumerate(list(old.operands)[:_n_inputs(old)]):
        if j < len(new_inputs) and new_inputs[j] == v:
            out[i] = j
            j += 1
    return out


class SinkNormalizationPastContractionOp(TransformExt.Operation,
                                         name="sink_normalization_past_contraction"):
    contraction: ext.Operand[transform.AnyOpType]
    contractions: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    normalizations: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.contraction)
                try:
                    plans = [plan(t) for t in targets]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                new_cs, ns = [], []
                for p in plans:
                    new_c, n = _rewrite(p, rewriter)
                    new_cs.append(new_c)
                    ns.append(n)
                results.set_ops(op.contractions, new_cs)
                results.set_ops(op.normalizations, ns)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = ReplacesTargets


def sink_normalization_past_contraction(contraction: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Move x / s (x * s) from a factor of each contraction to its result; returns
    (new contractions, normalization generics)."""
    op = SinkNormalizationPastContractionOp(contraction)
    return op.contractions, op.normalizations


__all__ = ["SinkNormalizationPastContractionOp", "sink_normalization_past_contraction", "plan"]
