"""Kernels of the convolution family: 1-D, 2-D and 3-D convolutions and transposed
convolutions (torch.nn modules or F.convNd on a weight input) with any stride, padding,
dilation, output padding and groups (depthwise and channel multipliers included), sizes that
do not divide the register tiles, inputs as views, followed by a chain of epilogues (ReLU,
channel bias, tanh, a scale, residual adds, a second pointwise convolution, a GroupNorm),
sometimes a second result, and sometimes a tail: a pooling over the image dims (a mean, sum
or max, GELU before it, keepdim or not) or a classifier head (a flatten and a linear
layer)."""

from __future__ import annotations

import hypothesis.strategies as st

from .writer import DTYPES, KernelWriter, layouts, randn, scale_for

CHANNELS = st.sampled_from((1, 2, 3, 4, 5, 6, 8, 12, 16))
WINDOWS = st.sampled_from((1, 2, 3, 3, 4, 5))
STEPS = ("relu", "bias", "tanh", "scale", "residual", "pointwise", "norm", "keep")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def geometry(draw, rank: int, transposed: bool):
    """(window, stride, padding, dilation, output padding, image) per image dim, such that
    torch takes them and the output has at least one element."""
    dims = []
    for _ in range(rank):
        k, s, d = draw(WINDOWS), draw(st.sampled_from((1, 1, 2, 3))), draw(st.sampled_from((1, 1, 2, 3)))
        reach = d * (k - 1)
        p = draw(st.integers(0, reach if transposed else max(0, reach // 2 + 1)))
        out_pad = draw(st.integers(0, max(s, d) - 1)) if transposed else 0
        low = 1 if transposed else max(1, reach + 1 - 2 * p)
        size = draw(st.integers(low, low + draw(st.sampled_from((2, 7, 20, 40)))))
        if transposed and (size - 1) * s - 2 * p + reach + out_pad + 1 < 1:
            p = 0
        dims.append((k, s, p, d, out_pad, size))
    return dims


@st.composite
def convolution(draw, w: KernelWriter) -> tuple[str, tuple[int, ...]]:
    rank = draw(st.sampled_from((1, 2, 2, 3)))
    transposed = draw(st.sampled_from((False, False, True)))
    c = draw(CHANNELS)
    depthwise = draw(st.booleans())
    groups = c if depthwise else draw(st.sampled_from(_divisors(c)))
    # 16 or 32 channels of one group: the register tile may take them as its lanes
    f = groups * (draw(st.sampled_from((1, 2, 3))) if depthwise else draw(st.sampled_from((1, 2, 3, 4, 6, 8, 16, 32))))
    dims = draw(geometry(rank, transposed))
    batch = draw(st.sampled_from((1, 2, 3)))
    window = tuple(k for k, *_ in dims)
    kwargs = (f"stride={tuple(s for _, s, *_ in dims)}, padding={tuple(p for _, _, p, *_ in dims)}, "
              f"dilation={tuple(d for _, _, _, d, *_ in dims)}, groups={groups}")
    shape = (batch, c) + tuple(size for *_, size in dims)
    x = w.input(randn(shape, draw(layouts(shape))))
    bias = draw(st.booleans())
    name = f"ConvTranspose{rank}d" if transposed else f"Conv{rank}d"
    if transposed:
        kwargs += f", output_padding={tuple(o for *_, o, _ in dims)}"
    if draw(st.booleans()):
        conv = w.member(f"torch.nn.{name}({c}, {f}, {window}, {kwargs}, bias={bias}).to(DTYPE)",
                        prefix="conv")
        y = w.let(f"{conv}({x})")
    else:  # the functional form with the filter as an input
        wshape = (c, f // groups) + window if transposed else (f, c // groups) + window
        fan = (c // groups) * max(1, len(window))
        weight = w.input(randn(wshape, draw(layouts(wshape)), scale=scale_for(fan)))
        functional = f"F.conv_transpose{rank}d" if transposed else f"F.conv{rank}d"
        b = w.input(randn((f,), "contiguous")) if bias else "None"
        y = w.let(f"{functional}({x}, {weight}, {b}, {kwargs})")
    if transposed:
        out = tuple((size - 1) * s - 2 * p + d * (k - 1) + o + 1 for k, s, p, d, o, size in dims)
    else:
        out = tuple((size + 2 * p - d * (k - 1) - 1) // s + 1 for k, s, p, d, o, size in dims)
    return y, (batch, f) + out


def epilogue(draw, w: KernelWriter, step: str, y: str, shape: tuple[int, ...],
             history: list[tuple[str, tuple[int, ...]]], results: list[str]):
    rank = len(shape)
    if step == "relu":
        return w.let(f"F.relu({y})"), shape
    if step == "bias":
        b = w.member(f"torch.nn.Parameter(torch.randn({shape[1]}, {', '.join(['1'] * (rank - 2))}, "
                     f"dtype=DTYPE))", prefix="bias")
        return w.let(f"{y} + {b}"), shape
    if step == "tanh":
        return w.let(f"torch.tanh({y})"), shape
    if step == "scale":
        return w.let(f"{y} * 0.5 - 1.0"), shape
    if step == "residual":
        same = [name for name, s in history if s == shape and name != y]
        r = draw(st.sampled_from(same)) if same and draw(st.booleans()) else \
            w.input(randn(shape, draw(layouts(shape))))
        return w.let(f"{y} + {r}"), shape
    if step == "pointwise":
        f2 = draw(CHANNELS)
        conv = w.member(f"torch.nn.Conv{rank - 2}d({shape[1]}, {f2}, 1).to(DTYPE)", prefix="conv")
        return w.let(f"{conv}({y})"), (shape[0], f2) + shape[2:]
    if step == "norm":
        groups = draw(st.sampled_from(_divisors(shape[1])))
        norm = w.member(f"torch.nn.GroupNorm({groups}, {shape[1]}).to(DTYPE)", prefix="norm")
        return w.let(f"{norm}({y})"), shape
    if step == "keep":
        results.append(y)
        return y, shape
    raise ValueError(step)


@st.composite
def convolution_kernels(draw) -> str:
    w = KernelWriter(draw(st.sampled_from(DTYPES)))
    y, shape = draw(convolution(w))
    history, results = [(y, shape)], []
    for step in draw(st.lists(st.sampled_from(STEPS), max_size=3)):
        y, shape = epilogue(draw, w, step, y, shape, history, results)
        history.append((y, shape))
    y = draw(tail(w, y, shape))
    results.append(y)
    return w.render(list(dict.fromkeys(results)))


@st.composite
def tail(draw, w: KernelWriter, y: str, shape: tuple[int, ...]) -> str:
    """The last step: none, a pooling over image dims, or a flatten and a linear layer."""
    kind = draw(st.sampled_from((None, None, "pool", "head")))
    rank = len(shape)
    if kind == "pool":
        dims = draw(st.sampled_from((tuple(range(2, rank)), (rank - 1,))))
        reduce = draw(st.sampled_from(("mean", "sum", "amax")))
        before = draw(st.sampled_from(("", "F.gelu")))
        return w.let(f"torch.{reduce}({before}({y}), dim={dims}, keepdim={draw(st.booleans())})")
    if kind == "head":
        features = 1
        for n in shape[1:]:
            features *= n
        linear = w.member(f"torch.nn.Linear({features}, {draw(st.sampled_from((1, 5, 17)))})"
                          f".to(DTYPE)", prefix="fc")
        return w.let(f"{linear}(torch.flatten({y}, 1))")
    return y
