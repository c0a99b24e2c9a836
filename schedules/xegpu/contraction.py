"""XeGPU tail of contraction kernels (matmul, linear layers, MLP): workgroup tiles, DPAS layouts.

A contraction kernel is a group of linalg ops around one contraction C = A x B:
  prologue  type conversions / transposes that only feed A or B (`arith.extf` generics,
            `linalg.transpose`), fused into the reduction loop so the DPAS reads the narrow
            data straight from memory;
  C         with its zero `linalg.fill`;
  epilogue  the chain of elementwise consumers of C (bias add, activation, truncf, ...) up
            to the next contraction's prologue, plus their small elementwise producers
            (a bias widened to f32), evaluated on the accumulator tile before the store.
Tiling (`tile_kernel`): the last epilogue op is tiled into an `scf.forall` of workgroup tiles
[wg_m, wg_n] (batch dims 1), the group is fused into it, C's reduction dim is tiled into an
`scf.for` of k_tile, and the prologue is fused into that loop.
Layouts (`annotate_kernel`, after convert-vector-to-xegpu): with sg_layout = [wg_m / sg_m,
wg_n / sg_n] subgroups, A loads [wg_m, k] as sg_data [sg_m, k], B loads [k, wg_n] as
[k, sg_n], C and the store are [sg_m, sg_n]; instruction tiles are the DPAS shapes
(A 8x16, B 16x16, C 8x16 for 16-bit inputs). Loads in the k loop get `nb_prefetch`
prefetches spread over all subgroups.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_mlir import ir
from torch_mlir.dialects import transform
from torch_mlir.dialects.transform import structured, xegpu

from transform_ext.analysis.structure import loop_structure
from transform_ext.common import defining_op
from transform_ext.match_contraction_group import (ContractionOps, contraction_groups,
                                                   is_widening, linalg_producer,
                                                   match_contraction_group,
                                                   next_contraction_group)

from ..common import any_op, canonicalize, match
from ..script import StepRecorder
from .common import DPAS_TYPES


class ContractionGroup(ContractionOps):
    """The payload ops of one contraction kernel (see the module docstring and
    transform_ext/match_contraction_group.py)."""

    def shape(self) -> dict[str, int]:
        """Extents of the contraction's m, n, k (and batch) dims."""
        ls = loop_structure(self.contraction)
        dims = ls.contraction_dims()
        out = {}
        for kind in ("batch", "m", "n", "k"):
            for j, d in enumerate(dims[kind]):
                out[kind if len(dims[kind]) == 1 else f"{kind}{j}"] = ls.ranges[d]
        return out

    def dpas_problem(self) -> str | None:
        """Why DPAS cannot multiply this contraction's operands, or None. DPAS takes f16 or
        bf16: an operand qualifies when it is 16-bit or widened from 16 bits by the prologue;
        one f32 operand computed in the kernel is rounded to the other's type (attention's P),
        two f32 operands are refused (rounding both to 16 bits would not be torch's f32
        product)."""
        types = []
        for index in (0, 1):
            source = _prologue_source(self.contraction.operands[index])
            types.append((index, source, str(ir.ShapedType(source.type).element_type)))
        if any(t in DPAS_TYPES for _, _, t in types):
            return None
        names = " and ".join(f"{'AB'[i]} ({_value_name(v)}) is {t}" for i, v, t in types)
        return (f"DPAS multiplies f16 or bf16 operands, but {names}; pass float16 "
                f"or bfloat16 inputs, or compile for the CPU")

    def describe(self) -> str:
        s = self.shape()
        return f"{self.contraction.name} [{'x'.join(str(v) for v in s.values())}] at {self.contraction.location}"


