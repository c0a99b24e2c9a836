"""Indexing maps whose results are plain loop dims or constants ("simple" maps).

A simple map is handled as a list of terms, one per result: an int (the loop dim it reads)
or a `Const` (a fixed index, e.g. the 0 of a broadcast unit dim). Composite expressions
(d0 + d1, d0 * 2, floordiv, symbols) are not simple; the ops that rewrite maps reject them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir


@dataclass(frozen=True)
class Const:
    value: int


def affine_map(m) -> ir.AffineMap:
    return m.value if isinstance(m, ir.AffineMapAttr) else m


def terms(m) -> list | None:
    """The terms of a simple map, or None when a result is a composite expression."""
    m = affine_map(m)
    if m.n_symbols:
        return None
    out = []
    for expr in m.results:
        if isinstance(expr, ir.AffineDimExpr):
            out.append(expr.position)
        elif isinstance(expr, ir.AffineConstantExpr):
            out.append(Const(expr.value))
        else:
            return None
    return out


def make_map(n_dims: int, ts: list) -> ir.AffineMap:
    exprs = [ir.AffineConstantExpr.get(t.value) if isinstance(t, Const) else ir.AffineDimExpr.get(t)
             for t in ts]
    return ir.AffineMap.get(n_dims, 0, exprs)


def dims_of(ts: list) -> list[int]:
    return [t for t in ts if not isinstance(t, Const)]


def loop_images(view_in_a: list, view_in_b: list) -> dict[int, object] | None:
    """Op A reads/writes a value V through terms `view_in_a` (over A's loops); op B reads the
    same V through `view_in_b` (over B's loops). For each loop of A that indexes a dim of V,
    the B-term addressing the same element: {a_dim: b_term}. None when a loop of A indexes
    two dims of V (not a projected permutation)."""
    images: dict[int, object] = {}
    if len(view_in_a) != len(view_in_b):
        return None
    for ta, tb in zip(view_in_a, view_in_b):
        if isinstance(ta, Const):
            continue
        if ta in images and images[ta] != tb:
            return None
        images[ta] = tb
    return images


def substitute(ts: list, images: dict) -> list | None:
    """Rewrite terms over A's loops into terms over B's loops via `images` (see
    `loop_images`); None when a loop used by `ts` has no image."""
    out = []
    for t in ts:
        if isinstance(t, Const):
            out.append(t)
        elif t in images:
            out.append(images[t])
        else:
            return None
    return out
