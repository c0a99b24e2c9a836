"""Writing kernel files: KernelBench's convention (`Model`, `get_inputs()`,
`get_init_inputs()`, optional `LIGHTHOUSE`), sizes as literals, the dtype as the global DTYPE.

    w = KernelWriter("float16")
    a = w.input(randn((5, 13), "transposed"))      # forward argument, made by get_inputs()
    fc = w.member("torch.nn.Linear(13, 7)")        # a parameter of Model
    y = w.let(f"{fc}({a})")                        # a forward line: y0 = self.fc0(x0)
    source = w.render([y])
"""

from __future__ import annotations

import math
import os
import re

import hypothesis.strategies as st

# FUZZ_DTYPES=bfloat16,... and FUZZ_SIZES=32,64,...: draw only these dtypes and sizes (the
# AMX path of bf16 products takes m, n and k that are multiples of 32 only)
DTYPES = tuple(filter(None, os.environ.get("FUZZ_DTYPES", "").split(","))) or (
    "float32", "float16", "bfloat16")
SIZES = tuple(int(s) for s in filter(None, os.environ.get("FUZZ_SIZES", "").split(",")))

# FUZZ_AVOID=tag,...: steer away from bug classes known to be open, so that a campaign finds
# new ones: offset (inputs with a storage offset), int-pow (x ** 2, x.pow(3), torch.pow(x, 3.0),
# F.gelu(approximate='tanh'), torch.erf),
# zero-size (a dim of size 0), nonfinite-ignored (NaN/inf logits in ignored cross-entropy rows),
# return-twice (one value returned as two results).
AVOID = frozenset(filter(None, os.environ.get("FUZZ_AVOID", "").split(",")))
KNOWN_TAGS = {"offset", "int-pow", "zero-size", "nonfinite-ignored", "return-twice"}
if AVOID - KNOWN_TAGS:
    raise ValueError(f"FUZZ_AVOID: unknown tags {sorted(AVOID - KNOWN_TAGS)}; known: {sorted(KNOWN_TAGS)}")
# tanh-GELU decomposes to x ** 3; the gradient of erf has exp(-x ** 2)
_POWER = re.compile(r"\*\* ?\d|pow\(|approximate='tanh'|erf\(")


def allowed(forms: tuple[str, ...]) -> tuple[str, ...]:
    """The expression forms FUZZ_AVOID does not exclude (int-pow drops powers)."""
    if "int-pow" not in AVOID:
        return forms
    return tuple(f for f in forms if not _POWER.search(f))

# Layouts of an input tensor of a given logical shape (get_inputs() returns views):
# contiguous; transposed (last two dims); permuted (dims -3, -2 swapped, as q.transpose(1, 2)
# of a [B, S, H, D] tensor); strided (every other element of the last dim); offset (a
# storage offset: the first rows of a larger tensor dropped); expanded (stride 0 in dim 0).
LAYOUTS = ("contiguous", "transposed", "permuted", "strided", "offset", "expanded")


def layout_fits(layout: str, shape: tuple[int, ...]) -> bool:
    rank = len(shape)
    return {"contiguous": True, "transposed": rank >= 2, "permuted": rank >= 3,
            "strided": rank >= 1, "offset": rank >= 1,
            "expanded": rank >= 2 and shape[0] > 1}[layout]


def layouts(shape: tuple[int, ...], *, weights=(4, 2, 1, 1, 1, 1)) -> st.SearchStrategy[str]:
    """A layout that fits `shape`; contiguous first (what shrinking goes to) and most often."""
    names = [name for name, weight in zip(LAYOUTS, weights) for _ in range(weight)
             if layout_fits(name, shape) and not (name == "offset" and "offset" in AVOID)]
    return st.sampled_from(names)


def _dims(shape) -> str:
    return ", ".join(str(d) for d in shape)


def scale_for(k: int) -> float:
    """About 1/sqrt(k), so a sum of k products of unit normals stays near unit size."""
    return float(f"{1 / math.sqrt(max(k, 1)):.3g}")


