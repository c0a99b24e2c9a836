"""unit_dim_transposes_to_reshapes: a linalg.transpose that moves only dims of extent 1
becomes a reshape.

    y = linalg.transpose(x: [8, 64, 1, 96], permutation [0, 1, 3, 2]) : [8, 64, 96, 1]
 -> y = expand_shape(collapse_shape(x) : [8, 64, 96]) : [8, 64, 96, 1]

When the dims of extent other than 1 keep their order, the transpose reads and writes the
elements in the same row-major order: it is a relabelling of the shape, not a copy.
torch's einsum("bijl,lk->bijk") is imported as a batch matmul followed by such a
transpose ([.., 1, k] -> [.., k, 1]); as a copy it ran one scalar memref.copy (a memmove
call) per element after the matmul (16% of KernelBench 11's time). As reshapes, the
canonicalization folds the chain and the matmul writes the result where it belongs.

Each group of the reassociation is one dim of extent other than 1 with the unit dims
before it (the trailing unit dims join the last group; a tensor of unit dims alone
collapses to rank 0). Targets: the linalg.transpose ops on tensors with static shapes nested
in the target ops; any other transpose is left as it is. The targets are only read.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, tensor, transform

from .common import RewritesTargets, Success, payload_ops, reassociation_attr, walk_ops
from .dialect import TransformExt

NAME = "unit_dim_transposes_to_reshapes"


def unit_groups(shape: list[int]) -> list[list[int]]:
    """The reassociation collapsing `shape`'s unit dims into their neighbours (module
    docstring); [] when every dim is 1."""
    groups, pending = [], []
    for d, extent in enumerate(shape):
        pending.append(d)
        if extent != 1:
            groups.append(pending)
            pending = []
    if pending and groups:
        groups[-1].extend(pending)
    return groups


def is_unit_dim_transpose(op: ir.Operation) -> bool:
    """A linalg.transpose on static tensors whose dims of extent other than 1 keep their
    order."""
    if op.name != "linalg.transpose" or len(op.results) != 1:
        return False
    source = op.operands[0].type
    if not isinstance(source, ir.RankedTensorType) or not source.has_static_shape:
        return False
    permutation = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    moved = [p for p in permutation if source.shape[p] != 1]
    return moved == sorted(moved)


def reshape(op: ir.Operation) -> ir.Value:
    """`op`'s result as expand_shape(collapse_shape(input)), built before `op`."""
    source = op.operands[0]
    result_type = op.results[0].type
    shape = list(result_type.shape)
    kept = [e for e in shape if e != 1]
    with ir.InsertionPoint(op), op.location:
        flat_type = ir.RankedTensorType.get(kept, result_type.element_type)
        flat = tensor.CollapseShapeOp(flat_type, source,
                                      reassociation_attr(unit_groups(list(source.type.shape)))).result
        return tensor.ExpandShapeOp(result_type, flat, reassociation_attr(unit_groups(shape)), [],
                                    ir.DenseI64ArrayAttr.get(shape)).result


class UnitDimTransposesToReshapesOp(TransformExt.Operation, name=NAME):
    target: ext.Operand[transform.AnyOpType]

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                found = [t for target in payload_ops(state, op.target)
                         for t in walk_ops(target, is_unit_dim_transpose)]
                for transpose in found:
                    rewriter.replace_op(transpose, [reshape(transpose)])
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def unit_dim_transposes_to_reshapes(target: ir.Value) -> None:
    """Replace every transpose nested in `target` that moves only unit dims by reshapes."""
    UnitDimTransposesToReshapesOp(target)


__all__ = ["UnitDimTransposesToReshapesOp", "is_unit_dim_transpose", "unit_dim_transposes_to_reshapes",
           "unit_groups"]
