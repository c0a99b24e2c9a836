"""match_attention_kernel_ops: the loads, DPAS ops and store of an outlined attention kernel.

For each target (a gpu.func of flash attention after convert-vector-to-xegpu), every
scf.for in it is a key loop whose body holds exactly two xegpu.dpas: the first S = Q K^T,
the second O += P V. Matched, each op once, in the order of the key loops:
`q_loads`, `k_loads`, `v_loads`: the xegpu.load_nd that operand 0 (Q) and 1 (K^T) of the
first DPAS and operand 1 (V) of the second are read from, through vector.transpose,
arith.extf and arith.truncf; `qk_dpas`, `pv_dpas`: the two DPAS ops of each loop;
`stores`: the kernel's one xegpu.store_nd (O). These are the anchors of the attention
layouts. A target without a key loop, with a key loop not holding two DPAS ops, with a DPAS
operand not read by a 2-D block load, or with other than one store is a silenceable
failure naming it and the reason. Read-only.
"""

from dataclasses import dataclass, field

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .common import (Illegal, MatchesPayload, Success, block_ops, defining_op, fail, ops_named,
                     payload_ops)
from .dialect import TransformExt

NAME = "transform_ext.match_attention_kernel_ops"


@dataclass
class AttentionKernelOps:
    """The anchors of one attention kernel, each op once, in key-loop order."""

    q_loads: list[ir.Operation] = field(default_factory=list)
    k_loads: list[ir.Operation] = field(default_factory=list)
    v_loads: list[ir.Operation] = field(default_factory=list)
    qk_dpas: list[ir.Operation] = field(default_factory=list)
    pv_dpas: list[ir.Operation] = field(default_factory=list)
    stores: list[ir.Operation] = field(default_factory=list)

    def groups(self) -> tuple[list[ir.Operation], ...]:
        return (self.q_loads, self.k_loads, self.v_loads, self.qk_dpas, self.pv_dpas, self.stores)


def load_of(value: ir.Value) -> ir.Operation | None:
    """The xegpu.load_nd `value` comes from (through transposes and type conversions)."""
    while True:
        owner = defining_op(value)
        if owner is None:
            return None
        if owner.name == "xegpu.load_nd":
            return owner
        if owner.name in ("vector.transpose", "arith.extf", "arith.truncf"):
            value = owner.operands[0]
            continue
        return None


def attention_kernel_ops(kernel: ir.Operation) -> AttentionKernelOps:
    """The anchors of the attention kernel `kernel` (see the module docstring); Illegal
    naming the kernel otherwise."""
    found = AttentionKernelOps()
    loops = ops_named(kernel, "scf.for")
    for loop in loops:
        dpas = [op for op in block_ops(loop) if op.name == "xegpu.dpas"]
        if len(dpas) != 2:
            raise Illegal(kernel, f"a key loop holds {len(dpas)} xegpu.dpas ops, expected 2")
        qk, pv = dpas
        loads = (load_of(qk.operands[0]), load_of(qk.operands[1]), load_of(pv.operands[1]))
        if any(load is None for load in loads):
            raise Illegal(kernel, "an attention DPAS operand is not read by a 2-D block load")
        for ops, load in zip((found.q_loads, found.k_loads, found.v_loads), loads):
            if load not in ops:
                ops.append(load)
        found.qk_dpas.append(qk)
        found.pv_dpas.append(pv)
    found.stores = ops_named(kernel, "xegpu.store_nd")
    if not loops or len(found.stores) != 1:
        raise Illegal(kernel, f"an attention kernel with {len(loops)} key loops and "
                              f"{len(found.stores)} stores")
    return found


class MatchAttentionKernelOpsOp(TransformExt.Operation, name="match_attention_kernel_ops"):
    target: ext.Operand[transform.AnyOpType]
    q_loads: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    k_loads: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    v_loads: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    qk_dpas: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    pv_dpas: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    stores: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = []
                try:
                    for target in payload_ops(state, op.target):
                        found.append(attention_kernel_ops(target))
                except Illegal as illegal:
                    return fail(NAME, illegal)
                handles = (op.q_loads, op.k_loads, op.v_loads, op.qk_dpas, op.pv_dpas, op.stores)
                for i, handle in enumerate(handles):
                    results.set_ops(handle, [o for ops in found for o in ops.groups()[i]])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_attention_kernel_ops(kernel: ir.Value) -> tuple[ir.Value, ...]:
    """Handles (q_loads, k_loads, v_loads, qk_dpas, pv_dpas, stores) to the layout anchors of
    each attention kernel of `kernel` (see the module docstring)."""
    op = MatchAttentionKernelOpsOp(kernel)
    return op.q_loads, op.k_loads, op.v_loads, op.qk_dpas, op.pv_dpas, op.stores


__all__ = ["AttentionKernelOps", "MatchAttentionKernelOpsOp", "attention_kernel_ops",
           "match_attention_kernel_ops"]
