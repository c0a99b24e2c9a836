"""Kernels of row reductions and elementwise chains: softmax and log-softmax over any dim,
layer norm (functional with input affine, or the module), RMS norm (module, functional, or
by hand with `x.pow(2).mean(...)`), group norm, batch norm in eval mode (running statistics
as buffers), scans (cumsum, logcumsumexp, backwards through flips, exclusive through a
cat), top-k and sorts (their indices read back through a gather, which ties cannot
change; summed back onto x's shape), each between elementwise chains (integer and float powers, tanh-GELU, exp,
sigmoid, clamps, selects, a second input broadcast in); zero-size and size-1 dims, any
layout, f32/f16/bf16."""

from __future__ import annotations

import hypothesis.strategies as st

from .writer import AVOID, DTYPES, KernelWriter, allowed, layouts, randn, sizes

DIM = sizes(small=(1, 2, 3, 5, 7, 8, 16, 17, 31, 33, 64, 65), large=(130, 257, 300), zero=True)
MAX_ELEMENTS = 200_000
UNARY = allowed((
    "{x} * 1.5", "{x} + 0.5", "torch.tanh({x})", "torch.sigmoid({x})", "F.relu({x})",
    "F.silu({x})", "{x} ** 2", "{x}.pow(3)", "torch.pow({x}, 2)", "torch.pow({x}, 3.0)",
    "{x}.abs()", "torch.sqrt({x}.abs() + 1.0)", "torch.rsqrt({x} * {x} + 1.0)",
    "torch.exp({x}.clamp(max=4.0))", "F.elu({x})", "torch.selu({x})",
    "torch.log({x}.abs() + 1.0)", "F.gelu({x})",
    "0.5 * {x} * (1.0 + torch.tanh(0.7978845608 * ({x} + 0.044715 * {x} ** 3)))",
    "0.5 * {x} * (1.0 + torch.tanh(0.7978845608 * ({x} + 0.044715 * {x} * {x} * {x})))",
    "torch.clamp({x}, -1.0, 1.0)", "torch.where({x} > 0, {x}, 0.1 * {x})", "torch.erf({x})",
    "{x} - {x}.mean(dim=-1, keepdim=True)",
))


def chain(draw, w: KernelWriter, x: str, shape: tuple[int, ...]) -> str:
    """0-3 elementwise steps; a second input (broadcast along dim 0 or not) sometimes."""
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.integers(0, 4)) == 0:
            other = shape if draw(st.booleans()) else (1,) + shape[1:]
            y = w.input(randn(other, draw(layouts(other))))
            op = draw(st.sampled_from(("+", "*", "-")))
            x = w.let(f"{x} {op} {y}", prefix="e")
        else:
            x = w.let(draw(st.sampled_from(UNARY)).format(x=x), prefix="e")
    return x


