"""The Intel GPU target: XeGPU workgroup-level code with DPAS, lowered to XeVM and SPIR-V.

Stages after `import` and `cleanup` (each nameable with --emit / --stop-after); `fuse` to
`xegpu-layouts` are the named sequences of the compile's one transform script (@fuse,
@workgroups, @subgroups, @vectorize, @bufferize, @gpu_outline, @xegpu, @xegpu_layouts),
built by `XeGpuTarget.schedule` from the payload after cleanup: the fuse part is applied to
a trial copy, then every later stage is recorded step by step on that trial
(schedules.script.StepRecorder), the Python that plans a step reading the trial as the steps
before left it and writing its decisions (tiles, subgroup layouts, thread counts, the chip,
prefetch distance and layouts) into the script:
  fuse           the family's fused schedule (target independent; attention's with the
                 target's `attention_tiles`, the linear cross-entropy's with its
                 `linear_cross_entropy_tiles`); for the generic, matmul and cross_entropy
                 families the GPU preparation only (unit dims folded, asserts split)
  workgroups     weights frozen as constants become kernel arguments
                 (transform_ext.constants_to_arguments); every kernel becomes one
                 `scf.forall` whose iterations are workgroups: a contraction kernel
                 (matmul + prologue + epilogue) tiled [wg_m, wg_n] with a k loop, a row kernel
                 (softmax, norms) tiled by rows with its whole producer chain (long rows of a
                 softmax in column loops), the attention family's query-block forall as it is
                 with the K / V chains fused into its key loops (schedules/attention/xegpu.py),
                 a cross-entropy loss's kernels (schedules/cross_entropy/xegpu.py), the
                 linear cross-entropy's row-block forall and its reduction kernel
                 (schedules/linear_cross_entropy/xegpu.py)
  subgroups      each workgroup forall annotated with its decomposition over subgroups
                 (xegpu.sg_layout x xegpu.sg_data, xegpu.threads), validated against the chip
  vectorize      whole-tile vectors, type extensions folded into vector.contract, contract
                 operands narrowed to f16/bf16 (DPAS), accumulators hoisted out of loops;
                 after the script's @vectorize the stage expands math.erf (no XeVM lowering)
  bufferize      one-shot bufferization, results as out-parameters
  gpu-outline    forall -> gpu.launch (threads per the subgroup decomposition) ->
                 gpu-kernel-outlining -> xevm-attach-target{chip}; each gpu.module annotated
                 `lh.kernel = {kind, description, threads, grid}`, the module
                 `lh.weights = [{argument, shape, dtype, defined_at}]`
  xegpu          convert-vector-to-xegpu (2-D block loads/stores, xegpu.dpas)
  xegpu-layouts  anchor layouts (sg_layout / sg_data / inst_data) and prefetches
  xevm           gpu-lower-to-xevm-pipeline{xegpu-op-level=workgroup} (device LLVM + host)
  binary         SPIR-V per kernel (validated by spirv-val, see spirv.py) embedded in the
                 host module as gpu.binary (what Level Zero's zeModuleCreate loads); the
                 device LLVM bitcode (gpu-module-to-binary{format=llvm}) is kept for `-o *.bc`;
                 the `lh.kernel` / `lh.weights` annotations become the kernels' artifacts
                 (the launch manifest) and leave the IR; each kernel's `lh.work` (DPAS FLOPs
                 and block IO bytes counted on the xegpu-layouts IR, kernel_work.py) goes to
                 its gpu.object's properties
  native         each kernel's SPIR-V compiled by Intel's ocloc for the chip (ocloc.py: 128
                 registers per thread, 256 when that spills); the GRF mode goes to the
                 gpu.object's properties (`grf`) and the manifest, the device binary and its
                 machine code's figures to the artifacts (`-o kernel.bin`, `--report` with
                 the static estimate of estimate.py)
No stage keeps state on the target for a later one: a schedule stage reruns from the dump of
the stage before with the script, xevm and binary from the xegpu-layouts dump, native from
the binary dump.
There is no Intel GPU here: the target has no `jit`; it is checked through its IR, its
validated SPIR-V and the machine code Intel's compiler makes of it, and the numerics through
the CPU target running the same fused schedule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch_mlir import ir

from transform_ext.common import ops_named
from transform_ext.expand_math import expand_math

from ..errors import LighthouseError, StageError, UnsupportedError
from ..pipeline import Stage


@dataclass(frozen=True)
class Chip:
    """What the schedules need to know about one Intel GPU generation, and the peaks of the
    product the static estimate is measured against (lighthouse/targets/estimate.py)."""

    name: str                          # also ocloc's -device
    subgroup_size: int                 # lanes per subgroup (SIMD width of the kernels)
    dpas: tuple[int, int, int]         # DPAS M x N x K for f16/bf16 with f32 accumulation
    max_workgroup_threads: int         # lanes per workgroup
    grf_bytes: int                     # register file of one hardware thread (large GRF)
    block_width_bytes: int             # 2-D block load: max row width in bytes
    block_height: int                  # 2-D block load: max rows
    xe_cores: int
    product: str = ""
    eus_per_core: int = 8              # vector engines (each with one XMX engine) per Xe-core
    clock_ghz: float = 1.0             # the clock of the product's peak figures
    xmx_flops_per_clock: int = 512     # f16/bf16 dense FLOPs per clock of one XMX engine
    dram_gbps: float = 1.0             # memory bandwidth, GB/s

    @property
    def peak_flops(self) -> float:
        """f16/bf16 DPAS FLOP/s of the whole chip."""
        return self.xe_cores * self.eus_per_core * self.xmx_flops_per_clock * self.clock_ghz * 1e9


# Intel's product figures: Arc B580 (Xe2, 20 Xe-cores, 160 XMX engines at 2.85 GHz: 233 TOPS
# int8 = 116.7 TFLOP/s f16, 456 GB/s GDDR6); Data Center GPU Max 1100 (Xe-HPC, 56 Xe-cores,
# 448 XMX engines at 1.55 GHz: 355.6 TFLOP/s f16, 1228.8 GB/s HBM2e).
CHIPS = {
    "bmg": Chip("bmg", 16, (8, 16, 16), 1024, 256 * 64, 64, 32, 20, "Arc B580",
                clock_ghz=2.85, xmx_flops_per_clock=256, dram_gbps=456.0),
    "pvc": Chip("pvc", 16, (8, 16, 16), 1024, 256 * 64, 64, 32, 56, "Data Center GPU Max 1100",
                clock_ghz=1.55, xmx_flops_per_clock=512, dram_gbps=1228.8),
}
DEFAULT_CHIP = "bmg"
# Plan kinds of a cross-entropy loss: its row kernel and its reductions over the rows.
LOSS_KINDS = frozenset({"cross_entropy", "row_sum"})
# Plan kinds of the two passes of an attention backward (schedules/attention/xegpu_backward.py)
BACKWARD_KINDS = frozenset({"attention_dq", "attention_dkv"})
# Plan kind of the fused linear cross-entropy forward (schedules/linear_cross_entropy/xegpu.py)
LINEAR_CE_KIND = "linear_cross_entropy"
# Plan kinds of its backward's two passes (schedules/linear_cross_entropy/xegpu_backward.py)
LINEAR_CE_BACKWARD_KINDS = frozenset({"linear_cross_entropy_dh", "linear_cross_entropy_dw"})
# Workgroup tiles [m, n] of contraction kernels, largest first.
WORKGROUP_TILES = ((256, 256), (256, 128), (128, 256), (128, 128), (64, 128), (128, 64),
                   (64, 64), (32, 64), (64, 32), (32, 32), (16, 32), (8, 32), (16, 16), (8, 16))


@dataclass(frozen=True)
class XeGpuParams:
    """Overrides of the shape-derived choices; None = chosen from the shapes and the chip.

    wg: workgroup tile [m, n] of contraction kernels; sg: subgroup tile [m, n]; k_tile:
    reduction step (elements of K per loop iteration; the linear cross-entropy's step over
    D, forward and backward); nb_prefetch: prefetch distance of the
    k loop in iterations; rows: rows per workgroup of row kernels (softmax, norms);
    attention_sg_rows: query rows per subgroup of attention kernels (default: the most that
    fit the register file, schedules/attention/xegpu.py); column_tile: columns per
    step of the column loops of long-row kernels (softmax; default: chosen from the
    registers)."""

    wg: tuple[int, int] | None = None
    sg: tuple[int, int] | None = None
    k_tile: int | None = None
    nb_prefetch: int = 1
    rows: int | None = None
    attention_sg_rows: int | None = None
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

    kind: str                 # "contraction" | "rows" | "attention" | a LOSS_KINDS kind
    description: str
    tiles: object             # ContractionTiles | RowTiles | AttentionTiles | loss tiles

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
    work: dict | None = None          # kernel_work.KernelWork fields (None: not countable)
    native: bytes | None = None       # the native stage's device binary
    machine: object | None = None     # its ocloc.MachineCode (GRF mode, spills, dpas, ...)


@dataclass
class XeGpuSchedule:
    """The compile's script on this target and the kernels it plans (in launch order)."""

    script: ir.Module
    plans: list[KernelPlan]


