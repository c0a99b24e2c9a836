"""The Intel GPU target: XeGPU workgroup-level code with DPAS, lowered to XeVM and SPIR-V.

Stages after `import` and `cleanup` (each nameable with --emit / --stop-after):
  fuse           the family's fused schedule (target independent; attention's with the
                 target's `attention_tiles`); for the generic, matmul and cross_entropy
                 families the GPU preparation only (unit dims folded, asserts split)
  workgroups     weights frozen as constants become kernel arguments; every kernel becomes
                 one `scf.forall` whose iterations are workgroups: a contraction kernel
                 (matmul + prologue + epilogue) tiled [wg_m, wg_n] with a k loop, a row kernel
                 (softmax, norms) tiled by rows with its whole producer chain (long rows of a
                 softmax in column loops), the attention family's query-block forall as it is
                 with the K / V chains fused into its key loops (schedules/xegpu_attention.py)
  subgroups      each workgroup tile is decomposed over subgroups (sg_layout x sg_data, the
                 DPAS instruction tiles, the thread count), validated against the chip
  vectorize      whole-tile vectors, type extensions folded into vector.contract, contract
                 operands narrowed to f16/bf16 (DPAS), accumulators hoisted out of loops
  bufferize      one-shot bufferization, results as out-parameters
  gpu-outline    forall -> gpu.launch (threads per the subgroup decomposition) ->
                 gpu-kernel-outlining -> xevm-attach-target{chip}
  xegpu          convert-vector-to-xegpu (2-D block loads/stores, xegpu.dpas)
  xegpu-layouts  anchor layouts (sg_layout / sg_data / inst_data) and prefetches
  xevm           gpu-lower-to-xevm-pipeline{xegpu-op-level=workgroup} (device LLVM + host)
  binary         SPIR-V per kernel (validated by spirv-val, see spirv.py) embedded in the
                 host module as gpu.binary (what Level Zero's zeModuleCreate loads); the
                 device LLVM bitcode (gpu-module-to-binary{format=llvm}) is kept for `-o *.bc`
There is no Intel GPU here: the target has no `jit`; it is checked through its IR and its
validated SPIR-V, and the numerics through the CPU target running the same fused schedule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch_mlir import ir

from transform_ext.common import ops_named

from ..errors import StageError, UnsupportedError
from ..pipeline import Stage


@dataclass(frozen=True)
class Chip:
    """What the schedules need to know about one Intel GPU generation."""

    name: str
    subgroup_size: int                 # lanes per subgroup (SIMD width of the kernels)
    dpas: tuple[int, int, int]         # DPAS M x N x K for f16/bf16 with f32 accumulation
    max_workgroup_threads: int         # lanes per workgroup
    grf_bytes: int                     # register file of one hardware thread (large GRF)
    block_width_bytes: int             # 2-D block load: max row width in bytes
    block_height: int                  # 2-D block load: max rows
    xe_cores: int


CHIPS = {
    "bmg": Chip("bmg", 16, (8, 16, 16), 1024, 256 * 64, 64, 32, 20),
    "pvc": Chip("pvc", 16, (8, 16, 16), 1024, 256 * 64, 64, 32, 128),
}
DEFAULT_CHIP = "bmg"
# Families whose fuse stage only tiles for the host CPU (no fusion across reductions): on
# the GPU the workgroups stage does their tiling, so their script's @fuse is the GPU
# preparation (schedules/xegpu_common.py gpu_preparation).
# The cross_entropy family's CPU row blocks (lane-split sums) are no GPU form: log-softmax
# goes the generic way (a row kernel), a loss gets kernels of its own
# (schedules/xegpu_cross_entropy.py, see workgroups).
TILING_ONLY_FAMILIES = frozenset({"generic", "matmul", "cross_entropy"})
# Plan kinds of a cross-entropy loss: its row kernel and its reductions over the rows.
LOSS_KINDS = frozenset({"cross_entropy", "row_sum"})
# Workgroup tiles [m, n] of contraction kernels, largest first.
WORKGROUP_TILES = ((256, 256), (256, 128), (128, 256), (128, 128), (64, 128), (128, 64),
                   (64, 64), (32, 64), (64, 32), (32, 32), (16, 32), (8, 32), (16, 16), (8, 16))


@dataclass(frozen=True)
class XeGpuParams:
    """Overrides of the shape-derived choices; None = chosen from the shapes and the chip.

    wg: workgroup tile [m, n] of contraction kernels; sg: subgroup tile [m, n]; k_tile:
    reduction step (elements of K per loop iteration); nb_prefetch: prefetch distance of the
    k loop in iterations; rows: rows per workgroup of row kernels (softmax, norms);
    attention_sg_rows: query rows per subgroup of attention kernels; column_tile: columns per
    step of the column loops of long-row kernels (softmax; default: chosen from the
    registers)."""

    wg: tuple[int, int] | None = None
    sg: tuple[int, int] | None = None
    k_tile: int | None = None
    nb_prefetch: int = 1
    rows: int | None = None
    attention_sg_rows: int = 16
    column_tile: int | None = None

    def __post_init__(self):
        for name in ("wg", "sg"):
            v = getattr(self, name)
            if v is not None and (len(v) != 2 or min(v) < 1):
                raise UnsupportedError(f"xegpu: {name} must be two positive sizes, got {v}")
        for name in ("k_tile", "rows", "attention_sg_rows", "column_tile"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise UnsupportedError(f"xegpu: {name} must be positive, got {v}")
        if self.nb_prefetch < 0:
            raise UnsupportedError(f"xegpu: nb_prefetch must be >= 0, got {self.nb_prefetch}")


@dataclass
class KernelPlan:
    """One GPU kernel: what it computes and how it is decomposed."""

    kind: str                 # "contraction" | "rows"
    description: str
    tiles: object             # ContractionTiles | RowTiles
    grid: tuple[int, ...] = ()

    @property
    def threads(self) -> int:
        return self.tiles.threads


@dataclass
class KernelArtifact:
    """A finished kernel: launch geometry and its validated SPIR-V."""

    name: str
    module: str               # the gpu.module (gpu.binary) holding it
    kind: str
    description: str
    grid: tuple[int, int, int]
    local_size: tuple[int, int, int]
    subgroup_size: int
    spirv: bytes
    bitcode: bytes | None = None


class XeGpuTarget:
    """chip: 'bmg' (Battlemage, default) or 'pvc' (Ponte Vecchio); params: XeGpuParams."""

    name = "xegpu"
    # what the schedule families read (lighthouse.targets.description): no CPU vector unit
    # (the target vectorizes its own way); parallel tiles are workgroups, not CPU threads
    cpu = None
    threads = 1
    # (query rows per workgroup, keys per step of the key loop) of the attention schedule:
    # 8 subgroups of 16 rows; 32 keys keep a subgroup's Q, O, K or V tile, S and P within
    # the register file for head dims up to 64 (AttentionTiles.register_bytes)
    attention_tiles = (128, 32)

    def __init__(self, chip: str | None = None, params: XeGpuParams | None = None):
        chip = chip or DEFAULT_CHIP
        if chip not in CHIPS:
            raise UnsupportedError(f"unknown --chip {chip!r}; chips are: {', '.join(CHIPS)}")
        self.chip = CHIPS[chip]
        self.params = params or XeGpuParams()
        self.options: tuple = ()          # the kernel file's LIGHTHOUSE dict, as sorted pairs
        self.family: str | None = None
        self.plans: list[KernelPlan] = []
        self.kernels: list[KernelArtifact] = []
        self.weight_specs: list[dict] = []

    # ------------------------------------------------------------------ pipeline assembly
    def script(self, family, payload):
        """The schedule script of `family` on this target when it is not the family's own:
        for tiling-only families the GPU preparation as @fuse (None: the family's)."""
        if family.name not in TILING_ONLY_FAMILIES:
            return None
        from schedules.xegpu_common import gpu_preparation_script

        return gpu_preparation_script()

    def adapt_front(self, family, front: list[Stage]) -> list[Stage]:
        """The script's fuse stays (for tiling-only families the GPU preparation, see
        `script`); the target's workgroups/subgroups follow it and its own vectorization
        replaces the family's CPU one."""
        if family.name == "loops":
            raise UnsupportedError("the loops schedule has no GPU lowering; use the default schedule")
        self.family = family.name
        by_name = {s.name: s for s in front}
        return [by_name["import"], by_name["cleanup"], by_name["fuse"],
                Stage("workgroups", self.workgroups, "kernels tiled into workgroup foralls"),
                Stage("subgroups", self.subgroups, "subgroup decomposition of each workgroup tile"),
                Stage("vectorize", self.vectorize, "whole-tile vectors, DPAS operand types")]

    def stages(self) -> list[Stage]:
        return [
            Stage("bufferize", self.bufferize, "one-shot bufferize, out-params"),
            Stage("gpu-outline", self.outline, "gpu.launch, kernel outlining, xevm target"),
            Stage("xegpu", self.to_xegpu, "convert-vector-to-xegpu"),
            Stage("xegpu-layouts", self.layouts, "anchor layouts and prefetches"),
            Stage("xevm", self.xevm, "XeGPU -> XeVM -> LLVM (device) and host launch code"),
            Stage("binary", self.binary, "validated SPIR-V kernels embedded in the host module"),
        ]

    # ----------------------------------------------------------------------------- stages
    def workgroups(self, module: ir.Module) -> None:
        from schedules.generic import func_ops
        from schedules.xegpu_contraction import find_contraction_groups, tile_kernel
        from schedules.xegpu_rows import find_row_roots, tile_rows

        self.weight_specs = constants_to_arguments(module)
        self.plans = []
        if self.family == "cross_entropy" and _has_loss_tail(module):
            self._loss_kernels(module)
            return
        for func in func_ops(module):
            top = [o.operation for o in func.regions[0].blocks[0].operations]
            existing = [o for o in top if o.name == "scf.forall"]
            if existing:
                self._fused_kernels(module, func, existing)
                continue
            if self.family == "attention":
                raise UnsupportedError(
                    "xegpu: the attention schedule left no query-block forall to map to "
                    "workgroups (a single query block, B * H * S / query_tile = 1?); lower "
                    "query_tile in the kernel's LIGHTHOUSE dict")
            work = []
            for group in find_contraction_groups(func):
                work.append((top.index(group.root), "contraction", group))
            for root in find_row_roots(func, exclude=[o for _, _, g in work for o in g.ops()]):
                work.append((top.index(root), "rows", root))
            work.sort(key=lambda w: w[0])
            for _, kind, item in work:
                if kind == "contraction":
                    tiles = self.contraction_tiles(item)
                    plan = KernelPlan(kind, item.describe(), tiles, self._grid_of(item, tiles))
                    tile_kernel(module, item, tiles)
                    self.plans.append(plan)
                else:
                    tiles = self.row_tiles(item)
                    description = f"{item.name} at {item.location}"
                    tile_rows(module, item, tiles)
                    self.plans.append(KernelPlan(kind, description, tiles, tiles.grid))
        if not self.plans:
            raise UnsupportedError("xegpu: the payload has no linalg op to run on the GPU")

    def _loss_kernels(self, module: ir.Module) -> None:
        """A cross-entropy loss: the host target check, the row kernel and the reductions
        over the rows (schedules/xegpu_cross_entropy.py)."""
        from schedules.xegpu_cross_entropy import NotLowerable, lower_loss

        try:
            kernels = lower_loss(module, subgroup_size=self.chip.subgroup_size,
                                 max_threads=self.chip.max_workgroup_threads,
                                 min_workgroups=self.chip.xe_cores, rows=self.params.rows,
                                 column_tile=self.params.column_tile)
        except NotLowerable as exc:
            raise UnsupportedError(f"xegpu: {exc}") from exc
        self.plans = [KernelPlan(k.kind, k.description, k.tiles, k.tiles.grid) for k in kernels]

    def _fused_kernels(self, module: ir.Module, func, foralls) -> None:
        """Foralls of a fused schedule (one per kernel) become workgroup grids as they are;
        payload ops outside them are refused (they would need kernels of their own)."""
        from schedules.xegpu_attention import attention_forall, plan_attention, tile_attention

        forall = attention_forall(func)
        if forall is None or len(foralls) != 1:
            raise UnsupportedError(
                f"xegpu: {len(foralls)} scf.forall of a fused schedule that is not attention: no "
                "GPU mapping for it yet")
        try:
            tiles = plan_attention(forall, sg_rows=self.params.attention_sg_rows,
                                   subgroup_size=self.chip.subgroup_size, dpas=self.chip.dpas,
                                   max_threads=self.chip.max_workgroup_threads,
                                   grf_bytes=self.chip.grf_bytes, nb_prefetch=self.params.nb_prefetch)
        except ValueError as exc:
            raise UnsupportedError(f"xegpu: {exc}") from exc
        tile_attention(module, tiles)
        self.plans.append(KernelPlan("attention", f"attention at {forall.location}", tiles,
                                     tiles.grid))

    def subgroups(self, module: ir.Module) -> None:
        foralls = top_level_foralls(module)
        if len(foralls) != len(self.plans):
            raise StageError(f"expected {len(self.plans)} workgroup foralls, found {len(foralls)}")
        i64 = ir.IntegerType.get_signless(64)
        for forall, plan in zip(foralls, self.plans):
            tiles = plan.tiles
            if plan.threads > self.chip.max_workgroup_threads:
                raise UnsupportedError(
                    f"xegpu: {plan.description}: {plan.threads} threads per workgroup exceed the "
                    f"{self.chip.name} limit of {self.chip.max_workgroup_threads}")
            forall.attributes["xegpu.sg_layout"] = ir.DenseI64ArrayAttr.get(tiles.sg_layout)
            forall.attributes["xegpu.sg_data"] = ir.DenseI64ArrayAttr.get(list(tiles.sg_data))
            forall.attributes["xegpu.threads"] = ir.IntegerAttr.get(i64, plan.threads)

    def vectorize(self, module: ir.Module) -> None:
        from schedules.xegpu_common import vectorize

        if any(p.kind in LOSS_KINDS for p in self.plans):
            # no contraction (no DPAS); the target gathers become scattered loads
            vectorize(module, contractions=False, gathers=True)
        else:
            vectorize(module)
        expand_erf(module)

    def bufferize(self, module: ir.Module) -> None:
        from schedules.xegpu_common import bufferize
        from schedules.xegpu_cross_entropy import finish_bufferized

        bufferize(module)
        if any(p.kind in LOSS_KINDS for p in self.plans):
            finish_bufferized(module)

    def outline(self, module: ir.Module) -> None:
        from schedules.xegpu_common import outline

        outline(module, [p.threads for p in self.plans], self.chip.name)
        launches = []

        def visit(op):
            if op.name == "gpu.launch_func":
                launches.append(op)
            return ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        for plan, launch in zip(self.plans, launches):
            plan.grid = tuple(_constant(v) for v in list(launch.operands)[:3])

    def to_xegpu(self, module: ir.Module) -> None:
        from schedules.xegpu_common import to_xegpu

        to_xegpu(module)
        leftover = len(ops_named(module, "vector.contract"))
        if leftover:
            raise StageError(f"{leftover} vector.contract op(s) did not become xegpu.dpas")

    def layouts(self, module: ir.Module) -> None:
        from schedules.common import match, run_schedule
        from schedules.xegpu_contraction import annotate_kernel
        from schedules.xegpu_rows import annotate_rows
        from torch_mlir.dialects import transform

        from schedules.xegpu_contraction import inspect_kernel

        funcs = ops_named(module, "gpu.func")
        count = len(funcs)
        if count != len(self.plans):
            raise StageError(f"expected {len(self.plans)} gpu.func kernels, found {count}")
        from schedules.xegpu_attention import annotate_attention, check_kernel
        from schedules.xegpu_common import insert_loop_prefetches
        from schedules.xegpu_cross_entropy import annotate_loss_kernel, kernel_anchors, prefetch_shape

        shapes = []
        for index, (func, plan) in enumerate(zip(funcs, self.plans)):
            try:
                if plan.kind == "contraction":
                    shapes.append(inspect_kernel(func))
                elif plan.kind == "rows":
                    with module.context, func.location:
                        insert_loop_prefetches(func, plan.tiles.sg_layout[0],
                                               (plan.tiles.rows_per_subgroup, self.chip.subgroup_size),
                                               self.params.nb_prefetch)
                    shapes.append(None)
                elif plan.kind == "attention":
                    with module.context, func.location:
                        insert_loop_prefetches(func, plan.tiles.subgroups, self.chip.dpas[:2],
                                               plan.tiles.nb_prefetch)
                    check_kernel(func)
                    shapes.append(None)
                elif plan.kind in LOSS_KINDS:
                    with module.context, func.location:
                        insert_loop_prefetches(func, *prefetch_shape(plan.tiles),
                                               self.params.nb_prefetch)
                        shapes.append(kernel_anchors(func, plan.tiles))
                else:
                    shapes.append(None)
            except ValueError as exc:
                raise StageError(f"{plan.description}: {exc}") from exc

        def body(root):
            handles = transform.SplitHandleOp([transform.AnyOpType.get()] * count,
                                              match(root, "gpu.func")).results
            for handle, plan, shape in zip(list(handles), self.plans, shapes):
                if plan.kind == "contraction":
                    annotate_kernel(handle, plan.tiles, shape)
                elif plan.kind == "attention":
                    annotate_attention(handle, plan.tiles)
                elif plan.kind in LOSS_KINDS:
                    annotate_loss_kernel(handle, shape)
                else:
                    annotate_rows(handle, plan.tiles)

        run_schedule(module, body)

    def xevm(self, module: ir.Module) -> None:
        from schedules.common import run_passes
        from schedules.xegpu_common import XEVM_PIPELINE

        run_passes(module, XEVM_PIPELINE)

    def binary(self, module: ir.Module) -> None:
        from . import spirv

        translated = spirv.translate(module, self.chip.subgroup_size)
        bitcode = device_bitcode(module)
        kernels = []
        for plan, sm in zip(self.plans, translated):
            if len(sm.entry_points) != 1:
                raise StageError(f"gpu.module @{sm.name}: expected one kernel entry point, "
                                 f"found {len(sm.entry_points)}")
            entry = sm.entry_points[0]
            if entry.local_size != (plan.threads, 1, 1) or entry.subgroup_size != self.chip.subgroup_size:
                raise StageError(f"kernel {entry.name}: SPIR-V local size {entry.local_size} / "
                                 f"subgroup size {entry.subgroup_size}, expected "
                                 f"({plan.threads}, 1, 1) / {self.chip.subgroup_size}")
            grid = tuple(plan.grid) + (1,) * (3 - len(plan.grid))
            kernels.append(KernelArtifact(entry.name, sm.name, plan.kind, plan.description, grid,
                                          entry.local_size, entry.subgroup_size, sm.binary,
                                          bitcode.get(sm.name)))
        embed_spirv(module, translated)
        self.kernels = kernels

    # ---------------------------------------------------------------------- parameters
    def contraction_tiles(self, group):
        from schedules.xegpu_contraction import ContractionTiles

        shape = group.shape()
        m, n, k = shape.get("m"), shape.get("n"), shape.get("k")
        what = group.describe()
        for name, extent in (("m", m), ("n", n), ("k", k)):
            if extent is None:
                raise UnsupportedError(f"xegpu: {what}: no {name} dimension")
        if any(key.startswith(("m", "n", "k", "batch")) and len(key) > 1 and key[-1].isdigit()
               for key in shape):
            raise UnsupportedError(f"xegpu: {what}: multiple m/n/k/batch dims are not supported")
        if "batch" in shape:
            raise UnsupportedError(f"xegpu: {what}: batched contractions are not supported yet")
        problem = group.dpas_problem()
        if problem:
            raise UnsupportedError(f"xegpu: {what}: {problem}")
        dm, dn, dk = self.chip.dpas
        p = self.params
        wg = p.wg or self._workgroup_tile(m, n)
        sg = p.sg or (_pick(wg[0], (32, 16, 8)), _pick(wg[1], (32, 16)))
        k_tile = p.k_tile or _pick(k, (32, 16))
        checks = [("m", m, wg[0], "workgroup tile"), ("n", n, wg[1], "workgroup tile"),
                  ("k", k, k_tile, "k tile"), ("m", wg[0], sg[0], "subgroup tile"),
                  ("n", wg[1], sg[1], "subgroup tile"), ("m", sg[0], dm, "DPAS rows"),
                  ("n", sg[1], dn, "DPAS columns"), ("k", k_tile, dk, "DPAS depth")]
        for dim, extent, tile, what_tile in checks:
            if tile is None or extent % tile:
                raise UnsupportedError(
                    f"xegpu: {what}: dimension {dim} ({extent}) is not a multiple of the "
                    f"{what_tile} ({tile if tile else f'none of the candidates fits'})")
        tiles = ContractionTiles(wg=tuple(wg), sg=tuple(sg), k_tile=k_tile, dpas=self.chip.dpas,
                                 nb_prefetch=p.nb_prefetch, subgroup_size=self.chip.subgroup_size)
        acc_bytes = sg[0] * sg[1] * 4
        if acc_bytes > self.chip.grf_bytes // 2:
            raise UnsupportedError(f"xegpu: {what}: a {sg[0]}x{sg[1]} f32 accumulator per subgroup "
                                   f"exceeds half the register file ({self.chip.grf_bytes} B)")
        return tiles

    def _workgroup_tile(self, m: int, n: int) -> tuple[int | None, int | None]:
        """The largest tile leaving at least one workgroup per Xe-core, else the one with
        the most workgroups; None where no candidate divides."""
        fitting = [(a, b) for a, b in WORKGROUP_TILES if m % a == 0 and n % b == 0]
        if not fitting:
            return (_pick(m, (256, 128, 64, 32, 16, 8)), _pick(n, (256, 128, 64, 32, 16)))
        for a, b in fitting:
            if (m // a) * (n // b) >= self.chip.xe_cores:
                return (a, b)
        return fitting[-1]

    @staticmethod
    def _grid_of(group, tiles) -> tuple[int, int]:
        s = group.shape()
        return (s["m"] // tiles.wg[0], s["n"] // tiles.wg[1])

    def row_tiles(self, root):
        from schedules.xegpu_rows import plan_rows

        try:
            return plan_rows(root, rows=self.params.rows, subgroup_size=self.chip.subgroup_size,
                             max_threads=self.chip.max_workgroup_threads,
                             min_workgroups=self.chip.xe_cores, column_tile=self.params.column_tile)
        except ValueError as exc:
            raise UnsupportedError(f"xegpu: {exc}") from exc

    # ------------------------------------------------------------------------ artifacts
    def emit_artifact(self, compiled, stage: str, path: Path | None) -> bool:
        """`--emit binary -o F.spv` writes the SPIR-V; other stages print IR as usual."""
        if stage == "binary" and path is not None and path.suffix in (".spv", ".bc", ".json"):
            self.write_artifact(compiled, path)
            return True
        return False

    def write_artifact(self, compiled, path: Path) -> None:
        """By suffix: .spv SPIR-V (one kernel, or <stem>.<gpu.module>.spv each), .bc device LLVM
        bitcode, .json launch manifest (grid, local size, subgroup size, arguments), anything
        else the final IR (host module with the embedded SPIR-V)."""
        path = Path(path)
        if path.suffix in (".spv", ".bc"):
            if not self.kernels:
                raise StageError(f"{path.name}: the kernel was not compiled to the binary stage")
            blobs = [(k.module, k.spirv if path.suffix == ".spv" else k.bitcode) for k in self.kernels]
            if any(b is None for _, b in blobs):
                raise StageError(f"{path.name}: no device bitcode was produced")
            if len(blobs) == 1:
                path.write_bytes(blobs[0][1])
            else:
                for name, blob in blobs:
                    path.with_name(f"{path.stem}.{name}{path.suffix}").write_bytes(blob)
            path.with_suffix(".json").write_text(json.dumps(self.manifest(compiled), indent=2))
        elif path.suffix == ".json":
            path.write_text(json.dumps(self.manifest(compiled), indent=2))
        else:
            path.write_text(str(compiled.module))

    def manifest(self, compiled) -> dict:
        """What a Level Zero launcher needs: per kernel the grid, local size, subgroup size."""
        imported = compiled.imported
        return {
            "chip": self.chip.name,
            "entry": "main",
            "arguments": [{"name": f"arg{i}", "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch.")}
                          for i, s in enumerate(imported.arg_specs)],
            "results": [{"name": n, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch.")}
                        for n, s in zip(imported.result_names, imported.result_specs)],
            "weights": self.weight_specs,
            "kernels": [{"name": k.name, "module": k.module, "kind": k.kind, "computes": k.description,
                         "grid": list(k.grid), "local_size": list(k.local_size),
                         "subgroup_size": k.subgroup_size, "spirv_bytes": len(k.spirv)}
                        for k in self.kernels],
        }


# --------------------------------------------------------------------------------- helpers

def _constant(value: ir.Value) -> int:
    owner = getattr(value.owner, "operation", value.owner)
    if owner.name != "arith.constant":
        raise StageError(f"gpu.launch_func: grid size {value} is not a constant")
    return ir.IntegerAttr(owner.attributes["value"]).value


def _pick(extent: int, candidates) -> int | None:
    """The largest candidate dividing `extent`."""
    for c in candidates:
        if c <= extent and extent % c == 0:
            return c
    return None


def _has_loss_tail(module: ir.Module) -> bool:
    """Does the payload assert on indices (a gather's bounds check) or reduce to a scalar?"""
    found = []

    def visit(op):
        if op.name == "cf.assert" or (op.name == "linalg.generic" and any(
                isinstance(r.type, ir.RankedTensorType) and r.type.rank == 0 for r in op.results)):
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return bool(found)


def constants_to_arguments(module: ir.Module) -> list[dict]:
    """Dense tensor constants with more than one element (frozen weights) become trailing
    function arguments: a kernel reads them from device memory, not from a host global.
    Returns their shapes and element types, in argument order."""
    from schedules.generic import func_ops

    specs = []
    for func in func_ops(module):
        block = func.regions[0].blocks[0]
        moved = []
        for op in list(block.operations):
            op = op.operation
            if op.name != "arith.constant" or not isinstance(op.results[0].type, ir.RankedTensorType):
                continue
            t = op.results[0].type
            value = op.attributes["value"]
            if isinstance(value, ir.DenseElementsAttr) and value.is_splat:
                continue
            if t.rank == 0:
                continue
            moved.append(op)
        for op in moved:
            t = op.results[0].type
            specs.append({"argument": len(block.arguments), "shape": list(t.shape),
                          "dtype": str(t.element_type), "defined_at": str(op.location)})
            arg = block.add_argument(t, op.location)
            op.results[0].replace_all_uses_with(arg)
            op.erase()
        if moved:
            fn_type = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
            new_type = ir.FunctionType.get([a.type for a in block.arguments], list(fn_type.results))
            func.attributes["function_type"] = ir.TypeAttr.get(new_type)
    return specs


def expand_erf(module: ir.Module) -> None:
    """math.erf has no XeVM lowering: expand it into the CPU target's polynomial (exp and the
    other math ops stay native, lowered by convert-math-to-xevm)."""
    from .math_approx import expand_math

    expand_math(module, ops=("math.erf",))


def top_level_foralls(module: ir.Module) -> list[ir.Operation]:
    from schedules.generic import func_ops

    out = []
    for func in func_ops(module):
        out += [o.operation for o in func.regions[0].blocks[0].operations if o.operation.name == "scf.forall"]
    return out


def device_bitcode(module: ir.Module) -> dict[str, bytes]:
    """gpu-module-to-binary{format=llvm} on a copy: device LLVM bitcode per gpu.module."""
    copy = ir.Module.parse(str(module), module.context)
    _modules_to_binaries(copy)
    return {name: obj.object for name, (_, obj) in _binaries(copy).items()}


def embed_spirv(module: ir.Module, translated) -> None:
    """Replace each gpu.module by a gpu.binary holding its SPIR-V (`bin` format)."""
    _modules_to_binaries(module)
    by_name = {sm.name: sm for sm in translated}
    with module.context:
        for name, (op, obj) in _binaries(module).items():
            escaped = "".join(f"\\{b:02X}" for b in by_name[name].binary)
            spirv_obj = ir.Attribute.parse(f'#gpu.object<{obj.target}, bin = "{escaped}">')
            op.attributes["objects"] = ir.ArrayAttr.get([spirv_obj])


def _modules_to_binaries(module: ir.Module) -> None:
    from schedules.common import run_passes

    run_passes(module, "gpu-module-to-binary{format=llvm}")


def _binaries(module: ir.Module) -> dict:
    from torch_mlir.dialects import gpu

    out = {}
    for op in module.body.operations:
        if op.operation.name == "gpu.binary":
            obj = gpu.ObjectAttr(op.operation.attributes["objects"][0])
            out[ir.StringAttr(op.operation.attributes["sym_name"]).value] = (op.operation, obj)
    return out
