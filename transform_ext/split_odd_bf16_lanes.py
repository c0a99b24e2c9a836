"""split_odd_bf16_lanes: a bf16 vector tile of an odd lane count becomes an even one and one
lane.

LLVM's x86 backend cannot compile bf16 vectors of an odd lane count > 1 (it aborts). A
static linalg op (not a contraction) touching bf16 whose lane dim L (`lane_dim`,
transform_ext.analysis.tiles) has an odd extent E > 1 is tiled along L by E - 1
(`tile_using_for`) and the loop's last, partial iteration, the single lane E - 1, is peeled
(`transform.loop.peel`) into a tile of its own:
    op[..., 0:E]  ==  op[..., 0:E-1] ; op[..., E-1:E]
The function is canonicalized afterwards (the one-iteration loops fold away). Every element
is computed as before.

Targets: func.func ops (the handle is consumed and returned, see common.RewritesNestedOps). Any other target op is a silenceable
failure, nothing rewritten.
"""


from torch_mlir import ir
from torch_mlir.dialects import ext, transform
from torch_mlir.dialects.transform import loop, structured

from .analysis.structure import all_linalg_ops, loop_structure
from .analysis.tiles import lane_dim, touches_bf16
from .common import Illegal, RewritesNestedOps, Success, fail, payload_ops
from .dialect import TransformExt
from .nested import any_op, apply_to, canonicalize

NAME = "transform_ext.split_odd_bf16_lanes"


def odd_lane_split(op: ir.Operation) -> list[int] | None:
    """Tile sizes splitting an odd bf16 lane dim into E - 1 lanes and one, or None."""
    ls = loop_structure(op)
    if ls.is_contraction or not ls.is_static or ls.num_loops == 0 or not touches_bf16(op):
        return None
    lane = lane_dim(ls)
    if ls.ranges[lane] > 1 and ls.ranges[lane] % 2:
        return [ls.ranges[lane] - 1 if d == lane else 0 for d in range(ls.num_loops)]
    return None


def _split(handle: ir.Value, sizes: list[int]) -> None:
    tiled = structured.TileUsingForOp(handle, sizes=sizes)
    loop.LoopPeelOp(any_op(), any_op(), tiled.loops[0])


class SplitOddBf16LanesOp(TransformExt.Operation, name="split_odd_bf16_lanes"):
    target: ext.Operand[transform.AnyOpType]
    transformed: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a func.func")
                except Illegal as illegal:
                    return fail(NAME, illegal)
                plan = [(o, sizes) for func in targets for o in all_linalg_ops(func)
                        if (sizes := odd_lane_split(o)) is not None]
                if not plan:
                    results.set_ops(op.transformed, targets)
                    return Success
                for payload_op, sizes in plan:
                    apply_to(payload_op, lambda h, sizes=sizes: _split(h, sizes))
                for func in targets:
                    apply_to(func, canonicalize)
                results.set_ops(op.transformed, targets)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesNestedOps


def split_odd_bf16_lanes(func: ir.Value) -> ir.Value:
    """Split the odd bf16 lane dims of the linalg ops in the functions of `func`."""
    return SplitOddBf16LanesOp(func).transformed


__all__ = ["SplitOddBf16LanesOp", "split_odd_bf16_lanes", "odd_lane_split"]
