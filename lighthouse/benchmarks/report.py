"""Rows of results and their outputs: the terminal table, CSV, JSON and the bar chart.

Statuses: PASS and FAIL (the compiled kernel ran; FAIL = differs from torch beyond the dtype
tolerance), UNSUPPORTED (lighthouse cannot take the problem: the reason says why), ERROR (a
compile error or crash: a bug), TIMEOUT (a child ran past --timeout).
Speedup is torch eager's median time / ours, `vs inductor` torch.compile's (inductor, the same
reference compiled) / ours: above 1, ours is faster.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .limits import Limits
from .suite import Case

FAILING = ("FAIL", "ERROR")


@dataclass
class Row:
    name: str
    kernel: str
    sizes: str
    backward: bool
    status: str
    reason: str = ""
    schedule: str = ""
    import_s: float | None = None  # torch.export + torch-mlir, inputs made, torch run once
    compile_s: float | None = None  # the stages after the import, JIT included
    inductor_compile_s: float | None = None  # torch.compile's first call
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    ours_ms: float | None = None
    torch_ms: float | None = None
    speedup: float | None = None
    inductor_ms: float | None = None
    vs_inductor: float | None = None
    ours_peak_mb: float | None = None
    torch_peak_mb: float | None = None
    gflop: float | None = None
    gbyte: float | None = None
    bound: str = ""  # "compute" or "memory"
    ours_rate: float | None = None  # GFLOP/s or GB/s (see rate_unit)
    torch_rate: float | None = None
    rate_unit: str = ""
    ours_limit_pct: float | None = None
    torch_limit_pct: float | None = None
    timing_rounds: int | None = None
    ours_spread: float | None = None
    torch_spread: float | None = None
    inductor_spread: float | None = None
    notes: list[str] = field(default_factory=list)
    command: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def make_row(case: Case, status: str, reason: str = "") -> Row:
    return Row(case.name, str(case.path), case.sizes, case.backward, status, reason,
               notes=list(case.notes), command=case.command())


def fill_measurement(row: Row, m: dict, limits: Limits | None) -> None:
    """Copy a child's measurement into the row and derive ratios, rates and fractions."""
    row.schedule = m["schedule"]
    row.notes += m["notes"]
    row.import_s, row.compile_s = m["import_s"], m["compile_s"]
    row.max_abs_err, row.max_rel_err = m["max_abs_err"], m["max_rel_err"]
    row.ours_ms, row.torch_ms = m["ours_s"] * 1e3, m["torch_s"] * 1e3
    row.speedup = m["torch_s"] / m["ours_s"]
    if m["inductor_s"] is not None:
        row.inductor_ms = m["inductor_s"] * 1e3
        row.vs_inductor = m["inductor_s"] / m["ours_s"]
    row.inductor_compile_s = m["inductor_compile_s"]
    row.timing_rounds = m["timing_rounds"]
    row.ours_spread, row.torch_spread = m["ours_spread"], m["torch_spread"]
    row.inductor_spread = m["inductor_spread"]
    row.gflop, row.gbyte = m["flops"] / 1e9, m["bytes"] / 1e9
    balance = limits.fma_gflops / limits.bandwidth_gbs if limits else 0.0  # FLOP per byte
    intensity = row.gflop / row.gbyte if row.gbyte else math.inf
    row.bound = "compute" if row.gflop > 0 and intensity >= balance else "memory"
    work, limit = ((row.gflop, limits.fma_gflops if limits else None) if row.bound == "compute"
                   else (row.gbyte, limits.bandwidth_gbs if limits else None))
    row.rate_unit = "GFLOP/s" if row.bound == "compute" else "GB/s"
    row.ours_rate = work / m["ours_s"]
    row.torch_rate = work / m["torch_s"]
    if limit:
        row.ours_limit_pct = 100 * row.ours_rate / limit
        row.torch_limit_pct = 100 * row.torch_rate / limit


# ---- terminal table ----------------------------------------------------------------------

