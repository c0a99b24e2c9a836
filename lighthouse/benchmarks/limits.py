"""This machine's measured limits: streaming-read bandwidth and FMA peak, on every core.

Both micro-kernels are written here as small MLIR functions (vector dialect inside an
`scf.parallel` over the threads) and go through the same path as every compiled kernel: the
CPU target's `llvm` stage (OpenMP, LLVM dialect) and its JIT (host ISA, AVX-512 here). They
are written by hand, not scheduled, so the limits do not depend on the schedules they judge.

- FMA peak: each thread runs `iters` steps of `accumulators` independent chains
  x <- fma(x, a, b) on full-width f32 vectors; the operands come from an argument, so LLVM
  cannot fold the loop, and 16 chains cover the FMA latency of two ports (fewer when the
  vector registers cannot hold them beside a and b: 14 of AVX2's 16). FLOPs =
  threads * accumulators * lanes * 2 * iters. The best of several calls is reported.
- Bandwidth: each thread sums its share of an f32 array of at least 1 GiB and twice the
  last-level cache (so it streams from DRAM) with 8 vector accumulators; bytes =
  4 * elements. The same read done by `torch.sum` is measured too, and the limit is the
  faster of the two (a limit is the best this machine was seen to do); both are reported.
Kernels whose working set fits in the cache (480 MiB L3 here) can exceed that bandwidth:
their fraction of the limit is then above 100%, which says where their data lived.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Limits:
    threads: int
    lanes: int
    fma_gflops: float
    bandwidth_gbs: float
    bandwidth_compiled_gbs: float
    bandwidth_torch_gbs: float
    stream_bytes: int = 1 << 30

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"machine limits ({self.threads} threads): FMA peak {self.fma_gflops:.0f} GFLOP/s "
                f"(f32, {self.lanes}-lane vectors); streaming read {self.bandwidth_gbs:.1f} GB/s "
                f"(compiled {self.bandwidth_compiled_gbs:.1f}, torch.sum "
                f"{self.bandwidth_torch_gbs:.1f}, {self.stream_bytes >> 30} GiB)")


def fma_peak_module(threads: int, lanes: int, accumulators: int, iters: int) -> str:
    """MLIR of `main(%in: memref<3 x lanes>, %out: memref<threads x acc x lanes>)`: rows of
    %in are a, b and the start value of every chain; %out receives the final chains."""
    v = f"vector<{lanes}xf32>"
    out_t = f"memref<{threads}x{accumulators}x{lanes}xf32>"
    xs = [f"%x{i}" for i in range(accumulators)]
    steps = "\n".join(f"        %y{i} = vector.fma %x{i}, %a, %b : {v}" for i in range(accumulators))
    stores = "\n".join(f"      vector.store %r#{i}, %out[%t, %i{i}, %c0] : {out_t}, {v}"
                       for i in range(accumulators))
    indices = "\n".join(f"  %i{i} = arith.constant {i} : index" for i in range(accumulators))
    types = ", ".join([v] * accumulators)
    return f"""
func.func @main(%in: memref<3x{lanes}xf32>, %out: {out_t}) {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
{indices}
  %threads = arith.constant {threads} : index
  %iters = arith.constant {iters} : index
  %a = vector.load %in[%c0, %c0] : memref<3x{lanes}xf32>, {v}
  %b = vector.load %in[%c1, %c0] : memref<3x{lanes}xf32>, {v}
  %x = vector.load %in[%c2, %c0] : memref<3x{lanes}xf32>, {v}
  scf.parallel (%t) = (%c0) to (%threads) step (%c1) {{
      %r:{accumulators} = scf.for %s = %c0 to %iters step %c1
          iter_args({", ".join(f"{x} = %x" for x in xs)}) -> ({types}) {{
{steps}
        scf.yield {", ".join(f"%y{i}" for i in range(accumulators))} : {types}
      }}
{stores}
      scf.reduce
  }}
  return
}}"""


def stream_read_module(threads: int, lanes: int, accumulators: int, elements: int) -> str:
    """MLIR of `main(%in: memref<elements x f32>, %out: memref<threads x lanes>)`: thread t
    sums its contiguous share of %in into %out[t] (lane-wise partial sums)."""
    v = f"vector<{lanes}xf32>"
    share = elements // threads
    step = lanes * accumulators
    assert share % step == 0, "the share of each thread must be a whole number of steps"
    loads = "\n".join(
        f"        %o{i} = arith.addi %j, %k{i} : index\n"
        f"        %l{i} = vector.load %in[%o{i}] : memref<{elements}xf32>, {v}\n"
        f"        %y{i} = arith.addf %x{i}, %l{i} : {v}" for i in range(accumulators))
    offsets = "\n".join(f"  %k{i} = arith.constant {i * lanes} : index" for i in range(accumulators))
    types = ", ".join([v] * accumulators)
    folds, total = [], "%r#0"
    for i in range(1, accumulators):
        folds.append(f"      %s{i} = arith.addf {total}, %r#{i} : {v}")
        total = f"%s{i}"
    return f"""