# The sequences of the script after @fuse, one per schedule stage: (stage, symbol, doc).
SCRIPT_STAGES = (
    ("workgroups", "workgroups", "kernels tiled into workgroup foralls"),
    ("subgroups", "subgroups", "subgroup decomposition of each workgroup tile"),
    ("vectorize", "vectorize", "whole-tile vectors, DPAS operand types"),
    ("bufferize", "bufferize", "one-shot bufferize, out-params"),
    ("gpu-outline", "gpu_outline", "gpu.launch, kernel outlining, xevm target"),
    ("xegpu", "xegpu", "convert-vector-to-xegpu"),
    ("xegpu-layouts", "xegpu_layouts", "anchor layouts and prefetches"),
)
# What the script leaves for the xevm and binary stages and the launch manifest: on each
# gpu.module its kernel ({kind, description, threads, grid}), on the module the weights
# that became arguments ([{argument, shape, dtype, defined_at}]). The binary stage reads
# and removes them.
KERNEL_ATTR = "lh.kernel"
WEIGHTS_ATTR = "lh.weights"
# The work of each kernel (kernel_work.KernelWork as a dictionary of integers), written on
# its gpu.module by @xegpu_layouts; the binary stage keeps it in the gpu.object's properties
# (`work`), where the native stage adds the GRF mode the launch must use (`grf`).
WORK_ATTR = "lh.work"


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
    # the attention backward in two passes (schedules/attention/xegpu_backward.py): query
    # blocks of 64 rows with keys in steps of 32 (dQ), key blocks of 64 with query rows in
    # steps of 16 (dK, dV): 8 subgroups of 8 rows each, within the register file
    attention_backward_tiles = (64, 32, 64, 16)
    # the linear cross-entropy forward (schedules/linear_cross_entropy/xegpu.py): blocks of
    # 64 rows (8 subgroups of 8), the logits in tiles of 64 x 32 classes per loop step,
    # per-row data in lane form of a subgroup's 16 lanes
    linear_cross_entropy_tiles = (64, 32, 16)

    def __init__(self, chip: str | None = None, params: XeGpuParams | None = None):
        chip = chip or DEFAULT_CHIP
        if chip not in CHIPS:
            raise UnsupportedError(f"unknown --chip {chip!r}; chips are: {', '.join(CHIPS)}")
        self.chip = CHIPS[chip]
        self.params = params or XeGpuParams()
        self.options: tuple = ()          # the kernel file's LIGHTHOUSE dict, as sorted pairs
        # the artifacts of the binary and native stages (read from the IR they translate)
        self.kernels: list[KernelArtifact] = []
        self.weight_specs: list[dict] = []

    # ------------------------------------------------------------------ pipeline assembly
    def script(self, family, payload) -> ir.Module:
        """The compile's whole script (see `schedule`)."""
        return self.schedule(family, payload).script

    def schedule(self, family, payload) -> XeGpuSchedule:
        """The script of `family` on this target: its @fuse (the family's own; the GPU
        preparation for a family whose `gpu_form` is "tiled" or "loss"), then one sequence per XeGPU schedule
        stage (SCRIPT_STAGES), each recorded step by step on a trial copy of `payload`
        (after cleanup; read, not rewritten) that the fuse stage has run on: the Python
        that plans a step reads the trial as the previous steps left it, and what it
        decides is written in the script. A stage whose planning fails ends the script
        before it (IncompleteScript: the error is raised when that stage runs)."""
        from schedules.script import IncompleteScript, StepRecorder, apply_stage, build_script
        from schedules.xegpu.common import gpu_preparation_script

        if family.gpu_form in ("tiled", "loss"):
            # the family's @fuse tiles for the host CPU; the workgroups stage tiles for the GPU
            fuse = gpu_preparation_script()
        else:
            fuse = family.script(payload, self)
        fuse_names = [ir.StringAttr(op.operation.attributes["sym_name"]).value
                      for op in fuse.body.operations]
        clash = set(fuse_names) & {symbol for _, symbol, _ in SCRIPT_STAGES}
        if clash:
            raise StageError(f"the {family.name} script has sequences of the XeGPU stages "
                             f"({', '.join(sorted(clash))})")
        trial = ir.Module.parse(payload.operation.get_asm(enable_debug_info=True),
                                payload.context)
        apply_stage(trial, fuse, "fuse")
        rec = StepRecorder(trial, reserved=fuse_names)
        builder = _StageBuilder(self, family, rec)
        stages, failure = [], None
        for stage, symbol, _ in SCRIPT_STAGES:
            start = len(rec.steps)
            try:
                builder.record(stage)
            except LighthouseError as exc:
                failure = (stage, exc)
                del rec.steps[start:]
                break
            names = [name for name, _ in rec.steps[start:]]
            stages.append((symbol, _including(names)))
        script = build_script(stages, rec.steps)
        mine = list(script.body.operations)
        ip = ir.InsertionPoint(mine[0]) if mine else ir.InsertionPoint(script.body)
        for op in fuse.body.operations:
            op.operation.clone(ip=ip)
        if failure is not None:
            raise IncompleteScript(script, *failure)
        return XeGpuSchedule(script, builder.plans)

    def adapt_front(self, family, front: list[Stage], script) -> list[Stage]:
        """The script's fuse stays (the family's, or the GPU preparation, see `schedule`);
        the script's XeGPU stages follow it (their sequences replace the family's
        vectorize)."""
        if family.gpu_form is None:
            raise UnsupportedError(f"the {family.name} schedule has no GPU lowering; use the "
                                   f"default schedule")
        by_name = {s.name: s for s in front}
        stages = [by_name["import"], by_name["cleanup"], by_name["fuse"]]
        for stage, _, doc in SCRIPT_STAGES:
            stages.append(script.stage(stage, doc))
        return stages

    def stages(self) -> list[Stage]:
        return [
            Stage("xevm", self.xevm, "XeGPU -> XeVM -> LLVM (device) and host launch code"),
            Stage("binary", self.binary, "validated SPIR-V kernels embedded in the host module"),
            Stage("native", self.native, f"each kernel compiled by Intel's ocloc for "
                  f"{self.chip.name}, in the GRF mode it needs"),
        ]

    # ----------------------------------------------------------------------------- stages
    def xevm(self, module: ir.Module) -> None:
        from schedules.common import run_passes
        from schedules.xegpu.common import XEVM_PIPELINE

        run_passes(module, XEVM_PIPELINE)

    def binary(self, module: ir.Module) -> None:
        """SPIR-V per gpu.module, checked against the kernel the script annotated it with
        (KERNEL_ATTR); the annotations are read into the artifacts and removed."""
        from . import spirv

        kernels_of, works = {}, {}
        for gm in spirv.gpu_modules(module):
            name = ir.StringAttr(gm.attributes["sym_name"]).value
            if WORK_ATTR in gm.attributes:
                works[name] = ir.DictAttr(gm.attributes[WORK_ATTR])
                del gm.attributes[WORK_ATTR]
            if KERNEL_ATTR not in gm.attributes:
                raise StageError(f"gpu.module @{ir.StringAttr(gm.attributes['sym_name']).value}: "
                                 f"no {KERNEL_ATTR} annotation (the script's @gpu_outline "
                                 "writes it)")
            kernels_of[ir.StringAttr(gm.attributes["sym_name"]).value] = \
                _kernel_annotation(gm.attributes[KERNEL_ATTR])
            del gm.attributes[KERNEL_ATTR]
        weights = []
        if WEIGHTS_ATTR in module.operation.attributes:
            weights = _weights_annotation(module.operation.attributes[WEIGHTS_ATTR])
            del module.operation.attributes[WEIGHTS_ATTR]
        translated = spirv.translate(module, self.chip.subgroup_size)
        bitcode = device_bitcode(module)
        kernels = []
        for sm in translated:
            if len(sm.entry_points) != 1:
                raise StageError(f"gpu.module @{sm.name}: expected one kernel entry point, "
                                 f"found {len(sm.entry_points)}")
            kind, description, threads, grid = kernels_of[sm.name]
            entry = sm.entry_points[0]
            if entry.local_size != (threads, 1, 1) or entry.subgroup_size != self.chip.subgroup_size:
                raise StageError(f"kernel {entry.name}: SPIR-V local size {entry.local_size} / "
                                 f"subgroup size {entry.subgroup_size}, expected "
                                 f"({threads}, 1, 1) / {self.chip.subgroup_size}")
            grid = tuple(grid) + (1,) * (3 - len(grid))
            work = works.get(sm.name)
            kernels.append(KernelArtifact(entry.name, sm.name, kind, description, grid,
                                          entry.local_size, entry.subgroup_size, sm.binary,
                                          bitcode.get(sm.name), _integers(work)))
        embed_spirv(module, translated, works)
        self.kernels, self.weight_specs = kernels, weights

    def native(self, module: ir.Module) -> None:
        """Each gpu.binary's SPIR-V compiled by ocloc for the chip (ocloc.build: 128
        registers per thread, 256 when that spills); the GRF mode is written in the object's
        properties (`grf`), the device binary and its machine code go to the artifacts."""
        from . import ocloc

        by_module = {k.module: k for k in self.kernels}
        with module.context:
            for name, (op, obj) in _binaries(module).items():
                build = ocloc.build(bytes(obj.object), self.chip.name, f"kernel @{name}")
                properties = ({e.name: e.attr for e in ir.DictAttr(obj.properties)}
                              if obj.properties else {})
                properties["grf"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64),
                                                       build.machine.grf)
                op.attributes["objects"] = ir.ArrayAttr.get([_object(obj, properties)])
                kernel = by_module.get(name)
                if kernel is None:   # rerun from the binary stage's dump: no artifacts yet
                    kernel = KernelArtifact(name, name, "", "", (1, 1, 1), (1, 1, 1),
                                            self.chip.subgroup_size, bytes(obj.object),
                                            work=_integers(properties.get("work")))
                    self.kernels.append(kernel)
                kernel.native, kernel.machine = build.binary, build.machine

    # ------------------------------------------------------------------------ artifacts
    def emit_artifact(self, compiled, stage: str, path: Path | None) -> bool:
        """`--emit binary -o F.spv` writes the SPIR-V, `--emit native -o F.bin` the device
        binary; other stages print IR as usual."""
        suffixes = {"binary": (".spv", ".bc", ".json"), "native": (".spv", ".bc", ".json", ".bin")}
        if path is not None and path.suffix in suffixes.get(stage, ()):
            self.write_artifact(compiled, path)
            return True
        return False

    def write_artifact(self, compiled, path: Path) -> None:
        """By suffix: .spv SPIR-V (one kernel, or <stem>.<gpu.module>.spv each), .bc device LLVM
        bitcode, .bin the chip's device binary (the native stage's), .json launch manifest
        (grid, local size, subgroup size, GRF mode, arguments), anything else the final IR
        (host module with the embedded SPIR-V)."""
        path = Path(path)
        if path.suffix in (".spv", ".bc", ".bin"):
            if not self.kernels:
                raise StageError(f"{path.name}: the kernel was not compiled to the binary stage")
            field = {".spv": "spirv", ".bc": "bitcode", ".bin": "native"}[path.suffix]
            blobs = [(k.module, getattr(k, field)) for k in self.kernels]
            if any(b is None for _, b in blobs):
                what = {"bitcode": "device bitcode",
                        "native": "device binary (the native stage did not run)"}[field]
                raise StageError(f"{path.name}: no {what} was produced")
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

    def report(self) -> str:
        """Per kernel: the native machine code's figures and the static estimate
        (lighthouse/targets/estimate.py); StageError before the native stage ran."""
        from .estimate import format_report
        from .ocloc import find_ocloc, ocloc_version

        if not any(k.machine for k in self.kernels):
            raise StageError("--report needs the native stage (the compile stopped before it)")
        return format_report(self.kernels, self.chip, ocloc_version(find_ocloc()))

    def manifest(self, compiled) -> dict:
        """What a Level Zero launcher needs: per kernel the grid, local size, subgroup size,
        and after the native stage the GRF mode to build or load it with (`grf`: 256 means
        the SPIR-V is built with -ze-opt-large-register-file) and its machine code's figures."""
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
                         "subgroup_size": k.subgroup_size, "spirv_bytes": len(k.spirv),
                         **_native_entry(k)}
                        for k in self.kernels],
        }