def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _ms(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def _ratio(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


COLUMNS = [
    ("kernel", "<", lambda r: r.name),
    ("schedule", "<", lambda r: r.schedule or "-"),
    ("compile s", ">", lambda r: _num(r.compile_s, ".2f")),
    ("max err", ">", lambda r: _num(r.max_abs_err, ".1e")),
    ("check", "<", lambda r: r.status),
    ("ours ms", ">", lambda r: _ms(r.ours_ms)),
    ("torch ms", ">", lambda r: _ms(r.torch_ms)),
    ("speedup", ">", lambda r: _ratio(r.speedup)),
    ("inductor ms", ">", lambda r: _ms(r.inductor_ms)),
    ("vs inductor", ">", lambda r: _ratio(r.vs_inductor)),
    ("ours MB", ">", lambda r: _num(r.ours_peak_mb, ".1f")),
    ("torch MB", ">", lambda r: _num(r.torch_peak_mb, ".1f")),
    ("ours rate", ">", lambda r: "-" if r.ours_rate is None else f"{r.ours_rate:.1f} {r.rate_unit}"),
    ("% limit", ">", lambda r: _num(r.ours_limit_pct, ".0f")),
    ("torch % limit", ">", lambda r: _num(r.torch_limit_pct, ".0f")),
]


INDUCTOR_COLUMNS = ("inductor ms", "vs inductor")
SIZES_COLUMN = ("sizes (--set)", "<", lambda r: r.sizes or "-")


def table(rows: list[Row], *, sizes: bool = False, inductor: bool = True) -> str:
    """The terminal table; `sizes` adds the --set values of each row (chosen sizes),
    `inductor` the torch.compile columns."""
    columns = [c for c in COLUMNS if inductor or c[0] not in INDUCTOR_COLUMNS]
    columns += [SIZES_COLUMN] if sizes else []
    cells = [[c[0] for c in columns]] + [[c[2](r) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]

    def render(line):
        return "  ".join(format(v, f"{c[1]}{w}") for v, c, w in zip(line, columns, widths)).rstrip()

    out = [render(cells[0]), "  ".join("-" * w for w in widths)]
    out += [render(line) for line in cells[1:]]
    return "\n".join(out)


def footnotes(rows: list[Row]) -> str:
    """Why rows are not PASS, and the schedule fallbacks."""
    lines = []
    for r in rows:
        if r.status != "PASS" and r.reason:
            lines.append(f"{r.status} {r.name}: {r.reason}")
        for note in r.notes:
            lines.append(f"note {r.name}: {note}")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    order = ["PASS", "FAIL", "ERROR", "TIMEOUT", "UNSUPPORTED"]
    parts = [f"{counts[s]} {s}" for s in order if s in counts]
    return f"{len(rows)} kernel{'s' * (len(rows) != 1)}: " + ", ".join(parts)


FAST_P = (0.0, 1.0, 1.5)


def fast_p_values(rows: list[Row], ratio: str) -> dict[float, float]:
    """KernelBench's fast_p over every problem run: the share of the rows that PASS with a
    ratio (`speedup` against torch eager, `vs_inductor` against torch.compile) above p; a
    row without that ratio (not timed) counts as not fast."""
    if not rows:
        return {p: 0.0 for p in FAST_P}
    return {p: sum(1 for r in rows if r.status == "PASS" and getattr(r, ratio) is not None
                   and getattr(r, ratio) > p) / len(rows) for p in FAST_P}


def fast_p(rows: list[Row], *, inductor: bool) -> str:
    """The fast_p lines of a KernelBench level, with the median ratio of the rows that pass."""
    lines = []
    baselines = [("torch eager", "speedup")] + ([("torch.compile", "vs_inductor")] if inductor else [])
    for name, ratio in baselines:
        values = fast_p_values(rows, ratio)
        timed = sorted(getattr(r, ratio) for r in rows if r.status == "PASS"
                       and getattr(r, ratio) is not None)
        median = f"{statistics.median(timed):.2f}x" if timed else "-"
        parts = ", ".join(f"fast_{p:g} {v:.2f}" for p, v in values.items())
        lines.append(f"against {name}: {parts} (median {median} over {len(timed)} passing, "
                     f"slowest {timed[0]:.2f}x)" if timed else f"against {name}: {parts}")
    return "\n".join(lines)


# ---- files ---------------------------------------------------------------------------------

CSV_FIELDS = [f.name for f in fields(Row)]


def write_csv(rows: list[Row], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in rows:
            d = r.to_dict()
            d["notes"] = " | ".join(d["notes"])
            writer.writerow({k: "" if v is None else v for k, v in d.items()})


def write_json(rows: list[Row], path: str | Path, *, machine: dict, settings: dict) -> None:
    """Non-finite numbers (an infinite relative error) are written as null."""
    def finite(d: dict) -> dict:
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()}

    doc = {"machine": machine, "settings": settings, "rows": [finite(r.to_dict()) for r in rows]}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def write_plot(rows: list[Row], path: str | Path, *, title: str) -> None:
    """Two panels: ours against torch eager and, where timed, against torch.compile (inductor),
    side by side (log scale, 1x marked; failing rows labelled with their status), and peak
    memory of a call, ours next to torch eager's (log scale), for the rows that were timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    timed = [r for r in rows if r.speedup is not None]
    xs = list(range(len(timed)))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8.0, 0.75 * len(timed) + 3), 8),
                                   constrained_layout=True)
    fig.suptitle(title, fontsize=10)
    ratios = [("speedup", "vs torch eager", "tab:green")]
    if any(r.vs_inductor is not None for r in timed):
        ratios.append(("vs_inductor", "vs torch.compile (inductor)", "tab:purple"))
    width = 0.8 / len(ratios)
    for k, (attr, label, color) in enumerate(ratios):
        offset = (k - (len(ratios) - 1) / 2) * width
        points = [(x + offset, getattr(r, attr), r.status) for x, r in zip(xs, timed)
                  if getattr(r, attr) is not None]
        ax1.bar([p[0] for p in points], [p[1] for p in points], width, color=color, label=label)
        for x, value, status in points:
            text = f"{value:.2f}" + ("" if status == "PASS" else f" {status}")
            ax1.annotate(text, (x, value), ha="center", va="bottom", fontsize=7,
                         color="black" if status == "PASS" else "tab:red")
    ax1.axhline(1.0, color="black", linewidth=0.8)
    ax1.set_yscale("log")
    ax1.margins(y=0.12)
    ax1.set_ylabel("speedup of lighthouse (x)")
    ax1.legend()
    floor = 0.01  # MB: log scale needs positive bars; smaller peaks are drawn at the floor
    width = 0.4
    for offset, side, label in ((-width / 2, "ours", "lighthouse"), (width / 2, "torch", "torch eager")):
        values = [getattr(r, f"{side}_peak_mb") for r in timed]
        ax2.bar([x + offset for x in xs], [max(v or 0.0, floor) for v in values], width, label=label)
    ax2.set_yscale("log")
    ax2.set_ylabel("peak memory of a call (MB)")
    ax2.legend()
    ax1.yaxis.set_major_locator(FixedLocator([m * 10.0**e for e in range(-3, 4) for m in (1, 2, 5)]))
    for ax in (ax1, ax2):
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(xs)
        ax.set_xticklabels([r.name for r in timed], rotation=35, ha="right")
    fig.savefig(path, dpi=110)
    plt.close(fig)
