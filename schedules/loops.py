"""The loops schedule: no tiling, no vectorization; linalg goes straight to scalar loops in
bufferization. A baseline for debugging the other schedules (`--schedule loops`)."""

from __future__ import annotations

from torch_mlir import ir

from .script import build_script


def _nothing(root: ir.Value) -> None:
    """An empty stage: the payload passes unchanged."""


def loops_script(payload: ir.Module, target) -> ir.Module:
    """Empty `fuse` and `vectorize` sequences."""
    return build_script([("fuse", _nothing), ("vectorize", _nothing)])