def randn(shape: tuple[int, ...], layout: str = "contiguous", *, scale: float | None = None,
          dtype: str = "DTYPE", maker: str = "torch.randn") -> str:
    """An expression making a tensor of logical `shape` with the given layout."""
    shape = tuple(shape)
    stored = list(shape)
    view = ""
    if layout == "transposed":
        stored[-2], stored[-1] = stored[-1], stored[-2]
        view = ".t()" if len(shape) == 2 else ".transpose(-2, -1)"
    elif layout == "permuted":
        stored[-3], stored[-2] = stored[-2], stored[-3]
        view = f".transpose({len(shape) - 3}, {len(shape) - 2})"
    elif layout == "strided":
        stored[-1] = 2 * stored[-1]
        view = "[..., ::2]"
    elif layout == "offset":
        stored[0] = stored[0] + 3
        view = "[3:]"
    elif layout == "expanded":
        stored[0] = 1
        view = f".expand({_dims(shape)})"
    elif layout != "contiguous":
        raise ValueError(f"unknown layout {layout!r}")
    base = f"{maker}({_dims(stored)}, dtype={dtype})" if dtype else f"{maker}({_dims(stored)})"
    if scale is not None and scale != 1:
        base = f"({base} * {scale!r})"
    return base + view


class KernelWriter:
    """Collects the pieces of one kernel file; `render` writes its source."""

    def __init__(self, dtype: str = "float32"):
        self.dtype = dtype
        self._inputs: list[tuple[str, str, tuple[str, ...]]] = []
        self._init: list[str] = []
        self._body: list[str] = []
        self._counts: dict[str, int] = {}

    def _name(self, prefix: str) -> str:
        n = self._counts.get(prefix, 0)
        self._counts[prefix] = n + 1
        return f"{prefix}{n}"

    def input(self, expr: str, *setup: str, prefix: str = "x") -> str:
        """A forward argument made by `expr` in get_inputs(); `setup` lines may change it in
        place, naming it `{name}` (e.g. '{name}[0, 1] = float("nan")')."""
        name = self._name(prefix)
        self._inputs.append((name, expr, tuple(line.format(name=name) for line in setup)))
        return name

    def member(self, expr: str, prefix: str = "fc") -> str:
        """A submodule or parameter of Model, built in __init__: returns `self.NAME`."""
        name = self._name(prefix)
        self._init.append(f"self.{name} = {expr}")
        return f"self.{name}"

    def buffer(self, expr: str, prefix: str = "buf") -> str:
        """A registered (frozen) buffer of Model: returns `self.NAME`."""
        name = self._name(prefix)
        self._init.append(f"self.register_buffer({name!r}, {expr})")
        return f"self.{name}"

    def let(self, expr: str, prefix: str = "y") -> str:
        """A forward line `NAME = expr`; returns NAME."""
        name = self._name(prefix)
        self._body.append(f"{name} = {expr}")
        return name

    def render(self, results: list[str], lighthouse: dict | None = None,
               docstring: str = "") -> str:
        lines = []
        if docstring:
            lines += [f'"""{docstring}"""']
        lines += ["import math", "", "import torch", "import torch.nn.functional as F", "",
                  f"DTYPE = torch.{self.dtype}"]
        if lighthouse:
            lines += [f"LIGHTHOUSE = dict({', '.join(f'{k}={v!r}' for k, v in lighthouse.items())})"]
        lines += ["", "", "class Model(torch.nn.Module):", "    def __init__(self):",
                  "        super().__init__()"]
        lines += [f"        {line}" for line in self._init]
        args = ", ".join(["self"] + [name for name, _, _ in self._inputs])
        lines += ["", f"    def forward({args}):"]
        lines += [f"        {line}" for line in self._body]
        returned = results[0] if len(results) == 1 else ", ".join(results)
        lines += [f"        return {returned}", "", "", "def get_inputs():"]
        for name, expr, setup in self._inputs:
            lines.append(f"    {name} = {expr}")
            lines += [f"    {line}" for line in setup]
        lines += [f"    return [{', '.join(name for name, _, _ in self._inputs)}]", "", "",
                  "def get_init_inputs():", "    return []", ""]
        return "\n".join(lines)


def sizes(small=(1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 32, 33, 63, 64, 65),
          large=(130, 131, 200, 257, 300), small_weight: int = 2, large_weight: int = 1,
          zero: bool = False) -> st.SearchStrategy[int]:
    """A size: mostly small, odd or not dividing 8/16/32/64, sometimes one that reaches the
    specialized schedules' tiles (large_weight / small_weight of the small ones' share),
    rarely 0 when `zero`; shrinks towards the first small one."""
    if SIZES:
        return st.sampled_from(SIZES)
    zero = zero and "zero-size" not in AVOID
    return st.sampled_from(tuple(small) * small_weight + tuple(large) * large_weight +
                           ((0,) if zero else ()))
