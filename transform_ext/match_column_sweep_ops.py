"""match_column_sweep_ops: the elementwise tail of a row forall whose row max already runs as
an online loop over column tiles - the ops to recompute per column tile in a second loop.

Under each target, the first scf.forall (in pre-order, not nested in another) whose body
holds directly an scf.for with a linalg max reduction directly in its body (the online loop
of fuse_dependent_reduction_ops) and, after that loop, a last linalg op that is not a
linalg.fill. Matched: `root`, that last linalg op (it writes the forall's result), and
`chain`, the elementwise linalg ops (not linalg.fill) of the body before it, latest first:
the order in which FuseIntoContainingOp fuses them into the root's loop. A target without
such a forall is a silenceable failure naming it. Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, MatchesPayload, Success, block_ops, fail, payload_ops
from .dialect import TransformExt
from .match_row_max_reductions import has_row_max

NAME = "transform_ext.match_column_sweep_ops"


def _tail(forall: ir.Operation) -> list[ir.Operation] | None:
    """The linalg ops of the body when the last one follows an online row-max loop and is
    not a fill, else None."""
    body = block_ops(forall)
    ops = [o for o in body if is_linalg_op(o)]
    loops = [i for i, o in enumerate(body) if o.name == "scf.for" and has_row_max(o)]
    if not ops or not loops or ops[-1].name == "linalg.fill" or body.index(ops[-1]) < loops[0]:
        return None
    return ops


def column_sweep_ops(root: ir.Operation) -> tuple[ir.Operation, list[ir.Operation]] | None:
    """(root, chain) of the first such forall under `root` (module docstring), or None."""
    found = []

    def visit(op):
        if found:
            return ir.WalkResult.INTERRUPT
        if op.name == "scf.forall":
            ops = _tail(op)
            if ops is not None:
                chain = [o for o in reversed(ops[:-1]) if o.name != "linalg.fill"
                         and loop_structure(o).is_elementwise]
                found.append((ops[-1], chain))
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    getattr(root, "operation", root).walk(visit, ir.WalkOrder.PRE_ORDER)
    return found[0] if found else None


class MatchColumnSweepOpsOp(TransformExt.Operation, name="match_column_sweep_ops"):
    target: ext.Operand[transform.AnyOpType]
    root: ext.Result[transform.AnyOpType[()]] = ext.infer_result()
    chain: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = []
                try:
                    for target in payload_ops(state, op.target):
                        sweep = column_sweep_ops(target)
                        if sweep is None:
                            raise Illegal(target, "no scf.forall with an online row-max loop "
                                                  "followed by its elementwise tail")
                        found.append(sweep)
                except Illegal as illegal:
                    return fail(NAME, illegal)
                results.set_ops(op.root, [root for root, _ in found])
                results.set_ops(op.chain, [o for _, chain in found for o in chain])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_column_sweep_ops(target: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(root, its elementwise chain latest first) of the first swept-to-be row forall under
    each op of `target` (see the module docstring)."""
    op = MatchColumnSweepOpsOp(target)
    return op.root, op.chain


__all__ = ["MatchColumnSweepOpsOp", "column_sweep_ops", "match_column_sweep_ops"]