class _StageBuilder:
    """Records the XeGPU stages of one script on `rec` (its trial is the payload after
    @fuse); `plans` are the kernels planned at the workgroups stage, in launch order."""

    def __init__(self, target: XeGpuTarget, family, rec):
        self.target, self.chip, self.params = target, target.chip, target.params
        self.family = family
        self.rec = rec
        self.plans: list[KernelPlan] = []
        self.weights: list[dict] = []

    def record(self, stage: str) -> None:
        """Record the steps of `stage`; an error of the planning is the stage's failure."""
        from ..pipeline import describe_failure

        method = getattr(self, stage.replace("-", "_"))
        try:
            method()
        except LighthouseError:
            raise
        except Exception as exc:
            raise StageError(f"stage {stage!r} failed: {describe_failure(exc, [])}") from exc

    @property
    def trial(self) -> ir.Module:
        return self.rec.trial

    def _loss(self) -> bool:
        return any(p.kind in LOSS_KINDS for p in self.plans)

    # ----------------------------------------------------------------------------- stages
    def workgroups(self) -> None:
        from schedules.generic import func_ops
        from schedules.xegpu.contraction import find_contraction_groups, tile_kernel
        from schedules.xegpu.rows import find_row_roots, tile_rows

        self._constants_to_arguments()
        if self.family.gpu_form == "loss" and _has_loss_tail(self.trial):
            self._loss_kernels()
            return
        for func in list(func_ops(self.trial)):
            top = [o.operation for o in func.regions[0].blocks[0].operations]
            existing = [o for o in top if o.name == "scf.forall"]
            if existing:
                self._fused_kernels(func, existing)
                continue
            if self.family.gpu_form == "fused":
                raise UnsupportedError(
                    "xegpu: the attention schedule left no query-block forall to map to "
                    "workgroups (a single query block, B * H * S / query_tile = 1?); lower "
                    "query_tile in the kernel's LIGHTHOUSE dict")
            _refuse_windowed_ops(func)
            work = []
            for group in find_contraction_groups(func):
                work.append((top.index(group.root), "contraction", group))
            for root in find_row_roots(func, exclude=[o for _, _, g in work for o in g.ops()]):
                work.append((top.index(root), "rows", root))
            work.sort(key=lambda w: w[0])
            for _, kind, item in work:
                if kind == "contraction":
                    tiles = self.contraction_tiles(item)
                    plan = KernelPlan(kind, item.describe(), tiles)
                    tile_kernel(self.rec, item, tiles)
                else:
                    tiles = self.row_tiles(item)
                    plan = KernelPlan(kind, f"{item.name} at {item.location}", tiles)
                    tile_rows(self.rec, item, tiles)
                self.plans.append(plan)
        if not self.plans:
            raise UnsupportedError("xegpu: the payload has no linalg op to run on the GPU")

    def _constants_to_arguments(self) -> None:
        """Weights frozen as constants become kernel arguments (their specs noted for the
        launch metadata)."""
        from schedules.common import match
        from schedules.generic import func_ops
        from transform_ext.constants_to_arguments import constants_to_arguments, frozen_weights

        for func in func_ops(self.trial):
            arguments = len(func.regions[0].blocks[0].arguments)
            for i, op in enumerate(frozen_weights(func)):
                t = op.results[0].type
                self.weights.append({"argument": arguments + i, "shape": list(t.shape),
                                     "dtype": str(t.element_type),
                                     "defined_at": str(op.location)})
        def body(root):
            constants_to_arguments(match(root, "func.func"))

        self.rec.step("constants_to_arguments", body)

    def _loss_kernels(self) -> None:
        """A cross-entropy loss: the host target check, the row kernel and the reductions
        over the rows (schedules/cross_entropy/xegpu.py)."""
        from schedules.cross_entropy.xegpu import lower_loss
        from schedules.cross_entropy.xegpu_plan import NotLowerable

        try:
            kernels = lower_loss(self.rec, subgroup_size=self.chip.subgroup_size,
                                 max_threads=self.chip.max_workgroup_threads,
                                 min_workgroups=self.chip.xe_cores, rows=self.params.rows,
                                 column_tile=self.params.column_tile)
        except NotLowerable as exc:
            raise UnsupportedError(f"xegpu: {exc}") from exc
        self.plans = [KernelPlan(k.kind, k.description, k.tiles) for k in kernels]

    def _fused_kernels(self, func, foralls) -> None:
        """Foralls of a fused schedule (one per kernel) become workgroup grids as they are;
        payload ops outside them are refused (they would need kernels of their own)."""
        from schedules.attention.xegpu import attention_forall, plan_attention, tile_attention
        from schedules.attention.xegpu_backward import (backward_foralls, backward_pass_of,
                                                        plan_backward_pass, tile_backward)
        from schedules.linear_cross_entropy import xegpu as linear_ce

        chip = dict(sg_rows=self.params.attention_sg_rows, subgroup_size=self.chip.subgroup_size,
                    dpas=self.chip.dpas, max_threads=self.chip.max_workgroup_threads,
                    grf_bytes=self.chip.grf_bytes, nb_prefetch=self.params.nb_prefetch)
        row_blocks = linear_ce.row_block_forall(func)
        if row_blocks is not None:
            self._linear_cross_entropy_kernel(func, row_blocks, chip)
            return
        forward = attention_forall(func)
        passes = backward_foralls(func)
        is_forward = lambda f: forward is not None and f == forward
        unknown = [f for f in foralls if not is_forward(f) and f not in passes]
        if unknown:
            raise UnsupportedError(
                f"xegpu: {len(unknown)} scf.forall of a fused schedule that is neither an "
                "attention nor a pass of its backward: no GPU mapping for it yet")
        for forall in foralls:
            try:
                if is_forward(forall):
                    tiles = plan_attention(forall, **chip)
                else:
                    tiles = plan_backward_pass(forall, **chip)
            except ValueError as exc:
                raise UnsupportedError(f"xegpu: {exc}") from exc
            if is_forward(forall):
                tile_attention(self.rec, tiles)
                plan = KernelPlan("attention", f"attention at {forall.location}", tiles)
            else:
                tile_backward(self.rec, tiles)
                plan = KernelPlan(tiles.kind, f"attention backward pass "
                                  f"{backward_pass_of(forall)} at {forall.location}", tiles)
            self.plans.append(plan)

    def _linear_cross_entropy_kernel(self, func, forall, chip) -> None:
        """The fused linear cross-entropy forward: its row-block forall as one kernel, the
        reductions over the rows after it as the cross-entropy's reduction kernel, the
        target checks on the host (schedules/linear_cross_entropy/xegpu.py)."""
        from schedules.generic import func_ops
        from schedules.linear_cross_entropy import xegpu as linear_ce

        try:
            tiles = linear_ce.plan_linear_cross_entropy(
                forall, depth_tile=self.params.k_tile, **{**chip, "sg_rows": None})
        except ValueError as exc:
            raise UnsupportedError(f"xegpu: {exc}") from exc
        forward = KernelPlan(LINEAR_CE_KIND, f"linear cross-entropy forward at "
                             f"{forall.location}", tiles)
        linear_ce.tile_linear_cross_entropy(self.rec, tiles)
        (func,) = func_ops(self.trial)
        passes = self._linear_cross_entropy_backward(func)
        (func,) = func_ops(self.trial)
        after, other = linear_ce.row_sum_ops(func)
        if other and _reads_a_pass(other[0]):
            raise UnsupportedError(
                f"xegpu: linear cross-entropy backward: {other[0].name} at {other[0].location} "
                "reads a pass's gradient (the transpose of the gradient of a transposed view "
                "of h or W) and has no kernel yet; give h and W as stored")
        if other:
            raise UnsupportedError(
                f"xegpu: linear cross-entropy: {other[0].name} at {other[0].location} is "
                "outside the fused forward and no reduction over the rows: no kernel for it")
        row_sums = None
        if after:
            rows = tiles.rows * tiles.grid[0]
            sums = linear_ce.lower_row_sums(self.rec, rows, self.chip.subgroup_size)
            row_sums = KernelPlan(sums.kind, sums.description, sums.tiles)
        # in launch order: the forward, then the passes and the reductions over the rows as
        # the reduction kernel's outlining placed it (before the passes when they read its
        # count, else after them)
        from schedules.linear_cross_entropy.xegpu_backward import backward_pass_of
        from transform_ext.fuse_linear_cross_entropy_backward_two_pass import BACKWARD_PASS

        for kernel in top_level_foralls(self.trial):
            if linear_ce.ROW_BLOCKS in kernel.attributes:
                self.plans.append(forward)
            elif BACKWARD_PASS in kernel.attributes:
                self.plans.append(passes[backward_pass_of(kernel) - 1])
            elif row_sums is not None:
                self.plans.append(row_sums)

    def _linear_cross_entropy_backward(self, func) -> list[KernelPlan]:
        """The fused backward's two passes as kernels, their per-row producers fused in
        (schedules/linear_cross_entropy/xegpu_backward.py); their plans, in launch order."""
        from schedules.generic import func_ops
        from schedules.linear_cross_entropy import xegpu_backward as backward

        chip = dict(subgroup_size=self.chip.subgroup_size, dpas=self.chip.dpas,
                    max_threads=self.chip.max_workgroup_threads, grf_bytes=self.chip.grf_bytes,
                    nb_prefetch=self.params.nb_prefetch)
        plans = []
        for index in range(len(backward.backward_pass_foralls(func))):
            # the trial as the steps before left it (a tiled pass is a new op)
            (now,) = func_ops(self.trial)
            forall = backward.backward_pass_foralls(now)[index]
            try:
                tiles = backward.plan_backward_pass(forall, depth_tile=self.params.k_tile,
                                                    **chip)
            except ValueError as exc:
                raise UnsupportedError(f"xegpu: {exc}") from exc
            description = (f"linear cross-entropy backward pass {tiles.backward_pass} at "
                           f"{forall.location}")
            backward.tile_backward_pass(self.rec, tiles)
            plans.append(KernelPlan(tiles.kind, description, tiles))
        return plans

    def subgroups(self) -> None:
        """Each workgroup forall annotated with its subgroup decomposition (xegpu.sg_layout,
        xegpu.sg_data) and its thread count (xegpu.threads)."""
        from schedules.common import annotate, at_place, place_of

        foralls = top_level_foralls(self.trial)
        if len(foralls) != len(self.plans):
            raise StageError(f"expected {len(self.plans)} workgroup foralls, found {len(foralls)}")
        i64 = ir.IntegerType.get_signless(64)
        annotations = []
        for forall, plan in zip(foralls, self.plans):
            tiles = plan.tiles
            if plan.threads > self.chip.max_workgroup_threads:
                raise UnsupportedError(
                    f"xegpu: {plan.description}: {plan.threads} threads per workgroup exceed the "
                    f"{self.chip.name} limit of {self.chip.max_workgroup_threads}")
            annotations.append((place_of(self.trial.operation, forall), [
                ("xegpu.sg_layout", ir.DenseI64ArrayAttr.get(tiles.sg_layout)),
                ("xegpu.sg_data", ir.DenseI64ArrayAttr.get(list(tiles.sg_data))),
                ("xegpu.threads", ir.IntegerAttr.get(i64, plan.threads))]))

        def body(root):
            for place, attrs in annotations:
                forall = at_place(root, place)
                for name, value in attrs:
                    annotate(forall, name, value)

        self.rec.step("subgroup_layouts", body)

    def vectorize(self) -> None:
        from schedules.xegpu.common import vectorize

        if any(p.kind == LINEAR_CE_KIND for p in self.plans):
            # the logits tiles by DPAS; the lane-form target reads are scattered loads
            vectorize(self.rec, gathers=True)
        elif self._loss():
            # no contraction (no DPAS); the target gathers become scattered loads
            vectorize(self.rec, contractions=False, gathers=True)
        else:
            vectorize(self.rec)
        # math.erf has no XeVM lowering: its polynomial (exp and the other math ops stay
        # native, lowered by convert-math-to-xevm)
        self.rec.step("expand_erf", lambda root: expand_math(root, ops=("math.erf",)))

    def bufferize(self) -> None:
        from schedules.cross_entropy.xegpu import finish_bufferized
        from schedules.xegpu.common import bufferize

        bufferize(self.rec)
        if self._loss():
            finish_bufferized(self.rec)

    def gpu_outline(self) -> None:
        """Outlined kernels, then the launch metadata of each (KERNEL_ATTR on its gpu.module,
        with the grid of its launch) and the weights (WEIGHTS_ATTR on the module)."""
        from schedules.common import annotate, match
        from schedules.xegpu.common import outline
        from torch_mlir.dialects import transform

        outline(self.rec, [p.threads for p in self.plans], self.chip.name)
        launches = ops_named(self.trial, "gpu.launch_func")
        modules = [op.operation for op in self.trial.body.operations
                   if op.operation.name == "gpu.module"]
        if len(launches) != len(self.plans) or len(modules) != len(self.plans):
            raise StageError(f"expected {len(self.plans)} outlined kernels, found "
                             f"{len(modules)} gpu.module and {len(launches)} gpu.launch_func")
        i64 = ir.IntegerType.get_signless(64)
        kernels = []
        for plan, launch in zip(self.plans, launches):
            grid = [_constant(v) for v in list(launch.operands)[:3]]
            kernels.append(ir.DictAttr.get({
                "kind": ir.StringAttr.get(plan.kind),
                "description": ir.StringAttr.get(plan.description),
                "threads": ir.IntegerAttr.get(i64, plan.threads),
                "grid": ir.DenseI64ArrayAttr.get(grid)}))
        weights = ir.ArrayAttr.get([ir.DictAttr.get({
            "argument": ir.IntegerAttr.get(i64, w["argument"]),
            "shape": ir.DenseI64ArrayAttr.get(w["shape"]),
            "dtype": ir.StringAttr.get(w["dtype"]),
            "defined_at": ir.StringAttr.get(w["defined_at"])}) for w in self.weights])
        count = len(kernels)

        def body(root):
            handles = transform.SplitHandleOp([transform.AnyOpType.get()] * count,
                                              match(root, "gpu.module")).results
            for handle, kernel in zip(list(handles), kernels):
                annotate(handle, KERNEL_ATTR, kernel)
            annotate(root, WEIGHTS_ATTR, weights)

        self.rec.step("launch_metadata", body)

    def xegpu(self) -> None:
        from schedules.xegpu.common import to_xegpu

        to_xegpu(self.rec)
        leftover = len(ops_named(self.trial, "vector.contract"))
        if leftover:
            raise StageError(f"{leftover} vector.contract op(s) did not become xegpu.dpas")

    def xegpu_layouts(self) -> None:
        from schedules.attention.xegpu import annotate_attention, check_kernel
        from schedules.attention.xegpu_backward import (annotate_backward, backward_anchors,
                                                        split_loads)
        from schedules.common import match
        from schedules.cross_entropy.xegpu_layouts import (annotate_loss_kernel, kernel_anchors,
                                                           prefetch_shape)
        from schedules.linear_cross_entropy.xegpu import annotate_linear_cross_entropy
        from schedules.linear_cross_entropy.xegpu import kernel_anchors as linear_ce_anchors
        from schedules.linear_cross_entropy.xegpu_backward import (
            pass_anchors as linear_ce_pass_anchors, stores_in_lanes as linear_ce_stores_in_lanes)
        from schedules.xegpu.common import insert_loop_prefetches
        from schedules.xegpu.contraction import annotate_kernel, inspect_kernel
        from schedules.xegpu.rows import annotate_rows
        from torch_mlir.dialects import transform

        funcs = ops_named(self.trial, "gpu.func")
        count = len(funcs)
        if count != len(self.plans):
            raise StageError(f"expected {len(self.plans)} gpu.func kernels, found {count}")
        rec, chip, nb_prefetch = self.rec, self.chip, self.params.nb_prefetch
        shapes = []
        for func, plan in zip(funcs, self.plans):
            try:
                if plan.kind == "contraction":
                    shapes.append(inspect_kernel(func))
                elif plan.kind == "rows":
                    insert_loop_prefetches(rec, func, plan.tiles.sg_layout[0],
                                           (plan.tiles.rows_per_subgroup, chip.subgroup_size),
                                           nb_prefetch)
                    shapes.append(None)
                elif plan.kind == "attention":
                    insert_loop_prefetches(rec, func, plan.tiles.subgroups, chip.dpas[:2],
                                           plan.tiles.nb_prefetch)
                    check_kernel(func)
                    shapes.append(None)
                elif plan.kind in BACKWARD_KINDS:
                    insert_loop_prefetches(rec, func, plan.tiles.subgroups, chip.dpas[:2],
                                           plan.tiles.nb_prefetch)
                    split_loads(rec, func)
                    shapes.append(backward_anchors(func, plan.tiles))
                elif plan.kind in LINEAR_CE_BACKWARD_KINDS:
                    insert_loop_prefetches(rec, func, plan.tiles.subgroups, chip.dpas[:2],
                                           plan.tiles.nb_prefetch)
                    split_loads(rec, func)
                    linear_ce_stores_in_lanes(rec, func, chip.subgroup_size)
                    shapes.append(linear_ce_pass_anchors(func, plan.tiles))
                elif plan.kind in LOSS_KINDS:
                    insert_loop_prefetches(rec, func, *prefetch_shape(plan.tiles), nb_prefetch)
                    shapes.append(kernel_anchors(func, plan.tiles))
                elif plan.kind == LINEAR_CE_KIND:
                    insert_loop_prefetches(rec, func, plan.tiles.subgroups, chip.dpas[:2],
                                           plan.tiles.nb_prefetch)
                    shapes.append(linear_ce_anchors(func, plan.tiles))
                else:
                    shapes.append(None)
            except ValueError as exc:
                raise StageError(f"{plan.description}: {exc}") from exc
        plans = list(self.plans)

        def body(root):
            handles = transform.SplitHandleOp([transform.AnyOpType.get()] * count,
                                              match(root, "gpu.func")).results
            for handle, plan, shape in zip(list(handles), plans, shapes):
                if plan.kind == "contraction":
                    annotate_kernel(handle, plan.tiles, shape)
                elif plan.kind == "attention":
                    annotate_attention(handle, plan.tiles)
                elif plan.kind in BACKWARD_KINDS:
                    annotate_backward(handle, shape)
                elif plan.kind in LOSS_KINDS:
                    annotate_loss_kernel(handle, shape)
                elif plan.kind == LINEAR_CE_KIND or plan.kind in LINEAR_CE_BACKWARD_KINDS:
                    annotate_linear_cross_entropy(handle, shape)
                else:
                    annotate_rows(handle, plan.tiles)

        rec.step("anchor_layouts", body)
        self._kernel_work()

    def _kernel_work(self) -> None:
        """Each gpu.module annotated with its kernel's work (WORK_ATTR: DPAS FLOPs, block IO
        bytes, counted on the trial with every loop's trips per workgroup); a kernel whose
        loop bounds are not computed from constants and block ids gets none."""
        from schedules.common import annotate, match
        from torch_mlir.dialects import transform

        from .kernel_work import NotEvaluable, kernel_work

        i64 = ir.IntegerType.get_signless(64)
        works = []
        for func in ops_named(self.trial, "gpu.func"):
            try:
                work = kernel_work(func, self.chip.subgroup_size).as_dict()
            except NotEvaluable:
                works.append(None)
                continue
            works.append(ir.DictAttr.get({k: ir.IntegerAttr.get(i64, v) for k, v in work.items()}))
        count = len(works)

        def body(root):
            handles = transform.SplitHandleOp([transform.AnyOpType.get()] * count,
                                              match(root, "gpu.module")).results
            for handle, work in zip(list(handles), works):
                if work is not None:
                    annotate(handle, WORK_ATTR, work)

        self.rec.step("kernel_work", body)

    # ---------------------------------------------------------------------- parameters
    def contraction_tiles(self, group):
        from schedules.xegpu.contraction import ContractionTiles

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

    def row_tiles(self, root):
        from schedules.xegpu.rows import plan_rows

        try:
            return plan_rows(root, rows=self.params.rows, subgroup_size=self.chip.subgroup_size,
                             max_threads=self.chip.max_workgroup_threads,
                             min_workgroups=self.chip.xe_cores, column_tile=self.params.column_tile)
        except ValueError as exc:
            raise UnsupportedError(f"xegpu: {exc}") from exc


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


