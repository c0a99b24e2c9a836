"""The linear cross-entropy schedule as one transform script: the named steps of the fuse
stage (fuse.py), then @fuse calling them in order and, on the CPU, @vectorize (cpu.py)."""

from __future__ import annotations

from torch_mlir import ir

from ..generic import GenericParams
from ..script import build_script
from .cpu import vectorize_stage
from .fuse import fuse_stage, fuse_steps
from .params import LinearCrossEntropyPlan


def linear_cross_entropy_script(plan: LinearCrossEntropyPlan,
                                vector: GenericParams | None) -> ir.Module:
    """@fuse of `plan` and, with `vector` (the CPU's vector tiles), @vectorize. Needs an
    active context and location."""
    stages = [("fuse", fuse_stage(plan))]
    if vector is not None:
        stages.append(("vectorize", vectorize_stage(vector, amx=plan.amx_products)))
    return build_script(stages, fuse_steps(plan))
