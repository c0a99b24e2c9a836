"""What the schedule families may know of the machine they compile for.

A family reads a target through these attributes only, never through its name:
  cpu              a CpuDescription when the target runs the family's vector code on a CPU
                   (its @vectorize, its register and cache budgets); None when the target
                   vectorizes its own way (the XeGPU target, whose chip is
                   lighthouse.targets.xegpu.Chip)
  threads          the workers parallel tiles are balanced for
  options          the kernel file's LIGHTHOUSE dict, as sorted pairs
  attention_tiles  (query rows, keys per step) the target needs of the attention schedule,
                   None: the schedule's own choice
  attention_backward_tiles  the attention backward in two passes with these tiles
                   (schedules.attention.AttentionParams.backward_tiles), None: in one pass
  linear_cross_entropy_tiles  (rows per block, classes per step, lanes) the target needs of
                   the linear cross-entropy schedule, with the logits kept [N, V], the target
                   logit a masked class sum and per-row data crossing kernels in lane form of
                   that many lanes (a GPU's DPAS tiles and subgroups); None: the CPU form
The host CPU is described once per process (`host_cpu`): its vector unit from the flags of
/proc/cpuinfo, its caches from /sys/devices/system/cpu/cpu0/cache.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
# The least work (vector cycles as lighthouse.targets.parallel_bound estimates them) a kernel
# shares between threads. Waking a sleeping OpenMP worker costs 50-100 us on this project's
# VMs; kernels near 2^15 cycles took 10-50 us on one thread, and two threads saved at most a
# few microseconds when the second was awake.
PARALLEL_CYCLES = 1 << 15
# Results at least this large are written with streaming stores
# (lighthouse/targets/streaming_stores.py): where, on this project's Sapphire Rapids VM, a
# kernel whose result the next kernel reads back stopped losing to ordinary stores.
STREAM_BYTES = 16 << 20
# Cache sizes assumed when the machine does not report them (a common x86 core).
FALLBACK_CACHE_BYTES = {1: 32 << 10, 2: 1 << 20, 3: 8 << 20}


@dataclass(frozen=True)
class CpuDescription:
    """vector_bits: width of the vector registers the code may use (512 with AVX-512, 256
    with AVX2, else 128); vector_registers: how many of them (32 with AVX-512, else 16);
    l1d_bytes, l2_bytes, l3_bytes: data cache sizes of one core (L3: shared); threads:
    hardware threads; bf16_dot: bf16 contractions may use AVX512-BF16 dot products
    (vdpbf16ps: 512-bit vectors and the avx512_bf16 flag); amx: with bf16_dot, the matmul
    family's bf16 products may run on AMX tiles (tdpbf16ps: the amx_tile and amx_bf16
    flags); stream_bytes: results of at least this many bytes are written with streaming
    (non-temporal) stores, 0: never."""

    vector_bits: int
    vector_registers: int
    l1d_bytes: int
    l2_bytes: int
    l3_bytes: int
    threads: int
    bf16_dot: bool = False
    amx: bool = False
    parallel_cycles: int = PARALLEL_CYCLES
    stream_bytes: int = STREAM_BYTES

    @property
    def f32_lanes(self) -> int:
        return self.vector_bits // 32


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first `flags` line of /proc/cpuinfo (empty when unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@lru_cache(maxsize=1)
def host_cpu_flags() -> frozenset[str]:
    return cpu_flags()


def parse_cache_size(text: str) -> int:
    """Bytes of a sysfs cache size: '48K', '2048K', '1M' or a plain number."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def cache_sizes(cache_dir: Path = CACHE_DIR) -> dict[int, int]:
    """Bytes of the data (or unified) cache of each level under a sysfs cache directory
    (index*/level, type, size); levels it does not report are missing."""
    sizes: dict[int, int] = {}
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified"):
            sizes.setdefault(level, size)
    return sizes


def describe_cpu(flags: frozenset[str], caches: dict[int, int], threads: int) -> CpuDescription:
    """The description of a CPU with these /proc/cpuinfo flags and cache sizes (by level;
    FALLBACK_CACHE_BYTES for the missing ones)."""
    avx512 = "avx512f" in flags
    bits = 512 if avx512 else 256 if "avx2" in flags else 128
    size = {**FALLBACK_CACHE_BYTES, **caches}
    return CpuDescription(vector_bits=bits, vector_registers=32 if avx512 else 16,
                          l1d_bytes=size[1], l2_bytes=size[2], l3_bytes=size[3], threads=threads,
                          bf16_dot=avx512 and "avx512_bf16" in flags,
                          amx=has_amx(flags))


def has_amx(flags: frozenset[str]) -> bool:
    """Do these /proc/cpuinfo flags have AMX tiles with bf16 products?"""
    return {"avx512_bf16", "amx_tile", "amx_bf16"} <= flags


# Fields of a description that LIGHTHOUSE_CPU may set, and how their values are written.
OVERRIDABLE = {"vector_bits": int, "vector_registers": int, "l1d": parse_cache_size,
               "l2": parse_cache_size, "l3": parse_cache_size, "parallel_cycles": int,
               "stream": parse_cache_size}
SWITCHES = ("bf16_dot", "amx")  # fields set to 0 or 1


def with_overrides(cpu: CpuDescription, text: str) -> CpuDescription:
    """`cpu` with the fields that `text` sets ("vector_bits=256,vector_registers=16,
    l1d=32K,l2=1M,l3=32M,parallel_cycles=0,stream=16M,bf16_dot=0,amx=0"; any subset):
    what the schedules plan for, whatever the machine runs (the code is compiled for the
    host either way: bf16_dot=1 on a host without avx512_bf16 compiles code it cannot run).
    A malformed entry is an UnsupportedError naming it."""
    from ..errors import UnsupportedError

    fields = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        key, _, value = entry.partition("=")
        if key in SWITCHES:
            if value not in ("0", "1"):
                raise UnsupportedError(f"LIGHTHOUSE_CPU: {entry!r} is not {key}=0 or {key}=1")
            fields[key] = value == "1"
            continue
        if key not in OVERRIDABLE or not value:
            known = [k + "=N" for k in OVERRIDABLE] + [k + "=0|1" for k in SWITCHES]
            raise UnsupportedError(f"LIGHTHOUSE_CPU: {entry!r} is not one of {', '.join(known)}")
        try:
            number = OVERRIDABLE[key](value)
        except ValueError:
            number = 0
        if number < (0 if key in ("parallel_cycles", "stream") else 1) or (
                key == "vector_bits" and number not in (128, 256, 512)):
            raise UnsupportedError(f"LIGHTHOUSE_CPU: {entry!r} is not a valid size")
        fields[key if key.startswith(("vector", "parallel")) else f"{key}_bytes"] = number
    return dataclasses.replace(cpu, **fields)


@lru_cache(maxsize=1)
def host_cpu() -> CpuDescription:
    """This machine's CPU (read once), with the fields the environment variable
    LIGHTHOUSE_CPU sets (see `with_overrides`; the tests pin one description so that the IR
    they check does not depend on the machine)."""
    cpu = describe_cpu(host_cpu_flags(), cache_sizes(), os.cpu_count() or 1)
    return with_overrides(cpu, os.environ.get("LIGHTHOUSE_CPU", ""))