func.func @main(%in: memref<{elements}xf32>, %out: memref<{threads}x{lanes}xf32>) {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %threads = arith.constant {threads} : index
  %share = arith.constant {share} : index
  %step = arith.constant {step} : index
{offsets}
  %zero = arith.constant dense<0.0> : {v}
  scf.parallel (%t) = (%c0) to (%threads) step (%c1) {{
      %lo = arith.muli %t, %share : index
      %hi = arith.addi %lo, %share : index
      %r:{accumulators} = scf.for %j = %lo to %hi step %step
          iter_args({", ".join(f"%x{i} = %zero" for i in range(accumulators))}) -> ({types}) {{
{loads}
        scf.yield {", ".join(f"%y{i}" for i in range(accumulators))} : {types}
      }}
{chr(10).join(folds)}
      vector.store {total}, %out[%t, %c0] : memref<{threads}x{lanes}xf32>, {v}
      scf.reduce
  }}
  return
}}"""


def stream_elements(last_level_cache_bytes: int) -> int:
    """f32 elements of the streaming read: a power of two of at least 1 GiB and twice the
    last-level cache, so that the read comes from DRAM."""
    elements = 1 << 28
    while 4 * elements < 2 * last_level_cache_bytes:
        elements *= 2
    return elements


def _jit(text: str, target, arg_specs, result_specs):
    from torch_mlir import ir

    from ..targets.cpu import lower_to_llvm

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        lower_to_llvm(module, target.threads)
        return target.jit(module, arg_specs, result_specs)


def _best_seconds(fn, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_limits(quick: bool = False, threads: int | None = None) -> Limits:
    """Run both micro-kernels (a few seconds; `quick` takes fewer samples)."""
    from ..ingress import TensorSpec
    from ..targets.cpu import CpuTarget

    target = CpuTarget() if threads is None else CpuTarget(threads=threads)
    lanes = target.cpu.f32_lanes
    calls = 5 if quick else 20

    accumulators, iters = min(16, target.cpu.vector_registers - 2), 1_000_000
    fma = _jit(fma_peak_module(target.threads, lanes, accumulators, iters), target,
               [TensorSpec((3, lanes), torch.float32)],
               [TensorSpec((target.threads, accumulators, lanes), torch.float32)])
    operands = torch.tensor([[0.999] * lanes, [0.001] * lanes, [0.5] * lanes])
    call = fma.bind([operands])
    fma_flops = target.threads * accumulators * lanes * 2 * iters
    fma_gflops = fma_flops / _best_seconds(call, calls) / 1e9

    elements = stream_elements(target.cpu.l3_bytes)
    stream = _jit(stream_read_module(target.threads, lanes, 8, elements), target,
                  [TensorSpec((elements,), torch.float32)],
                  [TensorSpec((target.threads, lanes), torch.float32)])
    data = torch.ones(elements)
    read = stream.bind([data])
    if float(read()[0].sum()) != elements:
        raise RuntimeError("the streaming-read kernel summed the wrong number of elements")
    reads = 3 if quick else 8
    compiled_gbs = 4 * elements / _best_seconds(read, reads) / 1e9
    torch_gbs = 4 * elements / _best_seconds(data.sum, reads) / 1e9
    return Limits(target.threads, lanes, fma_gflops, max(compiled_gbs, torch_gbs),
                  compiled_gbs, torch_gbs, 4 * elements)
