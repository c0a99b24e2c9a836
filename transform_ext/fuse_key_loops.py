"""fuse_key_loops: in each query block, the softmax and P V fused into one loop over key tiles.

For every top-level scf.forall (a query block) in the target functions, with the block's
linalg ops

    S = Q K^T [masked],  m = max_j S,  l = sum_j exp(S - m),  O = exp(S - m) V

fuse_dependent_reduction_ops (see its docstring for the online-softmax algebra) turns m
(the block's one max reduction) and its consumers (the add reductions and contractions that
depend on m: l and E V) into one scf.for over key tiles of min(key_tile, S_kv) keys, with S
and the ops computing a mask from loop indices alone along the keys (a causal mask)
computed per tile. No [queries, S_kv] tensor remains.

Preconditions (checked on every query block before anything changes; a violation is a
silenceable failure naming the op): each block holds exactly one max reduction over one dim,
reading one contraction through elementwise ops, and fuse_dependent_reduction_ops accepts
the plan. The target handle stays valid.
"""

from torch_mlir import ir
from torch_mlir.dialects import ext, transform

from .analysis.attention import (depends_on, is_index_computation, producing_contraction,
                                 propagate_loop_dim)
from .analysis.classify import reduction_combiner
from .analysis.structure import is_linalg_op, loop_structure
from .common import Illegal, RewritesTargets, Success, block_ops, fail, payload_ops
from .dialect import TransformExt
from .fuse_dependent_reduction_ops import analyze, rewrite
from .pack_key_tiles import top_level_foralls

NAME = "transform_ext.fuse_key_loops"


def plan(forall: ir.Operation, key_tile: int):
    """fuse_dependent_reduction_ops' plan for one query block (raises Illegal)."""
    ops = [op for op in block_ops(forall) if is_linalg_op(op)]
    maxes = [op for op in ops if reduction_combiner(op) == "max"]
    if len(maxes) != 1:
        raise Illegal(forall, f"the query block holds {len(maxes)} row maxima, not one")
    row_max = maxes[0]
    if len(loop_structure(row_max).reduction_dims) != 1:
        raise Illegal(row_max, "the row max must reduce one dim (the keys)")
    m = row_max.results[0]
    scores = producing_contraction(row_max.operands[0])
    if scores is None:
        raise Illegal(row_max, "the row max does not read one contraction (S = Q K^T)")
    consumers = [op for op in ops if op is not row_max and depends_on(op, m) and (
        reduction_combiner(op) == "add" or loop_structure(op).is_contraction)]
    key_dim = loop_structure(row_max).reduction_dims[0]
    along_keys = propagate_loop_dim(row_max, key_dim)
    # S, and the ops computing a mask from indices (the causal mask): per key tile
    producers = [scores] + [op for op in ops if op in along_keys and op is not scores
                            and op is not row_max and is_index_computation(op)]
    tile = min(key_tile, loop_structure(row_max).ranges[key_dim])
    return analyze(row_max, consumers, producers, tile, True)


class FuseKeyLoopsOp(TransformExt.Operation, name="fuse_key_loops"):
    target: ext.Operand[transform.AnyOpType]
    key_tile: ir.IntegerAttr

    class Apply(transform.TransformOpInterface):
        @staticmethod
        def apply(op, rewriter, results, state):
            with op.context:
                key_tile = ir.IntegerAttr(op.key_tile).value
                targets = payload_ops(state, op.target)
                try:
                    for target in targets:
                        if target.name != "func.func":
                            raise Illegal(target, "not a function")
                    plans = [plan(forall, key_tile) for target in targets
                             for forall in top_level_foralls(target)]
                except Illegal as illegal:
                    return fail(NAME, illegal)
                for fusion in plans:
                    rewrite(fusion, rewriter)
                return Success

        @staticmethod
        def allow_repeated_handle_operands(op):
            return False

    Effects = RewritesTargets


def fuse_key_loops(func: ir.Value, key_tile: int) -> None:
    """Fuse each query block's softmax and P V into a loop over key tiles of `key_tile`
    (see the module docstring)."""
    if key_tile < 1:
        raise ValueError(f"key_tile must be >= 1, got {key_tile}")
    FuseKeyLoopsOp(func, ir.IntegerAttr.get(ir.IntegerType.get_signless(64), key_tile))


__all__ = ["FuseKeyLoopsOp", "fuse_key_loops"]
