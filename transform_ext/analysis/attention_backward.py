"""The ops of an attention backward (FlashAttention-2 recomputation form), found by walking
the IR of a function:

    S = c Q K^T [masked],  P = exp(S - lse) (0 where lse = -inf; lse from a max over S, or
                                              given: the forward's, an input of the graph),
    D = rowsum(dO * O) or rowsum(P * dP),  dV = P^T dO,  dP = dO V^T,  dS = P (dP - D),
    dQ = c dS K,  dK = c dS^T Q

(lighthouse/flash_decompositions.py writes torch's CPU flash backward this way). Each
operand is traced through the layout ops torch-mlir puts around batch matmuls (reshapes that
merge the batch and head dims, transposes of the last two dims) to its source: the tensors
are [G, rows, cols] with G the batch x head groups. `attention_backward_in(func)` returns the
sources (Q, K, V, O, dO, each with the transposition that makes it [G, rows, features]; O
None when D = rowsum(P * dP) and no O = P V is computed: the kernel sums P dP itself), the
scale, the scores contraction and its row max (for the causal analysis), and the values dQ,
dK, dV the backward computes, or raises NotAttentionBackward saying why not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch_mlir import ir

from .attention import is_index_computation
from .structure import is_linalg_op, loop_structure
from ..common import block_ops, constant_value, defining_op, depends_on, user_op, users


class NotAttentionBackward(Exception):
    """The ops are not one attention backward; the message is the reason."""


@dataclass(frozen=True)
class Source:
    """A [G, rows, features] tensor: `value` ([G, ...] or [B, H, ...], rank 3 or 4),
    transposed in its last two dims when `transposed`."""

    value: ir.Value
    transposed: bool
    groups: int = 1  # read broadcast, each of its groups by this many query groups in turn

    def same(self, other: "Source") -> bool:
        """The same tensor in the same orientation (two splat constants of one value and
        shape, up to unit dims, are the same tensor)."""
        if self.transposed != other.transposed or self.groups != other.groups:
            return False
        if self.value == other.value:
            return True
        mine, theirs = constant_value(self.value), constant_value(other.value)
        dims = lambda v: [d for d in ir.ShapedType(v.type).shape if d != 1]
        return mine is not None and theirs is not None and str(mine) == str(theirs) \
            and dims(self.value) == dims(other.value)


@dataclass(frozen=True)
class Bias:
    """An additive mask read by the scores: `value` (f32), and per dim of it its role
    among the scores' dims: 'g' (group), 'b' and 'h' (batch and head of [B, H, L, S]
    scores; `heads` is H), 'q' (query), 'k' (key), '1' (broadcast)."""

    value: ir.Value
    roles: tuple[str, ...]
    heads: int


@dataclass
class AttentionBackward:
    q: Source
    k: Source
    v: Source
    o: Source | None         # None: D = rowsum(P * dP), with no O = P V to read instead
    do: Source
    scale: float
    scores: ir.Operation     # S = Q K^T (before the scale and mask)
    row_max: ir.Operation    # the max over keys of the masked scores (lse's), or, with a
                             # given lse, the op computing S - lse
    masked: bool             # an elementwise op between the scaled scores and P masks them
    bias: Bias | None        # the mask, when it is a tensor added to the scores
    guarded: bool            # P = 0 on fully masked rows (SDPA; a softmax by hand has NaN)
    dq: ir.Value
    dk: ir.Value
    dv: ir.Value
    lse: ir.Value | None = None  # the given [.., L] log-sum-exp (None: computed from S)
    # the bias's gradient: the operand slots (op, index) that read dS summed to the bias's
    # shape (the mask added to the scores needs a gradient), or None
    dbias: list | None = None


_RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")


def _merges_leading(op: ir.Operation) -> bool:
    """A reshape of the leading (batch, head) dims only, the last two dims kept, or one that
    only adds or drops unit dims."""
    src, res = (list(ir.ShapedType(v.type).shape) for v in (op.operands[0], op.results[0]))
    if [d for d in src if d != 1] == [d for d in res if d != 1]:
        return True
    if len(src) < 2 or len(res) < 2 or src[-2:] != res[-2:]:
        return False
    return math.prod(src[:-2]) == math.prod(res[:-2])


def _swaps_last_two(op: ir.Operation) -> bool:
    perm = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    n = len(perm)
    return n >= 3 and perm == list(range(n - 2)) + [n - 1, n - 2]


def trace(value: ir.Value) -> Source:
    """`value`'s source through batch/head reshapes, last-two-dims transposes (linalg.transpose
    or a copying generic) and a broadcast over a group dim after the batch/head dims (the
    K and V of grouped-query attention: [.., Hkv, S, E] read as [.., Hkv, group, S, E])."""
    transposed, groups = False, 1
    while True:
        p = defining_op(value)
        if p is not None and p.name in _RESHAPES and _merges_leading(p):
            value = p.operands[0]
        elif p is not None and p.name == "linalg.transpose" and _swaps_last_two(p):
            value, transposed = p.operands[0], not transposed
        elif (copy := _copy_map(p)) is not None and copy[0] == "swap":
            value, transposed = p.operands[0], not transposed
        elif copy is not None and copy[0] == "group" and groups == 1:
            value, groups = p.operands[0], copy[1]
        else:
            return Source(value, transposed, groups)


def _copy_map(op: ir.Operation | None):
    """("swap", None) for a generic copying its one input with the last two dims swapped,
    ("group", n) for one broadcasting it over a dim of extent n before the last two, else
    None."""
    if op is None or op.name != "linalg.generic" or len(op.operands) != 2:
        return None
    body = [o.operation for o in op.regions[0].blocks[0].operations]
    if len(body) != 1 or body[0].operands[0] != op.regions[0].blocks[0].arguments[0]:
        return None
    ls = loop_structure(op)
    n = ls.num_loops
    if ls.reduction_dims or ls.maps[1] != ir.AffineMap.get_identity(n) or n < 3:
        return None
    dims = [e.position if isinstance(e, ir.AffineDimExpr) else None for e in ls.maps[0].results]
    if dims == list(range(n - 2)) + [n - 1, n - 2]:
        return "swap", None
    dropped = [d for d in range(n) if d not in dims]
    if len(dropped) == 1 and dropped[0] < n - 2 and dims == [d for d in range(n) if d != dropped[0]]:
        return "group", ls.ranges[dropped[0]]
    return None


def _rank3_dims(op: ir.Operation, index: int) -> list[str]:
    """The contraction dims ('b', 'm', 'n', 'k') of `op`'s operand `index` in its dim order."""
    ls = loop_structure(op)
    dims = ls.contraction_dims()
    role = {d: r for r in ("batch", "m", "n", "k") for d in dims[r]}
    names = []
    for e in ls.maps[index].results:
        if not isinstance(e, ir.AffineDimExpr):
            raise NotAttentionBackward("a contraction operand is not read through loop dims")
        names.append(role[e.position][0])
    return names


