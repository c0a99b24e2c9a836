"""Where torch-mlir's lowering of an op differs from torch's own result or is missing, and
the fix.

FX decompositions (`semantics_decompositions`, in the ingress's tables for every import):
- hardtanh (and relu6): torch-mlir's decomposition picks the bound where x is NaN
  (`x > lo ? x : lo`); it is traced as clamp(x, lo, hi), which torch-mlir lowers in one
  elementwise op, and whose compares the IR rewrite below orders.
- clamp of an integer tensor by a float bound: torch promotes to the default float type;
  torch-mlir compared the integers with cmpf and failed. The tensor is converted first.
- hardtanh_backward: torch passes the gradient where min < x < max only (a NaN x gets 0);
  torch-mlir's compares passed it through at a NaN.
- eq of two float tensors: torch-mlir folds eq(x, x) to true (also x == x.clone()), which
  a NaN is not; eq is computed as not ne (une), which no fold touches.
- eq, ne, lt, le, gt, ge of a float tensor and an int scalar: torch-mlir folded them wrongly
  on a constant tensor (ones_like(y) < 0 all true, full_like(y, 2.0) == 2 all false; the
  gradient of logcumsumexp, which splits ones by sign, came out negated). The scalar is
  made a float, as torch converts it to the tensor's type.
- pow(x, 0.5) and pow(x, -0.5): torch computes sqrt(x) and rsqrt(x) (pow(-inf, 0.5) is NaN,
  pow(-0, 0.5) is -0); math.powf gave inf and +0.
- isfinite (torch-mlir has no lowering): not isnan(x) and |x| != inf; true for integers.
- dist(a, b, p) (no lowering): the vector norm of a - b.
- bucketize and searchsorted (no lowering; no sorter): the count of boundaries below each
  value (`right`: at or below; all of them for NaN), over a broadcast compare [..., values,
  boundaries].
- scatter, scatter_add, scatter_reduce along a negative dim: torch-mlir's lowering ran out
  of memory or crashed the process; the dim is made non-negative first.
- constant_pad_nd with a negative pad (F.pad cropping): the crop as a slice, then the
  non-negative pad (torch-mlir's tensor.pad with a negative width failed to bufferize).

Refused before the import (`refuse_unsigned_bytes`): uint8 tensors. torch-mlir imports them as
signless i8 and then compares, divides and widens them as signed (a uint8 floor division
crashed its lowering, a float converted to uint8 came back wrong); the one-line error names
the op that makes or reads one.

IR rewrites after the import (`nan_as_torch`, in every import's finish):
- clamp, clamp_min, clamp_max, hardtanh, relu6 with number bounds: torch-mlir lowers each
  bound as `x <u lo ? lo : x` (`ult`, `ugt`), so a NaN became the bound. torch keeps x
  unless it is strictly outside: the compares of that `select(cmp(x, b), b, x)` shape
  become ordered (NaN stays NaN, -0 stays -0, lo > hi still gives hi).
- argmax / argmin / max(dim) / min(dim): torch-mlir's reduction moves the index when
  `in > best` (`ogt`), which a NaN fails, while torch takes the first NaN as the extreme
  (the value result already propagates NaN through maximumf / minimumf). The compare
  becomes `in > best or in is NaN`, unless best is NaN already: `ugt(in, best) and
  ord(best)`.
- max_pool with indices: torch-mlir pools the maximum m, then searches each window for the
  first x == m (`oeq`), which no element passes when m is NaN (the index stayed -1); torch
  gives the last NaN's (its loop moves the index on `x > best or x is NaN`). Where m is
  NaN, the search's step now takes the index of every NaN x.
"""

from __future__ import annotations

import math
import numbers

import torch

aten = torch.ops.aten


def _is_number(v) -> bool:
    return v is None or isinstance(v, numbers.Number)


def _clamp_of_integers_promoted(x, min=None, max=None):
    """clamp(x, lo, hi) of an integer x with a float bound, in the default float type."""
    if x.is_floating_point() or not (_is_number(min) and _is_number(max)) or \
            not any(isinstance(b, float) for b in (min, max)):
        return NotImplemented
    return torch.clamp(x.to(torch.get_default_dtype()), min, max)


def _hardtanh_as_clamp(x, min_val=-1.0, max_val=1.0):
    if not x.is_floating_point():
        return NotImplemented
    return torch.clamp(x, min_val, max_val)


def _hardtanh_backward_inside(grad_output, x, min_val, max_val):
    return torch.where((x > min_val) & (x < max_val), grad_output, 0.0)


def _float_eq_as_not_ne(a, b):
    if not (isinstance(a, torch.Tensor) and a.is_floating_point()):
        return NotImplemented
    return torch.logical_not(torch.ne(a, b))


def _compared_with_a_float(op):
    """A float tensor compared with an int scalar, compared with that scalar as a float (as
    torch does: the scalar takes the tensor's type). torch-mlir folded such compares of a
    constant tensor wrongly: ones_like(y) < 0 was all true, full_like(y, 2.0) == 2 all false
    (so the gradient of logcumsumexp, whose where(grad < 0, ...) reads ones, changed sign)."""

    def decomposition(a, b):
        if not (isinstance(a, torch.Tensor) and a.is_floating_point()) or not isinstance(b, int):
            return NotImplemented
        return op(a, float(b))

    return decomposition


