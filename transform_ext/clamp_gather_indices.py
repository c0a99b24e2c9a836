"""clamp_gather_indices: a data-dependent read inside a linalg body stays inside its tensor.

A `tensor.extract` of T (static dim n along position p) inside a linalg body at an index i
computed from data (a target, which may be ignore_index = -100) reads
T[..., clamp(i, 0, n - 1), ...] instead: torch-mlir's imports read such elements before
selecting them away (the one-hot of nll_loss_backward reads w[y] for every y), so an
unclamped read is out of bounds. Exact wherever 0 <= i < n. Out of bounds, torch raises: a
read whose body already checks (holds a cf.assert, as torch-mlir emits for embedding and
gather) or guards (i, or the integer it was cast from, compared for (in)equality with a
constant: the ignore_index of nll_loss) keeps its checks; every other one (x[i],
index_select) gets `cf.assert 0 <= i <= n - 1, "index out of range: dimension p of a
<shape> tensor has size n"` in front of it, so the kernel reports the bad index
(checks_to_error_code) instead of returning a clamped read.

Sites: every tensor.extract directly in the body of a linalg op nested in the target ops.
An index computed only from loop indices (linalg.index) and constants, one bounded by
construction (an unsigned minimum with a constant in [0, n - 1]), and a dim of dynamic
size are left alone; nothing is rejected. The handle is only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import arith, cf, ext, transform

from .common import RewritesTargets, Success, defining_op, payload_ops
from .dialect import TransformExt
from .match_assertion_checks import holds_assert


def _in_linalg_body(op: ir.Operation) -> bool:
    parent = op.parent
    return parent is not None and parent.name.startswith("linalg.")


def _compared_with_constant(value: ir.Value) -> bool:
    """Is `value` (or the integer it was cast from) compared for (in)equality with a constant
    in its body: a guarded read such as nll_loss's target != ignore_index?"""
    candidates = [value]
    owner = defining_op(value)
    if owner is not None and owner.name == "arith.index_cast":
        candidates.append(owner.operands[0])
    for candidate in candidates:
        for use in candidate.uses:
            user = use.owner
            if user.name != "arith.cmpi" or ir.IntegerAttr(user.attributes["predicate"]).value > 1:
                continue
            other = defining_op(user.operands[1 - use.operand_number])
            if other is not None and other.name == "arith.constant":
                return True
    return False


def _loop_index_only(value: ir.Value, body_owner: ir.Operation) -> bool:
    """Is `value` computed from loop indices (linalg.index) and constants only?"""
    pending, seen = [value], []
    while pending:
        v = pending.pop()
        if v in seen:
            continue
        seen.append(v)
        op = defining_op(v)
        if op is None:
            return False
        if op.name in ("linalg.index", "arith.constant"):
            continue
        if op.parent != body_owner or not op.name.startswith("arith.") or op.regions:
            return False
        pending.extend(op.operands)
    return True


def _bounded_by_construction(value: ir.Value, size: int) -> bool:
    """Is `value` (or the integer it was cast from) an unsigned minimum with a constant in
    [0, size - 1], so in range whatever its data (a sort's position, read from its packed
    key: lighthouse/tm_tensor_lowering.py)?"""
    owner = defining_op(value)
    if owner is not None and owner.name == "arith.index_cast":
        owner = defining_op(owner.operands[0])
    if owner is None or owner.name != "arith.minui":
        return False
    for operand in owner.operands:
        constant = defining_op(operand)
        if constant is not None and constant.name == "arith.constant" and \
                isinstance(constant.attributes["value"], ir.IntegerAttr) and \
                0 <= ir.IntegerAttr(constant.attributes["value"]).value <= size - 1:
            return True
    return False


def clamp(extract: ir.Operation) -> int:
    """Clamp the data-dependent indices of `extract` (see the module docstring); returns
    how many were clamped."""
    index = ir.IndexType.get()
    source = extract.operands[0].type
    checked = holds_assert(extract.parent)
    count = 0
    for pos, value in enumerate(list(extract.operands)[1:]):
        size = source.shape[pos]
        if size <= 0 or _loop_index_only(value, extract.parent) or \
                _bounded_by_construction(value, size):
            continue
        with ir.InsertionPoint(extract), extract.location:
            low = arith.ConstantOp(index, ir.IntegerAttr.get(index, 0)).result
            high = arith.ConstantOp(index, ir.IntegerAttr.get(index, size - 1)).result
            if not checked and not _compared_with_constant(value):
                shape = "x".join(map(str, source.shape))
                ok = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, value, low),
                                arith.cmpi(arith.CmpIPredicate.sle, value, high))
                cf.AssertOp(ok, f"index out of range: dimension {pos} of a "
                                f"{shape} tensor has size {size}")
            extract.operands[1 + pos] = arith.minsi(arith.maxsi(value, low), high)
        count += 1
    return count


def _is_gather(op: ir.Operation) -> bool:
    return op.name == "tensor.extract" and _in_linalg_body(op)


def gathers(root: ir.Operation) -> list[ir.Operation]:
    """The tensor.extract ops directly in linalg bodies under `root`, in post-order."""
    found = []

    def visit(op):
        if _is_gather(op):
            found.append(op)
        return ir.WalkResult.ADVANCE

    root.walk(visit)
    return found


class ClampGatherIndicesOp(TransformExt.Operation, name="clamp_gather_indices"):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                for extract in [g for t in payload_ops(state, op.target) for g in gathers(t)]:
                    clamp(extract)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def clamp_gather_indices(target: ir.Value) -> ClampGatherIndicesOp:
    """Clamp the data-dependent indices of the reads in linalg bodies nested in `target`."""
    return ClampGatherIndicesOp(target)


__all__ = ["ClampGatherIndicesOp", "clamp_gather_indices", "gathers", "clamp"]