def _reads_a_pass(op: ir.Operation) -> bool:
    """Does `op` read a result of a pass of the fused linear cross-entropy backward?"""
    from transform_ext.fuse_linear_cross_entropy_backward_two_pass import BACKWARD_PASS

    for value in op.operands:
        owner = getattr(value.owner, "operation", value.owner)
        if isinstance(owner, ir.Operation) and BACKWARD_PASS in owner.attributes:
            return True
    return False


def _refuse_windowed_ops(func) -> None:
    """An UnsupportedError naming the first pooling in `func` (a named linalg.pooling_* op,
    or a linalg op indexing an operand by a sum of dims: a window): the XeGPU kernels tile
    contractions and rows, and have no form for a window yet."""
    from transform_ext.analysis.structure import all_linalg_ops, loop_structure

    for op in all_linalg_ops(func):
        windowed = op.name.startswith("linalg.pooling_") or (
            op.name == "linalg.generic" and any(
                not isinstance(e, (ir.AffineDimExpr, ir.AffineConstantExpr))
                for m in loop_structure(op).maps for e in m.results))
        if windowed:
            raise UnsupportedError(f"xegpu: {op.name} at {op.location}: a pooling window has no "
                                   f"GPU lowering yet (the CPU target compiles it)")


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


def _including(names: list[str]):
    """A stage body including the steps `names` in order."""
    from schedules.script import include_step

    def body(root):
        for name in names:
            root = include_step(name, root)

    return body


