"""Intel's offline GPU compiler (ocloc with IGC, the compiler of the Level Zero and OpenCL
drivers): SPIR-V -> a chip's machine code, and what IGC says about it.

Where ocloc comes from, first found wins: $LIGHTHOUSE_OCLOC, an `ocloc` on PATH (a machine
with Intel's drivers or oneAPI), `.cache/ocloc/ocloc` in the checkout (tools/fetch-ocloc, run
by `make test`).

A build runs `ocloc compile -spirv_input -device CHIP` with IGC's shader dump
(IGC_ShaderDumpEnable, IGC_DumpToCustomDir) and IGC's own recompilation off
(IGC_DisableRecompilation), so that the one assembly it writes per kernel is the code in the
binary. Its header and instructions give the `MachineCode`:
  //.thread_config numGRF=128|256   registers per hardware thread (64 B each on Xe2 and PVC)
  //.instCount N                     instructions
  //.spill size B                    bytes of scratch the register allocator used (absent: 0);
                                     this counts GRF and flag-register spills alike
  //.spill flag store N              flag-register spill stores (a few are harmless)
  dpas.8x8                           one DPAS (8 rows x 16 lanes x depth 8 of 32-bit pairs)
  load_block2d ... rN:M / null       a 2-D block load into M registers / a prefetch
  store_block2d                      a 2-D block store
  R_SYM_ADDR_32: NAME                a relocation: NAME is an external function IGC did not
                                     resolve (a driver would refuse to link the module)
  _label: ... jmpi _label            a loop: a jump back to a label above it
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import StageError, UnsupportedError

ENV = "LIGHTHOUSE_OCLOC"
CHECKOUT_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "ocloc" / "ocloc"
FETCH_HINT = (f"run tools/fetch-ocloc (or `make ocloc`), set {ENV}=/path/to/ocloc, or stop "
              "before the native stage (--stop-after binary)")
LARGE_GRF_OPTION = "-ze-opt-large-register-file"   # 256 registers per thread
GRF_MODES = (128, 256)
SPILL_BOUND = 128    # bytes of spill a kernel may keep (a few flag spills; no GRF spilling)
GRF_BYTES = 64


def find_ocloc() -> str:
    """Path of the ocloc to use (see the module docstring); UnsupportedError when none."""
    chosen = os.environ.get(ENV)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise UnsupportedError(f"{ENV}={chosen} is not an executable file")
        return chosen
    on_path = shutil.which("ocloc")
    if on_path:
        return on_path
    if CHECKOUT_CACHE.is_file() and os.access(CHECKOUT_CACHE, os.X_OK):
        return str(CHECKOUT_CACHE)
    raise UnsupportedError(f"the native stage needs Intel's offline compiler ocloc: {FETCH_HINT}")


@lru_cache(maxsize=None)
def ocloc_version(path: str) -> str:
    proc = subprocess.run([path, "--version"], capture_output=True, text=True)
    return (proc.stdout.strip().splitlines() or ["unknown"])[-1]


@dataclass(frozen=True)
class MachineCode:
    """What one kernel's assembly says (see the module docstring)."""

    platform: str
    grf: int
    instructions: int
    spill_bytes: int
    flag_spills: int
    dpas: int
    block_loads: int
    block_stores: int
    block_prefetches: int
    block_load_bytes: int      # registers written by the block loads, in bytes, per thread
    unresolved: tuple[str, ...]
    # the loops that issue DPAS (innermost such loops: a loop holding no other DPAS loop):
    # their instructions and DPAS, what a DPAS step costs; 0 when no loop holds a DPAS
    loop_instructions: int = 0
    loop_dpas: int = 0

    @property
    def block_io(self) -> bool:
        return bool(self.block_loads or self.block_stores)


_HEADER = re.compile(r"^//\.(thread_config|instCount|spill size|spill flag store|platform)\s+(.*)$",
                     re.M)
_DPAS = re.compile(r"^\s*(?:\([^)]*\)\s*)?dpas\.", re.M)
_BLOCK_LOAD = re.compile(r"^\s*(?:\([^)]*\)\s*)?load_block2d\.\S+\s+\(\S+\)\s+(null|r\d+):(\d+)", re.M)
_BLOCK_STORE = re.compile(r"^\s*(?:\([^)]*\)\s*)?store_block2d\.", re.M)
_RELOCATION = re.compile(r"R_SYM_ADDR_32(?:_HI)?: (\w+)")
_LABEL = re.compile(r"^(_\w+):\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:\([^)]*\)\s*)?[a-z][\w.]*\s")
_BRANCH = re.compile(r"\b(?:jmpi|goto|while|brc|brd)\b.*?\s(_\w+)\b")


