"""Payload preparation shared by the schedules: rewrites done directly on the payload IR.

clamp_gather_indices: a `tensor.extract` in a linalg body at an index computed from data
(a target, which may be ignore_index = -100) reads T[clamp(i, 0, n - 1)]: torch-mlir's
imports read such elements before selecting them away (the one-hot of nll_loss_backward
reads w[y] for every y), so an unclamped read is out of bounds. Exact wherever the index
is in bounds. Out of bounds, torch raises: a read the body already checks (cf.assert, as
torch-mlir emits for embedding and gather) or guards (the index compared for equality with
a constant, the ignore_index of nll_loss) keeps its checks; every other one (x[i],
index_select) gets `cf.assert 0 <= i < n`, so the kernel reports the bad index
(checks_to_error_code) instead of returning a clamped read.

split_assertions: torch-mlir guards index reads (e.g. the cross-entropy target gather) with
`cf.assert` inside linalg.generic bodies, which blocks vectorization of the whole op. Each
such generic is split in two: a result-less generic over the same inputs and iteration
space that only evaluates the assertions (a cheap scalar loop), and the original without
them. The checks still run; the op that does the work vectorizes.

checks_to_error_code: the kernel-reported error. Those result-less checks become one more
function result, the error code (a rank-0 i32 tensor, always the last result): 0 when every
assertion holds, else k for the failing message `lh.kernel_errors[k - 1]` (a module
attribute listing the messages; the largest k when several fail). Nothing aborts: the
caller reads the code after the call (lighthouse.runtime.JitFunction raises the message as
a KernelError) and discards the results, which were computed with clamped indices
(clamp_gather_indices), so no access left the tensors.
"""

from __future__ import annotations

from torch_mlir import ir
from torch_mlir.dialects import linalg

from transform_ext.compute_elementwise_in_f32 import is_narrow, widen_body
from transform_ext.match_assertion_checks import holds_assert


def cleanup(payload: ir.Module) -> None:
    """The `cleanup` stage (canonicalize, simplify_imported_ops, clamp_gather_indices,
    widen_bool_tensors, promote_reductions_to_f32); the families' checks run it on their
    trial copy, so they judge the IR their schedule will see."""
    from .common import run_passes

    run_passes(payload, "canonicalize, cse")
    simplify_imported_ops(payload)
    run_passes(payload, "canonicalize, cse")
    clamp_gather_indices(payload)
    widen_bool_tensors(payload)
    promote_reductions_to_f32(payload)
    run_passes(payload, "canonicalize, cse")


def clamp_gather_indices(payload: ir.Module) -> int:
    """Clamp every data-dependent index of a tensor.extract inside a linalg body into its
    dim (see the module docstring); returns the number of indices clamped."""
    from torch_mlir.dialects import arith, cf

    found = []

    def visit(op):
        if op.name == "tensor.extract" and _in_linalg_body(op):
            found.append(op)
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit)
    count = 0
    with payload.context:
        index = ir.IndexType.get()
        for extract in found:
            source = extract.operands[0].type
            checked = holds_assert(extract.parent)
            for pos, value in enumerate(list(extract.operands)[1:]):
                size = source.shape[pos]
                if size <= 0 or _loop_index_only(value, extract.parent):
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


def _compared_with_constant(value: ir.Value) -> bool:
    """Is `value` (or the integer it was cast from) compared for (in)equality with a constant
    in its body: a guarded read such as nll_loss's target != ignore_index?"""
    candidates = [value]
    owner = value.owner
    if isinstance(owner, ir.OpView) and owner.operation.name == "arith.index_cast":
        candidates.append(owner.operation.operands[0])
    for candidate in candidates:
        for use in candidate.uses:
            user = use.owner
            if user.name != "arith.cmpi" or ir.IntegerAttr(user.attributes["predicate"]).value > 1:
                continue
            other = user.operands[1 - use.operand_number]
            if isinstance(other.owner, ir.OpView) and other.owner.operation.name == "arith.constant":
                return True
    return False


def _in_linalg_body(op: ir.Operation) -> bool:
    parent = op.parent
    return parent is not None and parent.name.startswith("linalg.")


def _loop_index_only(value: ir.Value, body_owner: ir.Operation) -> bool:
    """Is `value` computed from loop indices (linalg.index) and constants only?"""
    pending, seen = [value], []
    while pending:
        v = pending.pop()
        if v in seen:
            continue
        seen.append(v)
        if isinstance(v, ir.BlockArgument):
            return False
        op = v.owner.operation if isinstance(v.owner, ir.OpView) else v.owner
        if op.name in ("linalg.index", "arith.constant"):
            continue
        if op.parent != body_owner or not op.name.startswith("arith.") or op.regions:
            return False
        pending.extend(op.operands)
    return True


def kernel_error_messages(payload: ir.Module) -> list[str]:
    """The messages of the kernel-reported error codes (see checks_to_error_code), [] when
    the kernel reports none."""
    from transform_ext.checks_to_error_code import kernel_error_messages as messages

    return messages(payload.operation)


def checks_to_error_code(payload: ir.Module) -> None:
    """Replace the assertions of the generics at the top level of the functions (split out
    of result-producing ones first) by the error code result (see the module docstring):
    the `transform_ext.checks_to_error_code` op applied to the module."""
    import transform_ext
    from transform_ext.checks_to_error_code import checks_to_error_code as to_error_code

    from .common import run_schedule

    transform_ext.load(payload.context)
    run_schedule(payload, to_error_code)


