"""The cross-entropy schedule as one transform script: the named steps of the fuse stage
(fuse.py), then @fuse calling them in order and, on the CPU, @vectorize (cpu.py) with its
step tile_class_sums."""

from __future__ import annotations

from torch_mlir import ir

from ..generic import GenericParams
from ..script import build_script
from .cpu import tile_class_sums, vectorize_stage
from .fuse import fuse_stage, fuse_steps
from .params import CrossEntropyPlan


def cross_entropy_script(plan: CrossEntropyPlan, vector: GenericParams | None) -> ir.Module:
    """@fuse of `plan` and, with `vector` (the CPU's vector tiles), @vectorize. Needs an
    active context and location."""
    steps = fuse_steps(plan)
    stages = [("fuse", fuse_stage(plan))]
    if vector is not None:
        steps.append(("tile_class_sums", tile_class_sums(plan)))
        stages.append(("vectorize", vectorize_stage(vector)))
    return build_script(stages, steps)
