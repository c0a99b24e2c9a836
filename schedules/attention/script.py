"""The attention schedule as one transform script: the named steps of the fuse stage
(normalize, tile_query_blocks, online_softmax, causal_bounds and, on the CPU,
tile_other_ops: fuse.py), then @fuse calling them in order and, on the CPU, @vectorize
(cpu.py)."""

from __future__ import annotations

from torch_mlir import ir

from ..generic import GenericParams
from ..script import build_script
from .cpu import UNROLL, vectorize_stage
from .fuse import AttentionPlan, fuse_stage, fuse_steps


def attention_script(plan: AttentionPlan, vector: GenericParams | None,
                     unroll: int = UNROLL) -> ir.Module:
    """@fuse of `plan` and, with `vector` (the CPU's vector tiles), @vectorize. Needs an
    active context and location."""
    stages = [("fuse", fuse_stage(plan, vector))]
    if vector is not None:
        stages.append(("vectorize", vectorize_stage(vector, unroll)))
    return build_script(stages, fuse_steps(plan, vector))