@dataclass(frozen=True)
class ContractionTiles:
    """Workgroup tile [wg_m, wg_n], subgroup tile [sg_m, sg_n], reduction step k_tile, the
    DPAS instruction shape (m, n, k), prefetch distance, and the lanes of a subgroup."""

    wg: tuple[int, int]
    sg: tuple[int, int]
    k_tile: int
    dpas: tuple[int, int, int] = (8, 16, 16)
    nb_prefetch: int = 1
    subgroup_size: int = 16

    @property
    def sg_layout(self) -> list[int]:
        return [self.wg[0] // self.sg[0], self.wg[1] // self.sg[1]]

    @property
    def sg_data(self) -> tuple[int, int]:
        return self.sg

    @property
    def subgroups(self) -> int:
        return self.sg_layout[0] * self.sg_layout[1]

    @property
    def threads(self) -> int:
        return self.subgroups * self.subgroup_size


# ------------------------------------------------------------------------------- analysis

def _prologue_source(value: ir.Value) -> ir.Value:
    """The value a contraction operand is read from, through its widening/transpose prologue."""
    p = linalg_producer(value)
    while p is not None and is_widening(p):
        value = p.operands[0]
        p = linalg_producer(value)
    return value


def _value_name(value: ir.Value) -> str:
    """'argument N' for a function argument, else the op computing the value."""
    if isinstance(value, ir.BlockArgument):
        return f"argument {value.arg_number}"
    return f"computed by {defining_op(value).name}"


def find_contraction_groups(func: ir.Operation) -> list[ContractionGroup]:
    """Contraction kernels of a function's top-level linalg ops, in program order."""
    return [ContractionGroup(g.contraction, g.fill, g.prologue, g.epilogue, g.side)
            for g in contraction_groups(func)]


# --------------------------------------------------------------------------------- tiling

def tile_kernel(rec: StepRecorder, group: ContractionGroup, tiles: ContractionTiles) -> None:
    """Workgroup forall + k loop with the group fused in (module docstring), a step of
    `rec` (the group's ops are those of its trial)."""
    c_ls = loop_structure(group.contraction)
    dims = c_ls.contraction_dims()
    root_ls = loop_structure(group.root)
    wg_of_dim = {d: 1 for d in dims["batch"]}
    wg_of_dim[dims["m"][-1]] = tiles.wg[0]
    wg_of_dim[dims["n"][-1]] = tiles.wg[1]
    for d in dims["m"][:-1] + dims["n"][:-1]:
        wg_of_dim[d] = 1
    if group.epilogue:
        # The root's loops are C's parallel loops in C's output order (elementwise, same rank).
        root_sizes = [wg_of_dim[d] for d in _dim_positions(c_ls.output_map())]
    else:  # the contraction itself: its reduction dims are not tiled here
        root_sizes = [wg_of_dim.get(d, 0) for d in range(c_ls.num_loops)]
    if len(root_sizes) != root_ls.num_loops:
        raise ValueError(f"{group.describe()}: epilogue rank differs from the contraction's")
    k_sizes = [0] * c_ls.num_loops
    k_sizes[dims["k"][-1]] = tiles.k_tile

    func = group.contraction.parent
    if next_contraction_group(func).ops() != group.ops():
        raise ValueError(f"{group.describe()}: not the next contraction kernel of its function")
    func_name = ir.StringAttr(func.attributes["sym_name"]).value
    epilogue, side, prologue = len(group.epilogue), len(group.side), len(group.prologue)
    has_fill = group.fill is not None

    def body(root):
        root_op, epilogue_ops, side_ops, contraction_op, fill, prologue_ops = \
            match_contraction_group(func_named(root, func_name))
        tiled = structured.TileUsingForallOp(root_op, tile_sizes=root_sizes,
                                             mapping=block_mapping(sum(1 for s in root_sizes if s)))
        forall = tiled.results[1]
        contraction = tiled.results[0]
        fused_ops = (split(epilogue_ops, max(epilogue - 1, 0)) + split(side_ops, side)
                     + ([contraction_op] if epilogue else []) + ([fill] if has_fill else []))
        for op in fused_ops:
            fused = structured.FuseIntoContainingOp(op, forall)
            forall = fused.new_containing_op
            if op is contraction_op:
                contraction = fused.fused_op
        tiled_k = structured.TileUsingForOp(contraction, sizes=k_sizes)
        k_loop = tiled_k.results[1]
        for op in split(prologue_ops, prologue):
            fused = structured.FuseIntoContainingOp(op, forall)
            forall = fused.new_containing_op
            fused = structured.FuseIntoContainingOp(fused.fused_op, k_loop)
            k_loop = fused.new_containing_op
        canonicalize(match(root, "func.func"))

    rec.step("tile_contraction_kernel", body)


def block_mapping(n: int) -> ir.ArrayAttr:
    """#gpu.block mapping of an n-d workgroup forall (it also keeps a one-workgroup forall
    from being folded away)."""
    names = ["x", "y", "z"][:n][::-1]
    return ir.ArrayAttr.get([ir.Attribute.parse(f"#gpu.block<{d}>") for d in names])


def split(handle: ir.Value, count: int) -> list[ir.Value]:
    """`count` handles, one per payload op of `handle` in its order (the handle itself when
    `count` is 1, none when 0); a handle of another size fails the schedule."""
    if count <= 1:
        return [handle][:count]
    return list(transform.SplitHandleOp([any_op()] * count, handle).results)


def func_named(root: ir.Value, name: str) -> ir.Value:
    """The func.func under `root` with the symbol name `name`."""
    return structured.MatchOp(any_op(), root, ops=["func.func"],
                              op_attrs={"sym_name": ir.StringAttr.get(name)}).result


def _dim_positions(amap) -> list[int]:
    return [e.position for e in amap.results]


# -------------------------------------------------------------------------------- layouts

def _layout(sg_layout, sg_data, inst_data=None) -> dict:
    out = {"sg_layout": list(sg_layout), "sg_data": list(sg_data)}
    if inst_data is not None:
        out["inst_data"] = list(inst_data)
    return out


def prefetch_layout(rows: int, cols: int, subgroups: int, inst: tuple[int, int]) -> dict:
    """Spread a [rows, cols] prefetch over `subgroups`: as many column splits as keep a
    subgroup's piece at least one instruction wide, the rest over rows."""
    best = None
    for c in range(1, subgroups + 1):
        if subgroups % c or cols % c or (cols // c) % inst[1]:
            continue
        r = subgroups // c
        if rows % r or (rows // r) % inst[0]:
            continue
        best = (r, c)
        if cols // c <= 32:
            break
    if best is None:
        return _layout([1, 1], [rows, cols], inst)
    r, c = best
    return _layout([r, c], [rows // r, cols // c], inst)


@dataclass(frozen=True)
class KernelShape:
    """What the layout schedule must know of one outlined kernel's XeGPU ops: whether the
    A / B tiles are loaded transposed (a `vector.transpose` between load and DPAS) and how
    many 1-D gathers feed a broadcast along the rows (a bias)."""

    transpose_a: bool = False
    transpose_b: bool = False
    row_broadcast_loads: int = 0
    in_loop: bool = True            # False when K fits one k tile: no loop, no prefetch


def inspect_kernel(gpu_func: ir.Operation) -> KernelShape:
    """Read a KernelShape from a gpu.func after convert-vector-to-xegpu."""
    found = {"dpas": [], "load": []}

    def visit(op):
        if op.name == "xegpu.dpas":
            found["dpas"].append(op)
        elif op.name == "xegpu.load":
            found["load"].append(op)
        return ir.WalkResult.ADVANCE

    gpu_func.walk(visit)
    if len(found["dpas"]) != 1:
        raise ValueError(f"a contraction kernel has {len(found['dpas'])} xegpu.dpas ops, expected 1")
    dpas = found["dpas"][0]

    def transposed(value):
        owner = defining_op(value)
        return owner is not None and owner.name == "vector.transpose"

    rows = 0
    for load in found["load"]:
        users = [getattr(u.owner, "operation", u.owner) for u in load.results[0].uses]
        while len(users) == 1 and users[0].name in ("arith.extf", "arith.truncf"):
            users = [getattr(u.owner, "operation", u.owner) for u in users[0].results[0].uses]
        ok = bool(users) and all(u.name == "vector.broadcast" and
                                 len(ir.VectorType(u.results[0].type).shape) == 2 for u in users)
        if not ok:
            raise ValueError(f"{load.location}: a 1-D gather that is not a row broadcast has no "
                             "layout in contraction kernels")
        rows += 1
    parent = dpas.parent
    while parent is not None and parent.name not in ("scf.for", "gpu.func"):
        parent = parent.parent
    in_loop = parent is not None and parent.name == "scf.for"
    return KernelShape(transposed(dpas.operands[0]), transposed(dpas.operands[1]), rows, in_loop)


def annotate_kernel(gpu_func: ir.Value, tiles: ContractionTiles, shape: KernelShape) -> None:
    """Anchor layouts on the DPAS, its loads and prefetches, and the stores of one gpu.func
    (transform IR at the current insertion point; `gpu_func` is a handle). A transposed
    load carries the operand's layout with sg_layout / sg_data reversed and order [0, 1];
    the DPAS then takes the transposed vector in order [1, 0]."""
    anyv = transform.AnyValueType.get()
    dm, dn, dk = tiles.dpas
    wg_m, wg_n = tiles.wg
    sg_m, sg_n = tiles.sg
    k = tiles.k_tile
    a = _layout(tiles.sg_layout, [sg_m, k], [dm, dk])
    b = _layout(tiles.sg_layout, [k, sg_n], [dk, dn])
    c = _layout(tiles.sg_layout, [sg_m, sg_n], [dm, dn])
    dpas = match(gpu_func, "xegpu.dpas")
    operands = ((0, a, (wg_m, k), shape.transpose_a), (1, b, (k, wg_n), shape.transpose_b))
    for index, lay, tile, transposed in operands:
        load = xegpu.get_load_op(transform.get_operand(anyv, dpas, [index]))
        load_layout, dpas_layout = dict(lay), dict(lay)
        if transposed:
            load_layout = {**lay, "sg_layout": lay["sg_layout"][::-1], "sg_data": lay["sg_data"][::-1],
                           "order": [0, 1]}
            dpas_layout = {**lay, "order": [1, 0]}
            tile = tile[::-1]
        if tiles.nb_prefetch > 0 and shape.in_loop:
            desc = xegpu.insert_prefetch(load, nb_prefetch=tiles.nb_prefetch)
            prefetches = transform.get_consumers_of_result(any_op(), desc, 0)
            xegpu.set_anchor_layout(prefetches, **prefetch_layout(*tile, tiles.subgroups, (dm, dn)))
        xegpu.set_anchor_layout(load, **load_layout)
        xegpu.set_anchor_layout(dpas, index=index, **dpas_layout)
    xegpu.set_anchor_layout(dpas, index=2, **c)
    xegpu.set_anchor_layout(match(gpu_func, "xegpu.store_nd"), **c)
    if shape.row_broadcast_loads:
        xegpu.set_anchor_layout(match(gpu_func, "xegpu.load"), **c, slice_dims=[0])
    canonicalize(gpu_func)
    if shape.in_loop:
        transform.apply_licm(match(gpu_func, "scf.for"))
        canonicalize(gpu_func)