def _kernel_annotation(attr) -> tuple[str, str, int, tuple[int, ...]]:
    """(kind, description, threads, grid) of a KERNEL_ATTR dictionary."""
    d = ir.DictAttr(attr)
    return (ir.StringAttr(d["kind"]).value, ir.StringAttr(d["description"]).value,
            ir.IntegerAttr(d["threads"]).value, tuple(ir.DenseI64ArrayAttr(d["grid"])))


def _weights_annotation(attr) -> list[dict]:
    """The weight specs of a WEIGHTS_ATTR array, as the manifest lists them."""
    out = []
    for entry in ir.ArrayAttr(attr):
        d = ir.DictAttr(entry)
        out.append({"argument": ir.IntegerAttr(d["argument"]).value,
                    "shape": list(ir.DenseI64ArrayAttr(d["shape"])),
                    "dtype": ir.StringAttr(d["dtype"]).value,
                    "defined_at": ir.StringAttr(d["defined_at"]).value})
    return out


def embed_spirv(module: ir.Module, translated, works: dict | None = None) -> None:
    """Replace each gpu.module by a gpu.binary holding its SPIR-V (`bin` format), with the
    kernel's work (WORK_ATTR) as the object's `work` property."""
    _modules_to_binaries(module)
    by_name = {sm.name: sm for sm in translated}
    works = works or {}
    with module.context:
        for name, (op, obj) in _binaries(module).items():
            properties = {"work": works[name]} if name in works else {}
            op.attributes["objects"] = ir.ArrayAttr.get([_object(obj, properties,
                                                                 by_name[name].binary)])