@dataclass
class _Contraction:
    op: ir.Operation
    inputs: list[tuple[Source, int]]   # per input: its source, which of its last two dims it reduces
    result: ir.Value

    def leaf(self, index: int, reduced: str) -> Source:
        """Input `index` as a [G, rows, features] source, given that the contraction
        reduces its `reduced` ('rows' or 'features') dim."""
        src, k = self.inputs[index]
        return Source(src.value, k != (0 if reduced == "rows" else 1), src.groups)

    def reads(self, source: Source, reduced: str) -> int | None:
        """The input that is `source` reduced over its `reduced` dim, or None."""
        hits = [i for i in range(2) if self.leaf(i, reduced).same(source)]
        return hits[0] if len(hits) == 1 else None


def _contraction(op: ir.Operation) -> _Contraction | None:
    """`op` as a batch matmul over leading batch dims (none, G, B and H, or B, kv heads and
    group), or None."""
    ls = loop_structure(op)
    if not ls.is_contraction or ls.num_inputs != 2 or len(op.results) != 1:
        return None
    dims = ls.contraction_dims()
    nb = len(dims["batch"])
    if nb > 3 or any(len(dims[r]) != 1 for r in ("m", "n", "k")):
        return None
    if ir.ShapedType(op.results[0].type).rank != nb + 2:
        return None
    inputs = []
    for i in range(2):
        names = _rank3_dims(op, i)
        if len(names) != nb + 2 or names[:nb] != ["b"] * nb or "k" not in names[nb:]:
            return None
        src = trace(op.operands[i])
        k = names.index("k") - nb  # the reduced one of the last two dims, in the source's order
        inputs.append((Source(src.value, False, src.groups), 1 - k if src.transposed else k))
    return _Contraction(op, inputs, op.results[0])


