"""match_loop_accumulators: the contractions of a tiled loop, split into the accumulations
carried by the loop and the tiles it computes afresh each step, with the accumulators'
fills before the loop and their epilogues after it.

    %products, %tiles, %fills, %epilogues = transform_ext.match_loop_accumulators %forall

For each target (an op whose one-block body holds exactly one scf.for directly: a
workgroup's forall), in the body of that loop, in order:
  products   the contractions C_i += A_i B_i whose init is an iter_arg of the loop and whose
             result the loop yields at that place (acc_{k+1} = acc_k + A_k B_k);
  tiles      the other contractions of the loop body (computed from a fresh init each
             step: the logits tile S = h_s W_c^T);
and for each product's iter_arg, outside the loop:
  fills      the linalg.fill that defines the loop's init of it;
  epilogues  the single reader of the loop's result for it when that is an elementwise
             linalg.generic (all loops parallel, identity maps: a cast to the inputs' type),
             none otherwise.
Preconditions (a silenceable failure naming the target otherwise): one scf.for in the
target's body, every product's init a linalg.fill. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import (Illegal, MatchesPayload, Success, block_ops, defining_op, fail,
                     payload_ops, terminator, users)
from .dialect import TransformExt

NAME = "transform_ext.match_loop_accumulators"


def _is_identity_elementwise(op: ir.Operation) -> bool:
    if op.name != "linalg.generic":
        return False
    ls = loop_structure(op)
    identity = ir.AffineMap.get_identity(ls.num_loops)
    return not ls.reduction_dims and all(m == identity for m in ls.maps)


def loop_accumulators(target: ir.Operation) -> tuple[list, list, list, list]:
    """(products, tiles, fills, epilogues) of `target` (module docstring)."""
    if len(target.regions) != 1 or len(target.regions[0].blocks) != 1:
        raise Illegal(target, "has no one-block body")
    loops = [op for op in block_ops(target.regions[0].blocks[0]) if op.name == "scf.for"]
    if len(loops) != 1:
        raise Illegal(target, f"holds {len(loops)} scf.for loops directly, not one")
    (loop,) = loops
    body = loop.regions[0].blocks[0]
    carried = list(body.arguments)[1:]
    yielded = list(terminator(body).operands)
    products, tiles, fills, epilogues = [], [], [], []
    for op in block_ops(body):
        if not is_linalg_op(op) or op.name == "linalg.fill" or \
                not loop_structure(op).is_contraction:
            continue
        init = op.operands[len(op.operands) - 1]
        place = carried.index(init) if init in carried else None
        if place is None or yielded[place] != op.results[0]:
            tiles.append(op)
            continue
        fill = defining_op(loop.operands[3 + place])
        if fill is None or fill.name != "linalg.fill":
            raise Illegal(target, f"the init of the accumulator {place} of its loop is not a "
                                  "linalg.fill")
        products.append(op)
        fills.append(fill)
        readers = users(loop.results[place])
        if len(readers) == 1 and _is_identity_elementwise(readers[0]):
            epilogues.append(readers[0])
    return products, tiles, fills, epilogues


class MatchLoopAccumulatorsOp(TransformExt.Operation, name="match_loop_accumulators"):
    target: ext.Operand[transform.AnyOpType]
    products: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    tiles: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    fills: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    epilogues: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = ([], [], [], [])
                try:
                    for target in payload_ops(state, op.target):
                        for into, ops in zip(found, loop_accumulators(target)):
                            into.extend(ops)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for handle, ops in zip((op.products, op.tiles, op.fills, op.epilogues), found):
                    results.set_ops(handle, ops)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_loop_accumulators(target: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
    """(products, tiles, fills, epilogues) of each target (see the module docstring)."""
    op = MatchLoopAccumulatorsOp(target)
    return op.products, op.tiles, op.fills, op.epilogues


__all__ = ["MatchLoopAccumulatorsOp", "loop_accumulators", "match_loop_accumulators"]
