"""What a cross-entropy script is built from: the schedule's parameters
(CrossEntropyParams: tiles, lanes, the cache block) and the plan read from the payload
(CrossEntropyPlan, with the row tiling of step 4 and a ClassLoop per row block for step 5 of
fuse.py's schedule; plan.py makes it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common import Place


@dataclass(frozen=True)
class CrossEntropyParams:
    """row_tile: rows per scf.forall iteration (0: chosen so a block's logits stay in L2,
    `block_bytes`, or in L1, `sweep_bytes`, when a gradient (a log-softmax's result) or a
    late class sum sweeps the block again after its class loop, with enough blocks for
    `threads` workers);
    class_tile: classes per step of the fused loop (0: 8 chunks of `lanes` when the lanes are
    split, else 4096; a remainder tile is handled); lanes: running maxima and sums per row
    when the classes are the contiguous dim (halved down to `min_lanes` until it divides
    them; 1: one per row, as when none does): several vector registers of lanes keep the max
    chains independent; vector_tile: elements per vector op elsewhere."""

    row_tile: int = 0
    class_tile: int = 0
    threads: int = 2
    lanes: int = 64
    min_lanes: int = 16
    block_bytes: int = 1 << 20
    vector_tile: int = 64
    sweep_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("threads", "lanes", "min_lanes", "block_bytes", "vector_tile", "sweep_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"CrossEntropyParams.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("row_tile", "class_tile"):
            if getattr(self, name) < 0:
                raise ValueError(f"CrossEntropyParams.{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def for_cpu(cls, cpu, threads: int, **options) -> "CrossEntropyParams":
        """The parameters on a CPU described by `cpu` (lighthouse.targets.description
        CpuDescription), then `options`: 4 vector registers of lanes (at least one), row
        blocks of half of L2, or of half of L1 when a gradient sweeps them again (a
        log-softmax [16384, 1024] on 2 threads: 8.6 ms in blocks of 256 rows, 6.0 in blocks of
        8; a loss alone, bf16 [4096, 32000]: 22.3 ms in blocks of 16 rows, 24.3 of one),
        vector tiles of 4 registers."""
        lanes = cpu.f32_lanes
        return cls(**{"threads": threads, "lanes": 4 * lanes, "min_lanes": lanes,
                      "block_bytes": cpu.l2_bytes // 2, "vector_tile": 4 * lanes,
                      "sweep_bytes": cpu.l1d_bytes // 2, **options})


@dataclass(frozen=True)
class RowTiling:
    """Step 4: the root and its producers over the rows, by their places (root first) among
    the `count` ops of `names` that structured.match finds in the function; the root's
    tile_using_forall sizes."""

    names: tuple[str, ...]
    count: int
    places: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class ClassLoop:
    """Step 5 in one row block: lanes to split the group into (1: none), class tile; late:
    places, among the block's `group_size` marked class reductions (match order), of the
    late class sums (fuse.py: fuse_class_loops), which stay out of the fused loop."""

    lanes: int
    class_tile: int
    late: tuple[int, ...] = ()
    group_size: int = 0


@dataclass(frozen=True)
class CrossEntropyPlan:
    """What the script is built from: the parameters and what the payload showed at each
    step of a trial on a copy. gradients: places of the gradients to merge into one (empty
    with at most one); classes: C; root: place of the root (as RowTiling.ops); rows: None
    when nothing is tiled (the unbatched loss); blocks: one ClassLoop per row block (the
    function when untiled); vector: per class reduction in match order, the tile sizes of
    the row loops and of the partial vector results (None: a lane-split one); short_exp:
    every result is f16 or bf16, so the exps take transform_ext.expand_fast_exp's short
    form (within 6 f32 ulp, where a 16-bit result rounds at 2^-11 or 2^-8)."""

    params: CrossEntropyParams
    fold_reshapes: bool
    gradients: tuple[Place, ...]
    classes: int
    root: Place
    rows: RowTiling | None
    blocks: tuple[ClassLoop, ...]
    blocks_in_foralls: bool
    vector: tuple[tuple[tuple[int, ...], tuple[int, ...] | None], ...]
    short_exp: bool = False