def _elementwise_inputs(op: ir.Operation) -> list[ir.Value]:
    ls = loop_structure(op)
    return list(op.operands)[:ls.num_inputs]


def _body_names(op: ir.Operation) -> list[str]:
    return [o.operation.name for o in op.regions[0].blocks[0].operations]


def _scale_of(op: ir.Operation | None) -> float | None:
    """c when `op` is an elementwise generic computing x * c or x / (1 / c) of its one input
    (c a float constant)."""
    if op is None or op.name != "linalg.generic" or not loop_structure(op).is_elementwise:
        return None
    body = [o.operation for o in op.regions[0].blocks[0].operations]
    arg = op.regions[0].blocks[0].arguments[0]
    if len(body) != 2 or body[0].name not in ("arith.mulf", "arith.divf") \
            or loop_structure(op).num_inputs != 1 or body[1].operands[0] != body[0].results[0]:
        return None
    x, y = body[0].operands
    if body[0].name == "arith.mulf" and y == arg:
        x, y = y, x
    if x != arg:
        return None
    p = defining_op(y)
    while p is not None and p.name == "arith.truncf":
        y = p.operands[0]
        p = defining_op(y)
    c = _float_constant(y)
    if c is None or (body[0].name == "arith.divf" and c == 0.0):
        return None
    return c if body[0].name == "arith.mulf" else 1.0 / c


def _float_constant(value: ir.Value) -> float | None:
    c = constant_value(value)
    return ir.FloatAttr(c).value if isinstance(c, ir.FloatAttr) else None


def _readers(value: ir.Value) -> list[ir.Operation]:
    """The ops reading `value`, through reshapes."""
    found = []
    for u in users(value):
        found += _readers(u.results[0]) if u.name in _RESHAPES else [u]
    return found


def _only_user(value: ir.Value) -> ir.Operation | None:
    us = users(value)
    return us[0] if len(us) == 1 else None


