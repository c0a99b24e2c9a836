"""Payload preparation shared by the schedules: transform_ext ops applied to the payload.

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

Each is a transform_ext op (of the same name) applied by a transform sequence; this module
only builds those sequences. `check_by_planning` is the families' check: their planning
on a copy after cleanup.
"""

from __future__ import annotations

from typing import Callable

from torch_mlir import ir
from torch_mlir.dialects.transform import structured

import transform_ext
from transform_ext.checks_to_error_code import checks_to_error_code as checks_to_error_code_op
from transform_ext.checks_to_error_code import kernel_error_messages as module_error_messages
from transform_ext.clamp_gather_indices import clamp_gather_indices as clamp_gather_indices_op
from transform_ext.common import failure_reason
from transform_ext.compute_elementwise_in_f32 import compute_elementwise_in_f32
from transform_ext.exclude_ops import exclude_ops
from transform_ext.expand_integer_powers import expand_integer_powers
from transform_ext.filter_by_element_type import filter_by_element_type
from transform_ext.filter_ops import filter_ops
from transform_ext.fold_empty_iteration_spaces import fold_empty_iteration_spaces
from transform_ext.match_narrow_reductions import match_narrow_reductions, narrow_reductions
from transform_ext.promote_reductions_to_f32 import NAMED_POOLINGS
from transform_ext.promote_reductions_to_f32 import promote_reductions_to_f32 as promote_op
from transform_ext.split_assertions import split_assertions as split_assertions_op
from transform_ext.trim_unread_pooling_tails import trim_unread_pooling_tails
from transform_ext.unit_dim_transposes_to_reshapes import unit_dim_transposes_to_reshapes
from transform_ext.widen_bool_tensors import widen_bool_tensors as widen_bool_tensors_op

from .common import any_op, match, run_passes, run_schedule


def cleanup(payload: ir.Module) -> None:
    """The `cleanup` stage (canonicalize, simplify_imported_ops, clamp_gather_indices,
    widen_bool_tensors, promote_reductions_to_f32); the families' checks run it on their
    trial copy, so they judge the IR their schedule will see."""
    run_passes(payload, "canonicalize, cse")
    simplify_imported_ops(payload)
    run_passes(payload, "canonicalize, cse")
    clamp_gather_indices(payload)
    widen_bool_tensors(payload)
    promote_reductions_to_f32(payload)
    run_passes(payload, "canonicalize, cse")


def _apply(payload: ir.Module, body) -> None:
    """run_schedule with the transform_ext dialect loaded in the payload's context."""
    transform_ext.load(payload.context)
    run_schedule(payload, body)


def clamp_gather_indices(payload: ir.Module) -> None:
    """Clamp every data-dependent index of a tensor.extract inside a linalg body into its
    dim (see the module docstring)."""
    _apply(payload, clamp_gather_indices_op)


def kernel_error_messages(payload: ir.Module) -> list[str]:
    """The messages of the kernel-reported error codes (see checks_to_error_code), [] when
    the kernel reports none."""
    return module_error_messages(payload.operation)


def checks_to_error_code(payload: ir.Module) -> None:
    """Replace the assertions of the generics at the top level of the functions (split out
    of result-producing ones first) by the error code result (see the module docstring)."""
    _apply(payload, checks_to_error_code_op)


def split_assertions(payload: ir.Module) -> None:
    """Split every result-producing linalg.generic holding cf.assert."""
    _apply(payload, split_assertions_op)


def widen_bool_tensors(payload: ir.Module) -> None:
    """Store boolean tensors as i8 (0/1): the linalg ops on i1 tensors generalized (their
    bodies are implicit), then the functions' i1 tensors widened."""

    def body(root):
        funcs = match(root, "func.func")
        linalg_ops = structured.MatchOp(any_op(), funcs,
                                        interface=structured.MatchInterfaceEnum.LinalgOp).result
        structured.GeneralizeOp(filter_by_element_type(linalg_ops, ir.IntegerType.get_signless(1)))
        widen_bool_tensors_op(funcs)

    _apply(payload, body)


def promote_reductions_to_f32(payload: ir.Module) -> int:
    """Reductions (sums, contractions, max...) over bf16/f16 accumulate in f32 and round
    once at the end, as torch's CPU kernels do (named ones generalized first, but for the
    poolings, which stay named poolings with an f32 result); returns the number of
    rewritten ops."""
    count = len(narrow_reductions(payload.operation))

    def body(root):
        narrow = match_narrow_reductions(root)
        poolings = filter_ops(narrow, names=NAMED_POOLINGS)
        promote_op(poolings)
        promote_op(structured.GeneralizeOp(exclude_ops(narrow, poolings)).transformed)

    _apply(payload, body)
    return count


def simplify_imported_ops(payload: ir.Module) -> None:
    """linalg ops whose iteration space is empty become their inits
    (transform_ext.fold_empty_iteration_spaces: zero-size tensors leave no work behind);
    transposes that move only unit dims become reshapes (transform_ext.
    unit_dim_transposes_to_reshapes: no copy); a pooling's unread tail along a dim of one
    window is sliced off (transform_ext.trim_unread_pooling_tails: its generic form then
    verifies once the unit dim is folded); integer powers become multiplications (transform_ext.expand_integer_powers); f16/bf16
    elementwise ops compute in f32 and round once, as torch's eager ops
    (transform_ext.compute_elementwise_in_f32)."""

    def body(root):
        funcs = fold_empty_iteration_spaces(match(root, "func.func"))
        unit_dim_transposes_to_reshapes(funcs)
        trim_unread_pooling_tails(funcs)
        expand_integer_powers(funcs)
        compute_elementwise_in_f32(funcs)

    _apply(payload, body)


def check_by_planning(payload: ir.Module, plan: Callable[[ir.Module], object],
                      not_this: type[Exception]) -> str | None:
    """A family's check: None when `plan` (the family's planning, on a copy of `payload`
    after cleanup: the family is chosen on the import, judged on what its fuse will see)
    succeeds, else the one-line reason: a `not_this` error's message (not the family's
    kind of payload) or the first diagnostic of a transform that refused the payload (the
    interpreter's ValueError). Any other error propagates (a bug, not a reason)."""
    trial = ir.Module.parse(str(payload), payload.context)
    try:
        with payload.context, ir.Location.unknown():
            cleanup(trial)
            plan(trial)
    except not_this as exc:
        return str(exc)
    except ValueError as exc:
        return (failure_reason(str(exc)) or type(exc).__name__)[:240]
    return None
