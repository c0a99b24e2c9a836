"""What a linear cross-entropy script is built from: the schedule's parameters
(LinearCrossEntropyParams) and the plan read from the payload (LinearCrossEntropyPlan, made by
plan.py; the steps are fuse.py's)."""

from __future__ import annotations

from dataclasses import dataclass

from ..common import Place
from ..cross_entropy.params import RowTiling


@dataclass(frozen=True)
class LinearCrossEntropyParams:
    """row_tile: rows per iteration of the forward's scf.forall (0: h^T of a block fills at
    most `block_bytes`, with enough blocks for `threads` workers; a divisor of N);
    class_tile: classes per step of the fused loops (the logits tile is class_tile x rows);
    backward_rows: rows per block of the backward (the remainder block is handled);
    threads: workers the foralls are balanced for (the backward's forall has one iteration
    per thread); classes_major: S stored [V, N] (a CPU register tile's lanes along the
    rows), else [N, V] as computed (a GPU's DPAS tiles); masked_target: the target logit
    as a masked sum over S's classes in the class loop (no read of h or W at a target),
    else the dot product h_n . W_{y_n}; lanes: when > 0, the per-row values cross from
    the rows' kernel to the reductions over the rows in lane form ([N, lanes], each row's
    value in every lane; y read the same way: the XeGPU form of the cross_entropy family's
    kernels, transform_ext/lane_form_row_reductions.py), the row blocks tiling the lane
    copy of the rows' losses; bf16_dot: the backward's products read bf16 operands as they
    are, for the bf16 dot products of the vectorize stage (GenericParams.bf16_dot, set with
    it); amx: the forward's logits tiles of bf16 h and W run on AMX tiles when the shapes
    allow (LinearCrossEntropyPlan.amx), and so do the fused backward's products (S^T, dW
    and dh of bf16 operands whose extents are multiples of 32; a CPU with AMX, with
    bf16_dot); amx_class_tile: with amx and bf16 logits, the class tile is the largest
    multiple of 32 at most this (and V) that divides V, when one of at least half of it
    does, else that multiple with a remainder tile (dh's accumulator is
    read and written once per class tile: 256 classes took the backward from 116 to 96 ms
    at N=1024, D=1024, V=8192 on one thread, 64 -> 256; the forward was unchanged);
    stored_logits_bytes: in the joint graph (CPU form, logits not on AMX tiles: plan.py's
    _amx_params), when the f32 logits S^T [V, N] fit in this many bytes, the forward's
    class loops keep the tiles they compute in S^T and the backward reads them: three
    products over D instead of four (the backward's recompute of S), for N x V x 4 bytes
    of memory; 0 always recomputes (N = 1024, D = 1024, V = 32000 on one thread: 1879 ->
    1558 ms, torch 1631-1647 ms)."""

    row_tile: int = 0
    class_tile: int = 64
    backward_rows: int = 256
    threads: int = 2
    block_bytes: int = 512 * 1024
    panel: int = 0
    classes_major: bool = True
    masked_target: bool = False
    lanes: int = 0
    bf16_dot: bool = False
    amx: bool = False
    amx_class_tile: int = 256
    stored_logits_bytes: int = 1 << 30

    def __post_init__(self):
        if self.panel < 0:
            raise ValueError(f"LinearCrossEntropyParams.panel must be >= 0, got {self.panel}")
        for name in ("class_tile", "backward_rows", "threads", "block_bytes", "amx_class_tile"):
            if getattr(self, name) < 1:
                raise ValueError(f"LinearCrossEntropyParams.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.row_tile < 0:
            raise ValueError(f"LinearCrossEntropyParams.row_tile must be >= 0, got {self.row_tile}")

    @classmethod
    def for_cpu(cls, cpu, threads: int, **options) -> "LinearCrossEntropyParams":
        """The parameters on a CPU described by `cpu` (lighthouse.targets.description
        CpuDescription), then `options`: a forward block's h^T in half of L2."""
        return cls(**{"threads": threads, "block_bytes": cpu.l2_bytes // 2,
                      "panel": 2 * cpu.f32_lanes, "bf16_dot": cpu.bf16_dot,
                      "amx": cpu.amx and cpu.bf16_dot, **options})


@dataclass(frozen=True)
class LateSum:
    """A class sum of a row block that reads a reduction of the fused group besides the row
    max (its final value): place among the block's marked class reductions (match order),
    the operand reading S^T, tile_using_for sizes over its loops (the class tile), whether
    the class tile leaves a partial last tile (peeled into a static one)."""

    place: int
    logits_operand: int
    tile_sizes: tuple[int, ...]
    peel: bool = False


@dataclass(frozen=True)
class LinearCrossEntropyPlan:
    """What the script is built from: the parameters and what the payload showed at each
    step of a trial on a copy. classes: V; backward: the joint graph's backward is fused;
    root: place of the forward's root (the last per-row op); rows: its row tiling; late:
    the late class sums (fuse.py: fuse_class_loops) among the `group_size` marked class
    reductions of a row block; rows_total: N; amx: the forward's logits tiles run on AMX
    tiles (params.amx, bf16 h and W, D, the row block and the class tile multiples of
    AMX_SIDE; a remainder tile does not: fuse.py's logits_in_pairs); amx_products: some
    product is marked AMX_PRODUCT (the forward's, or the fused backward's whose extents
    allow): the vectorize stage cuts them into AMX steps (cpu.py)."""

    params: LinearCrossEntropyParams
    classes: int
    backward: bool
    root: Place
    rows: RowTiling
    late: tuple[LateSum, ...] = ()
    group_size: int = 0
    rows_total: int = 0
    amx: bool = False
    amx_products: bool = False
    stored_logits: bool = False