def _dpas_loops(text: str) -> tuple[int, int]:
    """(instructions, DPAS) of the innermost loops that hold DPAS (see MachineCode)."""
    lines = text.splitlines()
    labels, loops = {}, []
    for i, line in enumerate(lines):
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = i
            continue
        branch = _BRANCH.search(line) if _INSTRUCTION.match(line) else None
        if branch and branch.group(1) in labels:
            loops.append((labels[branch.group(1)], i))
    counted = []
    for start, end in loops:
        body = lines[start:end + 1]
        dpas = sum(1 for ln in body if _DPAS.match(ln))
        if dpas:
            counted.append((start, end, sum(1 for ln in body if _INSTRUCTION.match(ln)), dpas))
    inner = [c for c in counted if not any(o is not c and c[0] <= o[0] and o[1] <= c[1]
                                           for o in counted)]
    return sum(c[2] for c in inner), sum(c[3] for c in inner)


def parse_assembly(text: str) -> MachineCode:
    """The MachineCode of one kernel's IGC assembly dump."""
    header = {key: value.strip() for key, value in _HEADER.findall(text)}
    grf = re.search(r"numGRF=(\d+)", header.get("thread_config", ""))
    if grf is None or "instCount" not in header:
        raise StageError("IGC's assembly has no //.thread_config numGRF or //.instCount header")
    loads = _BLOCK_LOAD.findall(text)
    fills = [int(n) for dst, n in loads if dst != "null"]
    symbols = sorted({s for s in _RELOCATION.findall(text) if not s.startswith("__INTEL")})
    loop_instructions, loop_dpas = _dpas_loops(text)
    return MachineCode(
        platform=header.get("platform", "?"), grf=int(grf.group(1)),
        instructions=int(header["instCount"]),
        spill_bytes=int(header.get("spill size", "0").split()[0]),
        flag_spills=int(header.get("spill flag store", "0").split()[0]),
        dpas=len(_DPAS.findall(text)), block_loads=len(fills),
        block_stores=len(_BLOCK_STORE.findall(text)),
        block_prefetches=sum(1 for dst, _ in loads if dst == "null"),
        block_load_bytes=sum(fills) * GRF_BYTES, unresolved=tuple(symbols),
        loop_instructions=loop_instructions, loop_dpas=loop_dpas)


@dataclass(frozen=True)
class NativeBuild:
    binary: bytes            # the device binary (zebin) ocloc wrote
    machine: MachineCode


def compile_spirv(spirv: bytes, device: str, grf: int, what: str) -> NativeBuild:
    """ocloc on one kernel's SPIR-V for `device` with `grf` registers per thread; StageError
    naming `what` when ocloc fails or crashes, or when the code calls a function IGC left
    unresolved."""
    ocloc = find_ocloc()
    with tempfile.TemporaryDirectory(prefix="lighthouse-ocloc-") as tmp:
        tmp = Path(tmp)
        (tmp / "kernel.spv").write_bytes(spirv)
        dump = tmp / "dump"
        cmd = [ocloc, "compile", "-file", str(tmp / "kernel.spv"), "-spirv_input",
               "-device", device, "-output", "kernel", "-output_no_suffix", "-out_dir", str(tmp)]
        if grf == 256:
            cmd += ["-options", LARGE_GRF_OPTION]
        env = dict(os.environ, IGC_ShaderDumpEnable="1", IGC_DumpToCustomDir=str(dump),
                   IGC_DisableRecompilation="1")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise StageError(f"ocloc ({device}, {grf} GRF) failed on {what}: "
                             f"{_failure(proc.returncode, proc.stdout + proc.stderr)}")
        binaries = sorted(tmp.glob("kernel*.bin"))
        assemblies = sorted(dump.glob("*_entry_*.asm"))
        if len(binaries) != 1 or len(assemblies) != 1:
            raise StageError(f"ocloc ({device}) on {what}: expected one binary and one kernel "
                             f"assembly, found {len(binaries)} and {len(assemblies)}")
        machine = parse_assembly(assemblies[0].read_text(errors="replace"))
        if machine.unresolved:
            raise StageError(f"{what}: the {device} code calls {', '.join(machine.unresolved)}, "
                             "which IGC does not know (an unresolved external function)")
        return NativeBuild(binaries[0].read_bytes(), machine)


def _failure(code: int, output: str) -> str:
    if code < 0 or code in (139, 134):
        return f"IGC crashed (signal {-code if code < 0 else code - 128})"
    lines = [ln.strip() for ln in output.splitlines() if "error" in ln.lower()]
    return (lines or [f"exit {code}"])[0][:300]


def build(spirv: bytes, device: str, what: str) -> NativeBuild:
    """The kernel in the GRF mode it needs: 128 registers per thread, or 256 when the
    128-register build spills and the 256-register one spills less (Triton's Intel backend
    retries in large-GRF mode the same way). 256 registers halve the threads an EU holds
    (8 -> 4), so a kernel that fits in 128 keeps 128."""
    small = compile_spirv(spirv, device, 128, what)
    if small.machine.spill_bytes == 0:
        return small
    large = compile_spirv(spirv, device, 256, what)
    return large if large.machine.spill_bytes < small.machine.spill_bytes else small
