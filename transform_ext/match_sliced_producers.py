"""match_sliced_producers: the producers a loop reads tile by tile, to fuse into it.

For each target (an scf.forall or scf.for), matched: the linalg ops of the block holding the
target (the entry block of its parent's first region) other than the target, with a result
read by a tensor.extract_slice nested in the target, in block order, once each. These are
the producers that FuseIntoContainingOp can tile into the target at the slices it reads.
The result may be empty (matching never fails). Read-only.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.structure import is_linalg_op
from .common import MatchesPayload, Success, block_ops, is_nested_in, payload_ops, result_users
from .dialect import TransformExt


def sliced_producers(container: ir.Operation) -> list[ir.Operation]:
    """The producers `container` reads through slices (see the module docstring)."""
    found = []
    for op in block_ops(container.parent):
        if not is_linalg_op(op) or op == container:
            continue
        readers = result_users(op)
        if any(u.name == "tensor.extract_slice" and is_nested_in(u, container) for u in readers):
            found.append(op)
    return found


class MatchSlicedProducersOp(TransformExt.Operation, name="match_sliced_producers"):
    target: ext.Operand[transform.AnyOpType]
    producers: ext.Result[transform.AnyOpType[()]] = ext.infer_result()

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = []
                for target in payload_ops(state, op.target):
                    for producer in sliced_producers(target):
                        if producer not in found:
                            found.append(producer)
                results.set_ops(op.producers, found)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = MatchesPayload


def match_sliced_producers(container: ir.Value) -> ir.Value:
    """The producers each op of `container` reads through slices (see the module docstring)."""
    return MatchSlicedProducersOp(container).producers


__all__ = ["MatchSlicedProducersOp", "match_sliced_producers", "sliced_producers"]