def attention_backward_in(func: ir.Operation) -> AttentionBackward:
    """Locate the attention backward of `func` (see the module docstring) or say why not."""
    ops = [op for op in block_ops(func) if is_linalg_op(op)]
    contractions = [c for c in map(_contraction, ops) if c is not None]
    # dQ = dS K and dK = dS^T Q read the same dS [G, L, S], reducing its keys and its queries
    found = [(a, ia, b) for a in contractions for ia in range(2) for b in contractions
             if a is not b and not a.leaf(ia, "features").transposed
             and _elementwise_with(defining_op(a.leaf(ia, "features").value), "")
             and b.reads(a.leaf(ia, "features"), "rows") is not None]
    # dS is computed from contractions (not a cast of an input, as Q in f32 is)
    found = [f for f in found if any(
        depends_on(defining_op(f[0].leaf(f[1], "features").value), c.result)
        for c in contractions)]
    if len(found) == 2:  # P, read by O = P V and dV = P^T dO, looks the same; dS reads P
        later = [f for f in found if any(
            depends_on(defining_op(f[0].leaf(f[1], "features").value), g[0].leaf(g[1], "features").value)
            for g in found if g is not f)]
        found = later
    if len(found) != 1:
        raise NotAttentionBackward(f"expected one dS read by dQ = dS K and dK = dS^T Q, "
                                   f"found {len(found)}")
    cq, iq, ck = found[0]
    ds_src = cq.leaf(iq, "features")
    ik = ck.reads(ds_src, "rows")
    k_src, q_src = cq.leaf(1 - iq, "rows"), ck.leaf(1 - ik, "rows")
    if ds_src.transposed:
        raise NotAttentionBackward("dS is stored transposed")
    # dS' = c' dS: the math backend's graph scales dS before dQ and dK, the flash form after
    ds_val, pre = ds_src.value, 1.0
    if (c := _scale_of(defining_op(ds_val))) is not None:
        ds_val, pre = defining_op(ds_val).operands[0], c
    # the math backend's masked_fill(mask, -inf) passes dS through masked_fill(mask, 0): P is
    # 0 there, so the fill changes nothing when its mask is the forward's (checked below)
    filled = _zero_fill(defining_op(trace(ds_val).value))
    if filled is not None:
        ds_val = filled[0]
    p_val, dp_val, d_val = _softmax_grad_parts(defining_op(trace(ds_val).value))
    dp = next((c for c in contractions if c.result == trace(dp_val).value
               and not trace(dp_val).transposed), None)
    d_op = defining_op(d_val)
    if dp is None or d_op is None or not is_linalg_op(d_op) \
            or len(loop_structure(d_op).reduction_dims) != 1:
        raise NotAttentionBackward("dS's dP - D does not read dP = dO V^T and a row sum D")
    # dV = P^T dO: the contraction reading P over its queries
    p_src = trace(p_val)
    dvs = [(c, c.reads(p_src, "rows")) for c in contractions]
    dvs = [(c, i) for c, i in dvs if i is not None]
    if len(dvs) != 1 or p_src.transposed:
        raise NotAttentionBackward(f"expected one dV = P^T dO, found {len(dvs)}")
    cv, iv = dvs[0]
    do_src = cv.leaf(1 - iv, "rows")
    # dP = dO V^T
    i_do = dp.reads(do_src, "features")
    if i_do is None:
        raise NotAttentionBackward("dP is not dO V^T")
    v_src = dp.leaf(1 - i_do, "features")
    # D = rowsum(dO * O) (rowsum(O) once a dO of ones is folded into it), or the math
    # backend's rowsum(dP * P) = rowsum(dO * O) with O = P V, or (no P V: an f16/bf16
    # backward with a mask gradient, flash_decompositions, or one written by hand)
    # rowsum(dP * P) itself, O None
    o_src = _rowsum_partner(d_op, do_src, p_src, dp, contractions, cv)
    # P = exp(c S [masked] - lse) or softmax(c S [masked]): its scores read Q and K
    scores, scale, masked, row_max, bias, guarded, lse = _scores_of(p_val, contractions)
    if scores.reads(q_src, "features") != 0 or scores.reads(k_src, "features") != 1:
        raise NotAttentionBackward("the recomputed scores do not read the Q and K of dQ, dK")
    if not guarded and bias is not None:
        raise NotAttentionBackward("a softmax written by hand over a tensor mask: torch gives "
                                   "NaN on its fully masked rows, in a pattern of its own")
    if filled is not None and filled[1] != _fill_mask(defining_op(row_max.operands[0])):
        raise NotAttentionBackward("dS is filled with 0 where the scores are not masked")
    if any(_scale_of(defining_op(s.value)) is not None for s in (q_src, k_src)):
        # the forward's query blocks would take the scaled Q the kernel reads as well
        raise NotAttentionBackward("Q or K is scaled before the scores (not fused yet)")
    # dQ = c (dS K), dK = c (dS^T Q), dV = P^T dO, each as [.., rows, features]
    dq = _canonical_result(cq, iq, scale / pre)
    dk = _canonical_result(ck, ik, scale / pre)
    dv = _canonical_result(cv, iv, 1.0)
    if q_src.groups != 1 or do_src.groups != 1 or k_src.groups != v_src.groups:
        raise NotAttentionBackward("K and V are not read with one grouping")
    dk, dv = (_group_sum(v, k_src.groups) for v in (dk, dv))
    dbias = _bias_gradient(trace(ds_val).value, (cq.op, ck.op), bias)
    return AttentionBackward(q_src, k_src, v_src, o_src, do_src, scale, scores.op, row_max,
                             masked, bias, guarded, dq, dk, dv, lse, dbias)


_LAYOUT = ("tensor.collapse_shape", "tensor.expand_shape", "linalg.transpose")


