"""XeGPU tail of flash attention: the fused query-block forall as one GPU kernel.

Input: the attention family's `fuse` result (fuse.py), one `scf.forall` over
(batch..., heads, query blocks of `query_tile` rows) whose body holds the key loop(s): per key
tile, S = Q K^T, the online softmax update, and O += P V (a causal kernel has two loops: the
tiles wholly below the diagonal without the mask, then the diagonal band with it, bounded
by the diagonal). K^T (transposed, scaled) and V (widened to f32) are computed once outside
the forall, which suits the CPU.

Workgroups (`tile_attention`): one forall iteration = one workgroup. The K and V producer
chains are fused into the forall and then into each key loop (through the unit-dim reshapes,
by bubbling the slices up), so a key loop reads K and V tiles straight from the inputs: no
copy of K or V is written, no S_q x S_kv buffer exists. Unit dims of the tiles are folded, so
every tile is 2-D [rows, columns].
Subgroups: `query_tile / sg_rows` subgroups, each owning `sg_rows` query rows of Q, S, P and
O (sg_layout [n, 1]); the K and V tiles are read whole by every subgroup (sg_layout [1, 1]),
the row max / sum of S are reductions inside a subgroup.
Vectorization (schedules/xegpu/common.py): S = Q K^T becomes a DPAS on f16/bf16 Q and K with SDPA's scale
applied to the f32 product; P is rounded to the input type for the P V DPAS.
Layouts (`annotate_attention`): anchors on the Q, K (transposed 2-D block read), V loads,
both DPAS ops of each key loop and the output store; K and V loads carry prefetches.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured, tensor as ttensor, xegpu

from transform_ext.analysis.structure import is_linalg_op, loop_structure
from transform_ext.common import Illegal, block_ops, defining_op, ops_named
from transform_ext.match_attention_forall import (attention_forall, contractions, key_loops,
                                                  match_attention_forall)
from transform_ext.match_attention_kernel_ops import attention_kernel_ops, match_attention_kernel_ops
from transform_ext.match_sliced_producers import match_sliced_producers, sliced_producers

from ..common import annotate, apply_patterns, canonicalize, match
from ..script import StepRecorder
from ..xegpu.common import RowSubgroups, passes
from ..xegpu.contraction import block_mapping, split

DPAS_TYPES = ("f16", "bf16")


@dataclass(frozen=True)
class AttentionTiles(RowSubgroups):
    """One workgroup: `query_tile` query rows against all keys, `key_tile` keys per step,
    head dims `qk_dim` (Q, K) and `v_dim` (V, O); `sg_rows` rows per subgroup; the DPAS
    shape; `grid`: workgroups per forall dim (batch..., heads, query blocks)."""

    query_tile: int
    key_tile: int
    qk_dim: int
    v_dim: int
    sg_rows: int
    grid: tuple[int, ...]
    dtype: str
    dpas: tuple[int, int, int] = (8, 16, 16)
    subgroup_size: int = 16
    nb_prefetch: int = 1
    position_mask: bool = False    # a key loop masks by query and key positions (causal)

    @property
    def rows(self) -> int:
        return self.query_tile

    @property
    def sg_data(self) -> tuple[int, int]:
        return (self.sg_rows, self.v_dim)

    def register_bytes(self) -> int:
        """Live registers of a subgroup at the peak of a key step: Q and the f32 O
        accumulator throughout, with the K tile (read whole) and S (f32) for Q K^T, or the V
        tile, S and exp(S - m) (f32, until the row sum) and P for P V; plus the rows' m, l
        and correction; with a position mask, the query and key positions broadcast to the
        [rows, keys] tile and their difference (i64)."""
        narrow = 2
        q = self.sg_rows * self.qk_dim * narrow
        o = self.sg_rows * self.v_dim * 4
        s = self.sg_rows * self.key_tile * 4
        p = self.sg_rows * self.key_tile * narrow
        k = self.key_tile * self.qk_dim * narrow
        v = self.key_tile * self.v_dim * narrow
        mask = 2 * self.sg_rows * self.key_tile * 8 if self.position_mask else 0
        return q + o + max(k + s, v + 2 * s + p) + mask + 3 * self.sg_rows * 4


# ------------------------------------------------------------------------------ analysis

def _constant_index(value: ir.Value) -> int | None:
    owner = defining_op(value)
    if owner is not None and owner.name == "arith.constant":
        return ir.IntegerAttr(owner.attributes["value"]).value
    return None


# Rows per subgroup to try, most first: more rows reuse each K and V tile a subgroup reads
# for more DPAS work.
SG_ROWS = (16, 8)
# The share of the register file the tiles of register_bytes may take: the rest holds
# addresses, loop state and the compiler's temporaries. Calibrated with IGC 2.40 on f16
# [1, 4, 256, 64] attention for bmg with 256 registers (16 KiB), rows x keys per subgroup:
# within it 8 x 32 (model 9.8 KB; causal 13.8 KB) and 16 x 16 (11.0 KB) build without
# spills; beyond it 16 x 32 (15.4 KB) spills 384 B and causal 16 x 16 (15.0 KB) 1,472 B.
# Every attention kernel of tests/lighthouse/test_xegpu_native.py builds within the bound.
REGISTER_SHARE = 7 / 8


def plan_attention(forall: ir.Operation, *, sg_rows: int | None, subgroup_size: int,
                   dpas: tuple[int, int, int], max_threads: int, grf_bytes: int,
                   nb_prefetch: int = 1) -> AttentionTiles:
    """Tiles of the fused kernel read from its IR, validated against the DPAS shape and the
    chip (ValueError naming the dimension otherwise). sg_rows None: the most rows per
    subgroup (SG_ROWS) whose tiles fit REGISTER_SHARE of the register file `grf_bytes`."""
    where = f"attention at {forall.location}"
    if len(forall.results) != 1:
        raise ValueError(f"{where}: {len(forall.results)} results per query block (an extra "
                         "per-row result such as return_lse has no GPU mapping yet)")
    loops = key_loops(forall)
    scores, values = contractions(loops[0])
    s_ls, v_ls = loop_structure(scores), loop_structure(values)
    s_dims, v_dims = s_ls.contraction_dims(), v_ls.contraction_dims()
    if len(s_dims["m"]) != 1 or len(s_dims["n"]) != 1 or len(s_dims["k"]) != 1:
        raise ValueError(f"{where}: S = Q K^T is not a plain [rows, keys] contraction")
    query_tile = s_ls.ranges[s_dims["m"][0]]
    key_tile = s_ls.ranges[s_dims["n"][0]]
    qk_dim = s_ls.ranges[s_dims["k"][0]]
    v_dim = v_ls.ranges[v_dims["n"][0]]
    dtype = input_dtype(forall, where)
    for loop in loops:
        step = _constant_index(loop.operands[2])
        if step != key_tile:
            raise ValueError(f"{where}: key loop step {step} differs from the key tile {key_tile}")
    body = block_ops(forall.regions[0].blocks[0])
    extra = [op for op in body if is_linalg_op(op) and op.name != "linalg.fill"
             and loop_structure(op).is_contraction]
    if extra:
        raise ValueError(f"{where}: the key length is not a multiple of the key tile "
                         f"({key_tile}): a remainder tile outside the key loop has no GPU form "
                         "yet; choose key_tile dividing the key length")
    bounds = static_bounds(forall, where)
    dm, dn, dk = dpas
    masked = any(ops_named(loop, "linalg.index") for loop in loops)
    budget = int(grf_bytes * REGISTER_SHARE)
    if sg_rows is None:
        fitting = [r for r in SG_ROWS if query_tile % r == 0 and r % dm == 0 and AttentionTiles(
            query_tile, key_tile, qk_dim, v_dim, r, (), dtype, dpas, subgroup_size,
            nb_prefetch, masked).register_bytes() <= budget]
        sg_rows = fitting[0] if fitting else SG_ROWS[-1]
    checks = [("query rows per workgroup", query_tile, sg_rows, "rows per subgroup"),
              ("rows per subgroup", sg_rows, dm, "DPAS rows"),
              ("key tile", key_tile, dk, "DPAS depth"),
              ("key tile", key_tile, dn, "DPAS columns"),
              ("head dim of Q and K", qk_dim, dk, "DPAS depth"),
              ("head dim of V", v_dim, dn, "DPAS columns")]
    tiles = AttentionTiles(query_tile, key_tile, qk_dim, v_dim, sg_rows, tuple(bounds), dtype,
                           dpas, subgroup_size, nb_prefetch, masked)
    check_tiles(where, tiles, checks, max_threads, grf_bytes, "key_tile or attention_sg_rows")
    return tiles


def input_dtype(forall: ir.Operation, where: str) -> str:
    """The one float type of the inputs of `forall`'s function, f16 or bf16 (ValueError
    naming the types otherwise)."""
    inputs = [ir.RankedTensorType(v.type).element_type for v in forall.parent.regions[0]
              .blocks[0].arguments if isinstance(v.type, ir.RankedTensorType)]
    dtypes = sorted({str(t) for t in inputs if isinstance(t, ir.FloatType)})
    if not dtypes or any(d not in DPAS_TYPES for d in dtypes):
        raise ValueError(f"{where}: inputs of type {', '.join(dtypes) or 'none'}: DPAS multiplies "
                         "f16 or bf16 (with f32 accumulation); give the attention float16 or "
                         "bfloat16 inputs")
    if len(dtypes) != 1:
        raise ValueError(f"{where}: mixed input types {dtypes}")
    return dtypes[0]


def static_bounds(forall: ir.Operation, where: str) -> list[int]:
    bounds = list(ir.DenseI64ArrayAttr(forall.attributes["staticUpperBound"]))
    if any(b < 0 for b in bounds):
        raise ValueError(f"{where}: dynamic forall bounds")
    return bounds


def check_tiles(where: str, tiles, checks, max_threads: int, grf_bytes: int, lower: str) -> None:
    """ValueError naming the first violation: an extent of `checks` (what, extent, tile,
    tile name) that the tile does not divide, more threads than `max_threads`, or a
    subgroup's register_bytes beyond REGISTER_SHARE of `grf_bytes` (`lower`: the options
    that shrink them)."""
    for what, extent, tile, tile_name in checks:
        if extent % tile:
            raise ValueError(f"{where}: {what} ({extent}) is not a multiple of the {tile_name} ({tile})")
    if tiles.threads > max_threads:
        raise ValueError(f"{where}: {tiles.threads} threads per workgroup exceed {max_threads}")
    budget = int(grf_bytes * REGISTER_SHARE)
    if tiles.register_bytes() > budget:
        raise ValueError(f"{where}: a subgroup's tiles ({tiles.register_bytes()} B) exceed "
                         f"{budget} B of the register file ({grf_bytes} B); lower {lower}")


# -------------------------------------------------------------------------------- tiling

def tile_attention(rec: StepRecorder, tiles: AttentionTiles) -> None:
    """Workgroup form of the fused forall (module docstring): K/V chains fused into the key
    loops, transposes and copies generalized, unit dims folded, block mapping attached;
    steps of `rec`."""
    from ..generic import func_ops

    def forall_now():
        (func,) = func_ops(rec.trial)
        return attention_forall(func)

    _fuse_sliced_producers(rec, forall_now, lambda func: match_attention_forall(func)[0])
    count = len(key_loops(forall_now()))
    # last loop first: fusing a producer that a later loop also reads into the earlier
    # loop crashes FuseIntoContainingOp (LLVM "SmallVector unable to grow")
    for k in reversed(range(count)):
        _fuse_sliced_producers(rec, lambda k=k: key_loops(forall_now())[k],
                               lambda func, k=k: split(match_attention_forall(func)[1], count)[k])

    def fold(root):
        func = match(root, "func.func")
        structured.GeneralizeOp(match(func, ["linalg.transpose", "linalg.copy"]))
        apply_patterns(func, structured.ApplyFoldUnitExtentDimsViaReshapesPatternsOp,
                       transform.ApplyCanonicalizationPatternsOp)
        apply_patterns(func, ttensor.ApplyReassociativeReshapeFoldingPatternsOp,
                       ttensor.ApplyBubbleUpExtractSlicePatternsOp,
                       transform.ApplyCanonicalizationPatternsOp)

    rec.step("fold_unit_dims", fold)
    rec.step("canonicalize", passes("canonicalize", "cse"))
    dims = len(tiles.grid)

    def map_to_blocks(root):
        forall, _ = match_attention_forall(match(root, "func.func"))
        annotate(forall, "mapping", block_mapping(dims))

    rec.step("map_to_workgroups", map_to_blocks)


def _fuse_sliced_producers(rec: StepRecorder, container_now, container_of, mark=None) -> None:
    """Fuse into the container (`container_now()` the trial's op, `container_of(func)` its
    handle) every linalg op of its block whose result it reads through tensor.extract_slice
    (match_sliced_producers); slices of reshapes are bubbled above them so the chain
    continues. `mark(handle)`: re-annotates the container after a fusion (a forall that
    yields a fused producer's result for later readers is a new op)."""
    for _ in range(16):
        n = len(sliced_producers(container_now()))
        if not n:
            rec.step("bubble_up_slices", _bubble_up_slices)
            n = len(sliced_producers(container_now()))
            if not n:
                return

        def body(root, n=n):
            target = container_of(match(root, "func.func"))
            for producer in split(match_sliced_producers(target), n):
                target = structured.FuseIntoContainingOp(producer, target).new_containing_op
            if mark is not None:
                mark(target)

        rec.step("fuse_sliced_producers", body)
        rec.step("canonicalize", passes("canonicalize", "cse"))
    raise ValueError("attention: the K/V producer chains did not fuse into the key loop")


def _bubble_up_slices(root: ir.Value) -> None:
    apply_patterns(match(root, "func.func"), ttensor.ApplyBubbleUpExtractSlicePatternsOp,
                   transform.ApplyCanonicalizationPatternsOp)


# ------------------------------------------------------------------------------- layouts

def check_kernel(gpu_func: ir.Operation) -> None:
    """ValueError naming what is missing when `gpu_func` (after convert-vector-to-xegpu) does
    not hold the layout anchors of an attention kernel (match_attention_kernel_ops)."""
    try:
        attention_kernel_ops(gpu_func)
    except Illegal as exc:
        raise ValueError(exc.reason) from None


def _layout(sg_layout, sg_data, inst_data, **extra) -> dict:
    return {"sg_layout": list(sg_layout), "sg_data": list(sg_data), "inst_data": list(inst_data),
            **extra}


def annotate_attention(gpu_func: ir.Value, tiles: AttentionTiles) -> None:
    """Anchor layouts (transform IR; `gpu_func` a handle, the anchors matched by
    match_attention_kernel_ops): rows of Q, S, P and O split over the subgroups, K and V
    tiles whole in every subgroup, DPAS instruction tiles; K read transposed (order [0, 1])
    for the K^T operand."""
    dm, dn, dk = tiles.dpas
    n, rows, kt = tiles.subgroups, tiles.sg_rows, tiles.key_tile
    q = _layout([n, 1], [rows, tiles.qk_dim], [dm, dk])
    kt_operand = _layout([1, 1], [tiles.qk_dim, kt], [dk, dn], order=[1, 0])
    k_load = _layout([1, 1], [kt, tiles.qk_dim], [dn, dk], order=[0, 1])
    s = _layout([n, 1], [rows, kt], [dm, dn])
    p = _layout([n, 1], [rows, kt], [dm, dk])
    v = _layout([1, 1], [kt, tiles.v_dim], [dk, dn])
    o = _layout([n, 1], [rows, tiles.v_dim], [dm, dn])
    q_loads, k_loads, v_loads, qk_dpas, pv_dpas, stores = match_attention_kernel_ops(gpu_func)
    xegpu.set_anchor_layout(q_loads, **q)
    xegpu.set_anchor_layout(k_loads, **k_load)
    xegpu.set_anchor_layout(v_loads, **v)
    xegpu.set_anchor_layout(qk_dpas, index=0, **q)
    xegpu.set_anchor_layout(qk_dpas, index=1, **kt_operand)
    xegpu.set_anchor_layout(qk_dpas, index=2, **s)
    xegpu.set_anchor_layout(pv_dpas, index=0, **p)
    xegpu.set_anchor_layout(pv_dpas, index=1, **v)
    xegpu.set_anchor_layout(pv_dpas, index=2, **o)
    xegpu.set_anchor_layout(stores, **o)
    canonicalize(gpu_func)