def split_assertions(payload: ir.Module) -> None:
    """Split every result-producing linalg.generic holding cf.assert (the
    `transform_ext.split_assertions` op applied to the module)."""
    import transform_ext
    from transform_ext.split_assertions import split_assertions as split_op

    from .common import run_schedule

    transform_ext.load(payload.context)
    run_schedule(payload, split_op)


def widen_bool_tensors(payload: ir.Module) -> None:
    """Store boolean tensors as i8 (0/1): the linalg ops on i1 tensors generalized
    (structured.generalize of filter_by_element_type), then `transform_ext.widen_bool_tensors`
    applied to the functions."""
    import transform_ext
    from transform_ext.filter_by_element_type import filter_by_element_type
    from transform_ext.widen_bool_tensors import widen_bool_tensors as widen
    from torch_mlir.dialects.transform import structured

    from .common import any_op, match, run_schedule

    def body(root):
        funcs = match(root, "func.func")
        linalg_ops = structured.MatchOp(any_op(), funcs,
                                        interface=structured.MatchInterfaceEnum.LinalgOp).result
        structured.GeneralizeOp(filter_by_element_type(linalg_ops, ir.IntegerType.get_signless(1)))
        widen(funcs)

    transform_ext.load(payload.context)
    run_schedule(payload, body)


def promote_reductions_to_f32(payload: ir.Module) -> int:
    """Reductions (sums, contractions, max...) over bf16/f16 accumulate in f32 and round
    once at the end, as torch's CPU kernels do; returns the number of rewritten ops.

    The reduction's body is recomputed in f32 (narrow block arguments extended, narrow
    constants widened, extf/truncf between the two folded away), its init extended to f32,
    and its result truncated back by an elementwise generic."""
    found = []

    def visit(op):
        if op.name == "linalg.generic" and len(op.results):
            view = op.opview
            kinds = [str(a) for a in view.iterator_types]
            if any("reduction" in k for k in kinds) and any(
                    is_narrow(r.type.element_type) for r in op.results):
                found.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    _generalize_narrow_reductions(payload)
    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    with payload.context:
        for op in found:
            _promote(op)
    return len(found)


def _generalize_narrow_reductions(payload: ir.Module) -> None:
    """Named reductions/contractions (batch_matmul, ...) with narrow results become generics."""
    from transform_ext.analysis.structure import loop_structure

    def narrow_reduction(op) -> bool:
        try:
            ls = loop_structure(op)
        except Exception:
            return False
        return bool(ls.reduction_dims) and any(
            is_narrow(r.type.element_type) for r in op.results)

    named = []

    def visit(op):
        if op.name.startswith("linalg.") and op.name not in ("linalg.generic", "linalg.yield",
                                                            "linalg.index") and len(op.results):
            if narrow_reduction(op):
                named.append(op)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    payload.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    if not named:
        return
    from torch_mlir.dialects.transform import structured

    from .common import clear_tags, match_id, run_schedule, tag_ops

    tag_ops(named)
    run_schedule(payload, lambda root: [structured.GeneralizeOp(match_id(root, i))
                                        for i in range(len(named))])
    clear_tags(payload)


def _promote(op: ir.Operation) -> None:
    from torch_mlir.dialects import arith

    f32 = ir.F32Type.get()
    n_in = len(op.opview.inputs)
    widen_body(op, round_results=False)
    # outputs: f32 init, f32 result, truncated back after the op
    for k in range(len(op.results)):
        r = op.results[k]
        if not is_narrow(r.type.element_type):
            continue
        narrow_t = r.type
        wide_t = ir.RankedTensorType.get(list(narrow_t.shape), f32, narrow_t.encoding)
        init_index = n_in + k
        with ir.InsertionPoint(op), op.location:
            init = op.operands[init_index]
            op.operands[init_index] = _map_tensor(init, wide_t, lambda a: arith.extf(f32, a))
        r.set_type(wide_t)
        with ir.InsertionPoint.after(op), op.location:
            back = _map_tensor(r, narrow_t, lambda a: arith.truncf(narrow_t.element_type, a))
        r.replace_all_uses_except(back, back.owner.operation)


def _map_tensor(value: ir.Value, out_type, fn) -> ir.Value:
    """An elementwise generic applying `fn` to every element of `value`."""
    from torch_mlir.dialects import linalg, tensor

    rank = out_type.rank
    identity = ir.AffineMapAttr.get(ir.AffineMap.get_identity(rank))
    empty = tensor.EmptyOp(list(out_type.shape), out_type.element_type).result
    iters = ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * rank)
    g = linalg.GenericOp([out_type], [value], [empty], ir.ArrayAttr.get([identity, identity]), iters)
    block = g.regions[0].blocks.append(value.type.element_type, out_type.element_type)
    with ir.InsertionPoint(block):
        linalg.YieldOp([fn(block.arguments[0])])
    return g.result


def simplify_imported_ops(payload: ir.Module) -> None:
    """linalg ops whose iteration space is empty become their inits
    (transform_ext.fold_empty_iteration_spaces: zero-size tensors leave no work behind);
    integer powers become multiplications (transform_ext.expand_integer_powers); f16/bf16
    elementwise ops compute in f32 and round once, as torch's eager ops
    (transform_ext.compute_elementwise_in_f32)."""
    import transform_ext
    from transform_ext.compute_elementwise_in_f32 import compute_elementwise_in_f32
    from transform_ext.expand_integer_powers import expand_integer_powers
    from transform_ext.fold_empty_iteration_spaces import fold_empty_iteration_spaces

    from .common import match, run_schedule

    def body(root):
        funcs = fold_empty_iteration_spaces(match(root, "func.func"))
        expand_integer_powers(funcs)
        compute_elementwise_in_f32(funcs)

    transform_ext.load(payload.context)
    run_schedule(payload, body)