def _bias_gradient(ds: ir.Value, contractions: tuple, bias: Bias | None) -> list | None:
    """The operand slots reading the bias's gradient, dS summed over the dims the bias is
    broadcast along (a reduction of dS, or dS itself when it has the bias's elements): the
    readers of dS, through layout ops, other than the ops dQ and dK are computed from. None when
    there are none; NotAttentionBackward when there are others, or no bias they could be
    the gradient of."""
    others, pending = [], [(ds, False)]
    while pending:
        value, transposed = pending.pop()
        for use in value.uses:
            op = user_op(use)
            if op in contractions or any(depends_on(c, r) for c in contractions
                                         for r in op.results):
                continue  # on the way to dQ or dK (a scale, a zero fill, a transpose)
            swap = op.name == "linalg.transpose" or (_copy_map(op) or (None,))[0] == "swap"
            if swap or op.name in _LAYOUT:
                pending.append((op.results[0], transposed or swap))
                continue
            others.append((op, use.operand_number, value, transposed))
    if not others:
        return None
    if bias is None:
        raise NotAttentionBackward("dS is read besides dQ and dK, and there is no mask it "
                                   "would be the gradient of")
    if len(others) == 1 and not others[0][3]:
        op, index, ds, _ = others[0]
        red = loop_structure(op) if is_linalg_op(op) else None
        if red is not None and red.reduction_dims and red.num_inputs == 1 \
                and red.maps[0] == ir.AffineMap.get_identity(red.num_loops) \
                and _body_names(op)[-2:] == ["arith.addf", "linalg.yield"] \
                and _same_elements(op.results[0], bias):
            return [(user_op(u), u.operand_number) for u in op.results[0].uses]
        if _same_elements(ds, bias):
            return [(op, index)]
    raise NotAttentionBackward("dS is read besides dQ and dK, not as the mask's gradient "
                               "(dS summed where the mask is broadcast)")


def _same_elements(a: ir.Value, bias: Bias) -> bool:
    """Does `a`, dS or dS summed where the bias is broadcast (reshaped, not transposed), hold
    the bias's elements in the bias's order: as many, and the bias's dims read in the
    scores' order (groups, then queries, then keys)?"""
    count = lambda v: math.prod(ir.ShapedType(v.type).shape)
    order = {"g": 0, "b": 0, "h": 1, "q": 2, "k": 3}
    ranks = [order[r] for r in bias.roles if r != "1"]
    return count(a) == count(bias.value) and ranks == sorted(ranks)


def _zero_fill(op: ir.Operation | None) -> tuple[ir.Value, ir.Value] | None:
    """(x, mask) when `op` is an elementwise generic computing select(mask, 0, x) of its
    inputs (masked_fill(x, mask, 0); the mask maybe stored as i8), else None."""
    parts = _select_of(op)
    if parts is None or _float_constant_in(op, parts[1]) != 0.0:
        return None
    return parts[2], parts[0]


def _fill_mask(op: ir.Operation | None) -> ir.Value | None:
    """The mask tensor of select(mask, -inf, x) (masked_fill(x, mask, -inf)), else None."""
    parts = _select_of(op)
    if parts is None or _float_constant_in(op, parts[1]) != float("-inf"):
        return None
    return parts[0]


def _select_of(op: ir.Operation | None):
    """(the condition's input tensor, the true value, the false value's input tensor) of an
    elementwise generic yielding select(trunci? (cond input), t, false input), else None."""
    if op is None or op.name != "linalg.generic" or not loop_structure(op).is_elementwise:
        return None
    block = op.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    if len(ops) < 2 or ops[-2].name != "arith.select" or ops[-1].operands[0] != ops[-2].results[0]:
        return None
    cond, t, f = ops[-2].operands
    c = defining_op(cond)
    if c is not None and c.name == "arith.trunci":
        cond = c.operands[0]
    args = list(block.arguments)
    n_in = loop_structure(op).num_inputs
    if cond not in args[:n_in] or f not in args[:n_in]:
        return None
    return (trace(op.operands[args.index(cond)]).value, t,
            op.operands[args.index(f)])


