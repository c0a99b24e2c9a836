"""A static time estimate of an XeGPU kernel from its machine code and its work, against the
chip's peaks (lighthouse.targets.xegpu.Chip: Arc B580 for bmg, Max 1100 for pvc).

  DPAS issued  = FLOPs / (2 M N K) of the chip's DPAS shape; each occupies its XMX engine
                 for M N K * 2 / xmx_flops_per_clock clocks (16 on B580, 8 on Max 1100).
                 The count comes from the work of the IR (the loop trips per workgroup);
                 the tests check that the machine code issues the same DPAS per subgroup.
  compute      a workgroup runs on one Xe-core with min(subgroups, EUs per core) XMX engines;
               the grid runs in waves of one workgroup per Xe-core:
               t_xmx = max(ceil(W / cores) * mean, max) workgroup FLOPs / workgroup rate
  issue        the other instructions of the machine code (the online softmax's exp, row
               reductions and rescaling, addresses, block IO) issue at one per clock per EU
               beside the XMX engine; per DPAS they are those of the loops that issue the
               DPAS (the whole kernel when IGC unrolled them), so
               t_issue = t_xmx * (instructions - dpas) / dpas / clocks per DPAS
  memory       t_dram = the kernel's arguments, each once / DRAM bandwidth (compulsory
               traffic: caches are assumed to catch every re-read, e.g. the K and V tiles
               every subgroup of an attention workgroup reads)
  estimate     t = max(t_xmx, t_issue, t_dram); the rate FLOPs / t against the DPAS peak, or
               for a kernel without DPAS the arguments' bytes / t against the DRAM bandwidth.
It is a bound from above on the speed: latency, dual issue, spills and occupancy (256 GRF
halves the threads per EU) are not modelled, and a kernel without DPAS is judged by its
DRAM traffic alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# upstream lighthouse's fused attention (llvm/lighthouse), f16 [2, 8, 4096, 64], measured on
# a Data Center GPU Max 1100
ANCHOR = ("upstream lighthouse fused attention f16 [2, 8, 4096, 64] on Max 1100", 101.9e12)


@dataclass(frozen=True)
class Estimate:
    seconds: float
    bound: str            # "xmx" | "issue" | "dram"
    flops: int
    io_bytes: int
    dpas: int             # DPAS instructions issued by the whole grid
    percent: float        # of the DPAS peak (FLOPs), else of the DRAM bandwidth

    @property
    def rate(self) -> str:
        if self.flops:
            return f"{self.flops / self.seconds / 1e12:.1f} TFLOP/s"
        return f"{self.io_bytes / self.seconds / 1e9:.0f} GB/s"


def estimate(work: dict, chip, machine=None) -> Estimate:
    """The estimate of a kernel with `work` (kernel_work.KernelWork fields) on `chip`, with
    its issue time when its machine code (ocloc.MachineCode) is given."""
    m, n, k = chip.dpas
    dpas = work["flops"] // (2 * m * n * k)
    engines = min(work["subgroups"], chip.eus_per_core)
    workgroup_rate = engines * chip.xmx_flops_per_clock * chip.clock_ghz * 1e9
    groups = max(1, work["workgroups"])
    waves = math.ceil(groups / chip.xe_cores)
    busiest = max(waves * work["flops"] / groups, work["max_workgroup_flops"])
    t_xmx = busiest / workgroup_rate
    t_issue = 0.0
    if machine is not None and machine.dpas and work["flops"]:
        clocks_per_dpas = 2 * m * n * k / chip.xmx_flops_per_clock
        instructions, issued = ((machine.loop_instructions, machine.loop_dpas)
                                if machine.loop_dpas else (machine.instructions, machine.dpas))
        t_issue = t_xmx * (instructions - issued) / issued / clocks_per_dpas
    t_dram = work["io_bytes"] / (chip.dram_gbps * 1e9)
    times = {"xmx": t_xmx, "issue": t_issue, "dram": t_dram}
    bound = max(times, key=times.get)
    seconds = max(times[bound], 1e-12)
    if work["flops"]:
        percent = 100 * work["flops"] / seconds / chip.peak_flops
    else:
        percent = 100 * work["io_bytes"] / seconds / (chip.dram_gbps * 1e9)
    return Estimate(seconds, bound, work["flops"], work["io_bytes"], dpas, percent)


REPORT_COLUMNS = ("kernel", "kind", "GRF", "instrs", "spill B", "dpas", "block ld/st/pf",
                  "est us", "est rate", "% peak")


def report_rows(kernels, chip) -> list[tuple]:
    """A row per kernel artifact with native machine code (see REPORT_COLUMNS)."""
    rows = []
    for k in kernels:
        mc = k.machine
        if mc is None:
            continue
        est = estimate(k.work, chip, mc) if k.work else None
        rows.append((k.module, k.kind or "?", mc.grf, mc.instructions,
                     f"{mc.spill_bytes}" + (f" ({mc.flag_spills} flag)" if mc.flag_spills else ""),
                     mc.dpas, f"{mc.block_loads}/{mc.block_stores}/{mc.block_prefetches}",
                     f"{est.seconds * 1e6:.2f}" if est else "-",
                     est.rate if est else "-", f"{est.percent:.0f}% {est.bound}" if est else "-"))
    return rows


def format_report(kernels, chip, version: str = "") -> str:
    """The --report table: per kernel the machine code's figures (per subgroup: instructions,
    spill bytes, DPAS, 2-D block loads/stores/prefetches; the GRF mode) and the estimate."""
    title = (f"{chip.name} ({chip.product}, peak {chip.peak_flops / 1e12:.1f} TFLOP/s f16, "
             f"{chip.dram_gbps:.0f} GB/s){' ocloc ' + version if version else ''}")
    return title + "\n" + format_table(REPORT_COLUMNS, report_rows(kernels, chip), left=2)


def format_table(columns: tuple, rows: list[tuple], left: int) -> str:
    """`rows` under `columns` (the first `left` columns aligned left, the others right),
    then the anchor."""
    text = [columns] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(columns))]
    lines = []
    for i, r in enumerate(text):
        lines.append("  ".join(c.ljust(w) if j < left else c.rjust(w)
                               for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    name, rate = ANCHOR
    pvc_percent = 100 * rate / _max1100_peak()
    lines.append(f"anchor: {name}: {rate / 1e12:.1f} TFLOP/s measured "
                 f"({pvc_percent:.0f}% of its DPAS peak)")
    return "\n".join(lines)


def _max1100_peak() -> float:
    from .xegpu import CHIPS

    return CHIPS["pvc"].peak_flops