def core(draw, w: KernelWriter, x: str, shape: tuple[int, ...]) -> str:
    rank = len(shape)
    dims = ", ".join(map(str, shape))
    kind = draw(st.sampled_from(("softmax", "log_softmax", "layer_norm", "rms_norm",
                                 "group_norm", "batch_norm", "scan", "topk", "sort", "none")))
    if kind == "scan" and rank >= 1:
        dim = draw(st.integers(-rank, rank - 1))
        form = draw(st.sampled_from((
            "torch.cumsum({x}, {d})", "{x}.cumsum({d})", "torch.logcumsumexp({x}, {d})",
            "torch.cumsum({x}.flip({d}), {d}).flip({d})",
            "torch.cat((torch.zeros_like({x}.narrow({d}, 0, 1)), "
            "torch.cumsum({x}, {d}).narrow({d}, 0, {x}.shape[{d}] - 1)), {d})")))
        if "narrow" in form and shape[dim] == 0:
            return x
        return w.let(form.format(x=x, d=dim), prefix="r")
    if kind in ("topk", "sort") and rank >= 1 and shape[-1] > 0:
        dim = draw(st.integers(-rank, rank - 1))
        if shape[dim] == 0:
            return x
        largest = draw(st.booleans())
        if kind == "topk":
            k = draw(st.sampled_from(sorted({1, min(3, shape[dim]), min(33, shape[dim]), shape[dim]})))
            picked = w.let(f"torch.topk({x}, {k}, dim={dim}, largest={largest})", prefix="r")
        else:
            picked = w.let(f"torch.sort({x}, dim={dim}, descending={largest})", prefix="r")
        # back to x's shape for the chain after it
        return w.let(f"{x} + ({picked}[0] + torch.gather({x}, {dim}, {picked}[1])).sum({dim}, keepdim=True)",
                     prefix="r")
    if kind in ("softmax", "log_softmax"):
        dim = draw(st.integers(-rank, rank - 1))
        form = draw(st.sampled_from((f"torch.{kind}({{x}}, dim={dim})",
                                     f"F.{kind}({{x}}, dim={dim})", f"{{x}}.{kind}({dim})")))
        return w.let(form.format(x=x), prefix="r")
    if kind in ("layer_norm", "rms_norm"):
        k = draw(st.integers(1, rank))
        normalized = shape[rank - k:]
        nd = ", ".join(map(str, normalized))
        eps = draw(st.sampled_from((1e-5, 1e-6, 0.1)))
        affine = draw(st.sampled_from(("module", "inputs", "none")))
        if kind == "rms_norm" and "int-pow" not in AVOID and draw(st.booleans()):  # by hand, as KernelBench and LLMs do
            axes = tuple(range(rank - k, rank))
            scaled = w.let(f"{x} * torch.rsqrt({x}.pow(2).mean(dim={axes}, keepdim=True) + {eps})",
                           prefix="r")
            if affine == "none":
                return scaled
            g = w.input(randn(normalized, draw(layouts(normalized))), prefix="g")
            return w.let(f"{scaled} * {g}", prefix="r")
        module = "LayerNorm" if kind == "layer_norm" else "RMSNorm"
        if affine == "module":
            norm = w.member(f"torch.nn.{module}(({nd},), eps={eps}).to(DTYPE)", prefix="norm")
            return w.let(f"{norm}({x})", prefix="r")
        if affine == "inputs":
            g = w.input(randn(normalized, draw(layouts(normalized))), prefix="g")
            extra = f", {g}"
            if kind == "layer_norm":
                b = w.input(randn(normalized, draw(layouts(normalized))), prefix="b")
                extra += f", {b}"
        else:
            extra = ""
        return w.let(f"F.{kind}({x}, ({nd},){extra}, eps={eps})", prefix="r")
    if kind == "group_norm" and rank >= 2 and shape[1] > 0:
        c = shape[1]
        spatial = _count(shape[2:])
        # torch wants more than one value per group
        fits = [g for g in (1, 2, 3, 4, c) if c % g == 0 and c // g * spatial > 1]
        if not fits:
            return x
        groups = draw(st.sampled_from(fits))
        affine = draw(st.booleans())
        norm = w.member(f"torch.nn.GroupNorm({groups}, {c}, affine={affine}).to(DTYPE)", prefix="norm")
        return w.let(f"{norm}({x})", prefix="r")
    if kind == "batch_norm" and 2 <= rank <= 4 and shape[1] > 0:
        c = shape[1]
        module = {2: "BatchNorm1d", 3: "BatchNorm1d", 4: "BatchNorm2d"}[rank]
        norm = w.member(f"torch.nn.{module}({c}, affine={draw(st.booleans())}).to(DTYPE)",
                        prefix="norm")
        # eval mode (load_kernel calls model.eval()) with made-up running statistics
        w._init.append(f"{norm}.running_mean.copy_(torch.randn({c}))")
        w._init.append(f"{norm}.running_var.copy_(torch.rand({c}) + 0.5)")
        return w.let(f"{norm}({x})", prefix="r")
    return x


@st.composite
def row_kernels(draw) -> str:
    w = KernelWriter(draw(st.sampled_from(DTYPES)))
    rank = draw(st.integers(1, 4))
    shape = []
    for _ in range(rank):
        shape.append(draw(DIM))
    while 0 not in shape and _count(shape) > MAX_ELEMENTS:
        shape[shape.index(max(shape))] //= 2
    shape = tuple(shape)
    x = w.input(randn(shape, draw(layouts(shape)), scale=draw(st.sampled_from((None, 3.0)))))
    before = chain(draw, w, x, shape)
    y = chain(draw, w, core(draw, w, before, shape), shape)
    second = draw(st.sampled_from((None, None, None, "before", "double")))
    if second == "before" and before != x:
        return w.render([y, before])
    if second == "double":
        return w.render([y, w.let(f"{x} * 2.0", prefix="e")])
    return w.render([y])


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