def _float_constant_in(op: ir.Operation, value: ir.Value) -> float | None:
    """The float constant `value` holds in `op`'s body (a constant, or an input reading a
    splat), else None."""
    args = list(op.regions[0].blocks[0].arguments)
    if value in args[:loop_structure(op).num_inputs]:
        value = op.operands[args.index(value)]
    return _float_constant(value)


def _softmax_grad_parts(op: ir.Operation | None) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(P, dP, D) of dS = P (dP - D), or of the math backend's dS = dP P - P D (D read
    broadcast along the keys), or say why not."""
    if _elementwise_with(op, "arith.mulf") and len(_elementwise_inputs(op)) == 2:
        for mine, other in ((0, 1), (1, 0)):
            v = _elementwise_inputs(op)[mine]
            src = trace(v)
            d = defining_op(src.value) if not src.transposed else None
            if _elementwise_with(d, "arith.subf") and len(_elementwise_inputs(d)) == 2:
                dp, dd = _elementwise_inputs(d)
                return _elementwise_inputs(op)[other], dp, dd
    if _elementwise_with(op, "arith.subf") and len(_elementwise_inputs(op)) == 2:
        a, b = (defining_op(v) for v in _elementwise_inputs(op))
        if all(_elementwise_with(x, "arith.mulf") and len(_elementwise_inputs(x)) == 2 for x in (a, b)):
            for p in _elementwise_inputs(b):
                if p in list(_elementwise_inputs(a)):
                    dp = next(v for v in _elementwise_inputs(a) if v != p)
                    db = next((v for v in _elementwise_inputs(b) if v != p), None)
                    if db is not None:
                        return p, dp, _unbroadcast_rows(db)
    raise NotAttentionBackward("dS is not P (dP - D)")


def _unbroadcast_rows(value: ir.Value) -> ir.Value:
    """The [.., L] row value a generic broadcasts along the keys to `value`, else `value`."""
    p = defining_op(value)
    if p is None or p.name != "linalg.generic" or len(p.operands) != 2:
        return value
    body = [o.operation for o in p.regions[0].blocks[0].operations]
    ls = loop_structure(p)
    n = ls.num_loops
    if len(body) == 1 and body[0].operands[0] == p.regions[0].blocks[0].arguments[0] \
            and not ls.reduction_dims and ls.maps[1] == ir.AffineMap.get_identity(n) \
            and [e.position if isinstance(e, ir.AffineDimExpr) else None
                 for e in ls.maps[0].results] == list(range(n - 1)):
        return p.operands[0]
    return value


def _canonical_result(c: _Contraction, index: int, scale: float) -> ir.Value:
    """The value holding `scale` times `c`'s result as [.., rows, features] (through a scale
    by that constant unless it is 1, a last-two-dims transpose and reshapes of the leading
    dims, each the only reader of the one before). `index`: the input whose kept dim is the
    result's rows."""
    ls = loop_structure(c.op)
    dims = ls.contraction_dims()
    kept = [e.position for e in ls.maps[index].results
            if e.position not in dims["batch"] + dims["k"]]
    out = [e.position for e in ls.output_map(0).results]
    transposed = len(kept) != 1 or out.index(kept[0]) != len(out) - 2
    value, pending = c.result, not math.isclose(scale, 1.0, rel_tol=1e-6)
    while True:
        user = _only_user(value)
        if user is None:
            break
        if pending and (f := _scale_of(user)) is not None and math.isclose(f, scale, rel_tol=1e-6):
            value, pending = user.results[0], False
        elif user.name == "linalg.transpose" and _swaps_last_two(user) or \
                (_copy_map(user) or (None,))[0] == "swap":
            value, transposed = user.results[0], not transposed
        elif user.name in _RESHAPES and _merges_leading(user) and transposed:
            value = user.results[0]
        else:
            break
    if transposed or pending:
        raise NotAttentionBackward("a gradient stays transposed" if transposed else
                                   "dQ and dK are not scaled like the scores")
    return value