def _object(obj, properties: dict, binary: bytes | None = None) -> ir.Attribute:
    """#gpu.object on `obj`'s target holding `binary` (default: obj's own) and `properties`."""
    blob = bytes(obj.object) if binary is None else binary
    escaped = "".join(f"\\{b:02X}" for b in blob)
    props = f"properties = {ir.DictAttr.get(properties)}, " if properties else ""
    return ir.Attribute.parse(f'#gpu.object<{obj.target}, {props}bin = "{escaped}">')


def _native_entry(kernel: KernelArtifact) -> dict:
    """The manifest's fields of a kernel the native stage compiled (none before it)."""
    mc = kernel.machine
    if mc is None:
        return {}
    return {"grf": mc.grf, "native_bytes": len(kernel.native),
            "machine_code": {"instructions": mc.instructions, "spill_bytes": mc.spill_bytes,
                             "flag_spills": mc.flag_spills, "dpas": mc.dpas,
                             "block_loads": mc.block_loads, "block_stores": mc.block_stores,
                             "block_prefetches": mc.block_prefetches},
            "work": kernel.work}


def _integers(attr) -> dict | None:
    """A dictionary attribute of integers as a dict (None stays None)."""
    if attr is None:
        return None
    return {entry.name: ir.IntegerAttr(entry.attr).value for entry in ir.DictAttr(attr)}


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