COMPARES = (aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar,
            aten.ge.Scalar)


def _pow_half_as_sqrt(x, exponent):
    """x^0.5 = sqrt(x), x^-0.5 = rsqrt(x), as torch computes them."""
    if not x.is_floating_point() or not isinstance(exponent, numbers.Number):
        return NotImplemented
    if exponent == 0.5:
        return torch.sqrt(x)
    if exponent == -0.5:
        return torch.rsqrt(x)
    return NotImplemented


def _isfinite(x):
    if not x.is_floating_point():
        return torch.ones_like(x, dtype=torch.bool)
    return ~torch.isnan(x) & (x.abs() != math.inf)


def _pad_cropping_first(x, pad, value=0.0):
    """F.pad with negative widths: crop those sides (a slice), then pad the others."""
    if all(p >= 0 for p in pad):
        return NotImplemented
    for i in range(len(pad) // 2):
        dim = x.dim() - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        start, stop = max(-before, 0), x.shape[dim] - max(-after, 0)
        x = x.narrow(dim, start, max(stop - start, 0))
    return aten.constant_pad_nd(x, [max(p, 0) for p in pad], value)


def refuse_unsigned_bytes(gm: torch.fx.GraphModule, name: str) -> None:
    """Raise IngressError naming the first op (or input) of `gm` with a uint8 value that
    holds elements."""
    from .errors import IngressError

    for node in gm.graph.nodes:
        values = node.meta.get("val")
        values = values if isinstance(values, (tuple, list)) else (values,)
        if any(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.numel()
               for v in values):  # not batch norm's empty reserve
            what = f"input {node.target} is" if node.op == "placeholder" else \
                f"{getattr(node.target, '__name__', node.target)} ({node.name}) makes"
            raise IngressError(f"{name}: {what} a uint8 tensor; unsigned 8-bit tensors are "
                               f"not supported (torch-mlir computes them as signed int8): "
                               f"convert to int16 or wider first")


def _dist(a, b, p=2):
    return torch.linalg.vector_norm(a - b, p)


def _count_below(values, boundaries, right: bool, out_int32: bool):
    """#boundaries < v (<= v when `right`) per value; `boundaries` 1-D, or batched over
    values' leading dims."""
    if boundaries.dim() == 1:
        pairs = values.unsqueeze(-1), boundaries
    else:
        pairs = values.unsqueeze(-1), boundaries.unsqueeze(-2)
    above = pairs[1] > pairs[0] if right else pairs[1] >= pairs[0]
    below = torch.logical_not(above)  # a NaN value is past every boundary, as in torch
    return below.sum(-1, dtype=torch.int32 if out_int32 else torch.int64)


def _bucketize(input, boundaries, *, out_int32=False, right=False):
    if not isinstance(input, torch.Tensor):
        return NotImplemented
    return _count_below(input, boundaries, right, out_int32)


def _searchsorted(sorted_sequence, input, *, out_int32=False, right=False, side=None,
                  sorter=None):
    if sorter is not None or not isinstance(input, torch.Tensor):
        return NotImplemented
    return _count_below(input, sorted_sequence, right or side == "right", out_int32)


def _positive_dim(op):
    def scatter(self, dim, *args, **kwargs):
        if dim >= 0:
            return NotImplemented
        return op(self, dim + max(self.dim(), 1), *args, **kwargs)
    return scatter


SCATTERS = (aten.scatter.src, aten.scatter.value, aten.scatter.reduce,
            aten.scatter.value_reduce, aten.scatter_add.default, aten.scatter_reduce.two)


def semantics_decompositions() -> dict:
    return {aten.clamp.default: _clamp_of_integers_promoted,
            aten.hardtanh.default: _hardtanh_as_clamp,
            aten.hardtanh_backward.default: _hardtanh_backward_inside,
            aten.eq.Tensor: _float_eq_as_not_ne,
            aten.pow.Tensor_Scalar: _pow_half_as_sqrt,
            aten.isfinite.default: _isfinite,
            aten.constant_pad_nd.default: _pad_cropping_first,
            aten.dist.default: _dist,
            aten.bucketize.Tensor: _bucketize,
            aten.searchsorted.Tensor: _searchsorted,
            **{op: _positive_dim(op) for op in SCATTERS},
            **{op: _compared_with_a_float(op) for op in COMPARES}}


def nan_as_torch(module) -> int:
    """The IR rewrites of the module docstring; return how many compares were rewritten."""
    return (_nan_kept_by_clamps(module) + _nan_first_arg_reductions(module)
            + _nan_found_in_pool_indices(module))


def _generic_bodies(module):
    """(block, number of inputs) of every linalg.generic in `module`."""
    from transform_ext.common import ops_named

    return [(op.regions[0].blocks[0], len(op.operands) - len(op.results))
            for op in ops_named(module.operation, "linalg.generic")]


def _is_block_arg(value, block, inputs: int, *, output: bool) -> bool:
    from torch_mlir import ir

    return isinstance(value, ir.BlockArgument) and value.owner == block and \
        (value.arg_number >= inputs) == output


def _only_selects_condition(cmp, block, inputs: int, *, into_output: bool) -> bool:
    """Every use of `cmp` is a select's condition (whose false value is an output's block
    argument, when `into_output`)."""
    uses = list(cmp.results[0].uses)
    return bool(uses) and all(
        use.owner.name == "arith.select" and use.operand_number == 0 and
        (not into_output or _is_block_arg(use.owner.operands[2], block, inputs, output=True))
        for use in uses)


def _replace_compare(cmp, build) -> None:
    from torch_mlir import ir

    with ir.InsertionPoint(cmp), cmp.location:
        replacement = build(*cmp.operands)
    cmp.results[0].replace_all_uses_with(replacement)
    cmp.erase()


def _predicate(cmp) -> int:
    return int(str(cmp.attributes["predicate"]).split(":")[0])


def _nan_kept_by_clamps(module) -> int:
    """`%c = cmpf ult|ugt %x, %b` whose one use is `select %c, %b, %x`: olt|ogt."""
    from torch_mlir.dialects import arith

    P = arith.CmpFPredicate
    ordered = {int(P.ULT): P.OLT, int(P.UGT): P.OGT}
    found = []
    for block, _ in _generic_bodies(module):
        for inner in block.operations:
            if inner.name != "arith.cmpf" or _predicate(inner) not in ordered:
                continue
            uses = list(inner.results[0].uses)
            if len(uses) != 1 or uses[0].owner.name != "arith.select" or uses[0].operand_number:
                continue
            x, bound = inner.operands
            select = uses[0].owner
            if select.operands[1] == bound and select.operands[2] == x:
                found.append((inner, ordered[_predicate(inner)]))
    with module.context:
        for cmp, predicate in found:
            _replace_compare(cmp, lambda x, bound, predicate=predicate:
                             arith.cmpf(predicate, x, bound))
    return len(found)


def _nan_first_arg_reductions(module) -> int:
    """`%c = cmpf ogt|olt %in, %best`, %best an output's block argument whose yield is
    maximumf|minimumf(%in, %best), %c only the condition of selects."""
    from torch_mlir.dialects import arith

    from transform_ext.common import defining_op

    P = arith.CmpFPredicate
    extreme_of = {int(P.OGT): ("arith.maximumf", P.UGT), int(P.OLT): ("arith.minimumf", P.ULT)}
    found = []
    for block, inputs in _generic_bodies(module):
        ops = list(block.operations)
        yielded = list(ops[-1].operands)
        for inner in ops:
            if inner.name != "arith.cmpf" or _predicate(inner) not in extreme_of:
                continue
            extreme, unordered = extreme_of[_predicate(inner)]
            value, best = inner.operands
            if not (_is_block_arg(value, block, inputs, output=False) and
                    _is_block_arg(best, block, inputs, output=True)):
                continue
            update = defining_op(yielded[best.arg_number - inputs])
            if update is None or update.name != extreme or \
                    list(update.operands) not in ([value, best], [best, value]):
                continue
            if _only_selects_condition(inner, block, inputs, into_output=False):
                found.append((inner, unordered))
    with module.context:
        for cmp, unordered in found:
            _replace_compare(cmp, lambda value, best, unordered=unordered: arith.andi(
                arith.cmpf(unordered, value, best), arith.cmpf(P.ORD, best, best)))
    return len(found)


def _nan_found_in_pool_indices(module) -> int:
    """`%c = cmpf oeq %x, %m` (%x read by tensor.extract, %m an input's block argument), %c
    only the condition of a select of (index, %found), %found the output's block argument;
    the yield of %found's output becomes `m is NaN ? (x is NaN ? index : found) : yield`."""
    from torch_mlir import ir
    from torch_mlir.dialects import arith

    from transform_ext.common import defining_op

    P = arith.CmpFPredicate
    found = []
    for block, inputs in _generic_bodies(module):
        ops = list(block.operations)
        for inner in ops:
            if inner.name != "arith.cmpf" or _predicate(inner) != int(P.OEQ):
                continue
            x, m = inner.operands
            read = defining_op(x)
            if read is None or read.name != "tensor.extract":
                continue
            uses = list(inner.results[0].uses)
            if len(uses) == 1 and _is_block_arg(m, block, inputs, output=False) and \
                    _only_selects_condition(inner, block, inputs, into_output=True):
                found.append((inner, uses[0].owner, ops[-1], inputs))
    with module.context:
        for cmp, select, yield_op, inputs in found:
            x, m = cmp.operands
            index, so_far = select.operands[1], select.operands[2]
            position = so_far.arg_number - inputs
            with ir.InsertionPoint(yield_op), yield_op.location:
                at_nan = arith.select(arith.cmpf(P.UNO, x, x), index, so_far)
                value = arith.select(arith.cmpf(P.UNO, m, m), at_nan,
                                     yield_op.operands[position])
            yield_op.operands[position] = value
    return len(found)