def _group_sum(value: ir.Value, groups: int) -> ir.Value:
    """The sum over the query heads of each K/V head's group of a [G, S, E] gradient
    (through a reshape splitting G), the gradient itself when groups == 1."""
    if groups == 1:
        return value
    user = _only_user(value)
    if user is not None and user.name in _RESHAPES and ir.ShapedType(user.results[0].type).rank \
            > ir.ShapedType(value.type).rank:
        value, user = user.results[0], _only_user(user.results[0])
    if user is None or not is_linalg_op(user) or len(loop_structure(user).reduction_dims) != 1 \
            or _body_names(user)[-2:] != ["arith.addf", "linalg.yield"] \
            or loop_structure(user).num_inputs != 1:
        raise NotAttentionBackward("dK, dV of grouped-query attention are not summed per group")
    ls = loop_structure(user)
    red = ls.reduction_dims[0]
    if ls.ranges[red] != groups or red >= ls.num_loops - 2:
        raise NotAttentionBackward("dK, dV are not summed over the query heads of a group")
    return user.results[0]


def _rowsum_partner(d_op: ir.Operation, do_src: Source, p_src: Source, dp: _Contraction,
                    contractions: list[_Contraction], dv: _Contraction) -> Source | None:
    """O of D = rowsum(dO * O) (`d_op` the reduction), or, for D = rowsum(dP * P), the
    output of the contraction O = P V, or None when there is none; or say why not."""
    prod = defining_op(d_op.operands[0])
    if _elementwise_with(prod, "arith.mulf") and len(_elementwise_inputs(prod)) == 2:
        srcs = [trace(v) for v in _elementwise_inputs(prod)]
        if any(s.same(p_src) for s in srcs) and any(s.value == dp.result for s in srcs):
            pv = [c for c in contractions if c is not dv and c.reads(p_src, "features") is not None]
            if len(pv) == 1:
                return Source(pv[0].result, False)
            if not pv:
                return None
    if _elementwise_with(prod, "arith.mulf") and len(_elementwise_inputs(prod)) == 2 \
            and all(m == ir.AffineMap.get_identity(m.n_dims) for m in loop_structure(prod).maps):
        srcs = [trace(v) for v in _elementwise_inputs(prod)]
        for mine, other in ((0, 1), (1, 0)):
            if srcs[mine].same(do_src):
                return srcs[other]
    if _float_constant(do_src.value) == 1.0 and _body_names(d_op)[-2:] == ["arith.addf", "linalg.yield"] \
            and loop_structure(d_op).num_inputs == 1:
        return trace(d_op.operands[0])
    raise NotAttentionBackward("D is not rowsum(dO O)")


def _elementwise_with(op: ir.Operation | None, name: str) -> bool:
    return op is not None and op.name == "linalg.generic" and \
        loop_structure(op).is_elementwise and (not name or name in _body_names(op))


def _scores_of(p: ir.Value, contractions: list[_Contraction]):
    """(scores contraction, scale c, masked, row max (or the op computing S - lse), tensor
    mask or None, guarded, the given lse or None) of P = exp(c S [masked] - lse) or
    softmax(c S [masked])."""
    p_op = defining_op(p)
    seen, pending, found_exp = [], [p_op], False
    chain = []
    while pending:
        op = pending.pop()
        if op is None or op in seen or not is_linalg_op(op):
            continue
        seen.append(op)
        ls = loop_structure(op)
        if ls.reduction_dims or not ls.is_elementwise:
            continue
        if op.name == "linalg.generic" and "math.exp" in _body_names(op):
            found_exp = True
        chain.append(op)
        for v in _elementwise_inputs(op):  # the [.., L, S] inputs, through reshapes
            src = trace(v)
            if not src.transposed and src.groups == 1 and \
                    list(ir.ShapedType(src.value.type).shape)[-2:] == list(ir.ShapedType(p.type).shape)[-2:]:
                pending.append(defining_op(src.value))
    if not found_exp:
        raise NotAttentionBackward("P is not computed by an exp")
    scores = [c for c in contractions if any(
        trace(v).value == c.result for op in chain for v in _elementwise_inputs(op))]
    if len(scores) != 1:
        raise NotAttentionBackward(f"expected P to read one scores contraction, found {len(scores)}")
    scores = scores[0]
    scaled = _only_user(scores.result)
    scale = _scale_of(scaled)
    if scale is None:  # unscaled scores (or the scale is in Q or K)
        scale, scaled = 1.0, scores.op
    # the masked scores: the last op of the chain from the scaled scores read by a max
    maxes = []
    for op in chain + [scores.op]:
        for r in op.results:
            for u in _readers(r):
                if is_linalg_op(u) and loop_structure(u).reduction_dims and \
                        "arith.maximumf" in _body_names(u):
                    maxes.append((op, u))
    given = _given_lse(chain) if not maxes else None
    if given is not None:
        masked_op, row_max, lse = given
        if masked_op not in chain + [scores.op]:
            raise NotAttentionBackward("S - lse does not read the recomputed scores")
    elif len(maxes) != 1:
        raise NotAttentionBackward(f"expected one row max of the recomputed scores, found {len(maxes)}")
    else:
        (masked_op, row_max), lse = maxes[0], None
    masked = masked_op != scaled
    bias = _bias_of(masked_op, scaled) if masked else None
    # the guard: a select of 0 on P's way (SDPA's fully masked rows; a mask fills -inf)
    guarded = any((parts := _select_of(op)) is not None and _float_constant_in(op, parts[1]) == 0.0
                  for op in chain)
    return scores, scale, masked, row_max, bias, guarded, lse


def _given_lse(chain: list[ir.Operation]):
    """(the masked scores' op, the op computing S - lse, lse) when P's chain subtracts a
    given [.., L] lse read along the keys (a tensor no max over S computes), else None."""
    for op in chain:
        ls = loop_structure(op)
        if op.name != "linalg.generic" or ls.num_inputs != 2 or "arith.subf" not in _body_names(op):
            continue
        n = ls.num_loops
        full = [i for i in range(2) if ls.maps[i] == ir.AffineMap.get_identity(n)]
        rows = [i for i in range(2) if _reads_rows(ls.maps[i], n)]
        if len(full) != 1 or len(rows) != 1:
            continue
        lse = trace(op.operands[rows[0]])
        if lse.transposed or str(ir.ShapedType(lse.value.type).element_type) != "f32":
            continue
        masked = defining_op(trace(op.operands[full[0]]).value)
        return masked, op, lse.value
    return None


def _reads_rows(amap: ir.AffineMap, n: int) -> bool:
    """Does `amap` read every loop dim but the last (the keys), in order, unit dims aside?"""
    dims = [e.position for e in amap.results if isinstance(e, ir.AffineDimExpr)]
    others = [e for e in amap.results if not isinstance(e, ir.AffineDimExpr)]
    return dims == list(range(n - 1)) and all(
        isinstance(e, ir.AffineConstantExpr) and e.value == 0 for e in others)


def _bias_of(masked_op: ir.Operation, scaled: ir.Operation) -> Bias | None:
    """The tensor `masked_op` adds to the scaled scores (None: the mask is computed from
    indices, or is not an addition of a tensor)."""
    ls = loop_structure(masked_op)
    names = _body_names(masked_op)
    if ls.num_inputs != 2 or names != ["arith.addf", "linalg.yield"] \
            or masked_op.operands[0] != scaled.results[0] \
            or str(ir.ShapedType(masked_op.operands[1].type).element_type) != "f32":
        return None
    index = 1
    value = masked_op.operands[index]
    producer = defining_op(value)
    if producer is not None and is_index_computation(producer):
        return None
    rank = ls.num_loops
    loop_roles = {1: ["g"], 2: [], 3: ["g"], 4: ["b", "h"]}[rank] if rank in (2, 3, 4) else None
    if loop_roles is None or ls.maps[2] != ir.AffineMap.get_identity(rank):
        return None
    loop_roles = (loop_roles + ["q", "k"])[-rank:] if rank >= 2 else loop_roles
    roles = []
    for e in ls.maps[index].results:
        if isinstance(e, ir.AffineDimExpr):
            roles.append(loop_roles[e.position])
        elif isinstance(e, ir.AffineConstantExpr) and e.value == 0:
            roles.append("1")
        else:
            return None
    heads = ls.ranges[1] if rank == 4 else 1
    return Bias(value, tuple(roles), heads)


__all__ = ["AttentionBackward", "Bias", "NotAttentionBackward", "Source", "attention_backward_in",
           "trace"]
