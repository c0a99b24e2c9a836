"""Kernels of poolings: max, average and min (a max of the negation) over 1, 2 or 3 image
dims, windows of 1-12 taps per dim (often unequal), strides up to the window, padding up to
half the window, dilation (max), ceil mode, count_include_pad and divisor_override
(average); inputs of any layout, sometimes with NaN, infinities and signed zeros; an
elementwise step or a second use of the result after; f32/f16/bf16 (average pooling over 3
dims is f32: torch has no f16/bf16 kernel for it)."""

from __future__ import annotations

import math

import hypothesis.strategies as st

from .writer import DTYPES, KernelWriter, layouts, randn

MAX_ELEMENTS = 150_000
SPECIALS = ('float("nan")', 'float("inf")', 'float("-inf")', "-0.0", "0.0")


@st.composite
def pooling_kernels(draw) -> str:
    rank = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(("max", "max", "avg", "avg", "min")))
    dtype = "float32" if kind == "avg" and rank == 3 else draw(st.sampled_from(DTYPES))
    w = KernelWriter(dtype)
    kernel = [draw(st.integers(1, 12)) for _ in range(rank)]
    if all(k == 1 for k in kernel):
        kernel[-1] = draw(st.integers(2, 12))
    stride = [draw(st.integers(1, k)) for k in kernel]
    padding = [draw(st.integers(0, k // 2)) for k in kernel]
    dilation = [draw(st.integers(1, 3)) for _ in kernel] if kind != "avg" else [1] * rank
    ceil_mode = draw(st.booleans())
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    image = [max(s, draw(st.integers(1, 70))) for s in span]
    if rank == 1 and draw(st.booleans()):
        image[0] = draw(st.integers(100, 700))
    batch, channels = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    while batch * channels * math.prod(image) > MAX_ELEMENTS:
        i = image.index(max(image))
        image[i] = max(span[i], image[i] // 2)
        if batch * channels * math.prod(image) > MAX_ELEMENTS and image[i] == span[i]:
            batch = channels = 1
            break
    shape = (batch, channels, *image)
    setup = []
    if draw(st.integers(0, 3)) == 0:  # a few NaN, infinities and signed zeros along the rows
        for i, value in enumerate(SPECIALS * 2):
            at = (i % batch, i % channels) + tuple((7 * i + 3 * j) % n for j, n in enumerate(image))
            setup.append(f"{{name}}[{', '.join(map(str, at))}] = {value}")
    x = w.input(randn(shape, draw(layouts(shape))), *setup)
    args = f"{tuple(kernel)}, {tuple(stride)}, {tuple(padding)}"
    if kind == "avg":
        include = draw(st.booleans())
        override = draw(st.sampled_from((None, None, 3))) if rank > 1 else None
        extra = f", ceil_mode={ceil_mode}, count_include_pad={include}"
        extra += f", divisor_override={override}" if override else ""
        y = w.let(f"F.avg_pool{rank}d({x}, {args}{extra})", prefix="p")
    else:
        sign = "-" if kind == "min" else ""
        y = w.let(f"{sign}F.max_pool{rank}d({sign}{x}, {args}, {tuple(dilation)}, "
                  f"ceil_mode={ceil_mode})", prefix="p")
    after = draw(st.sampled_from((None, None, "relu", "scale", "second")))
    if after == "relu":
        return w.render([w.let(f"F.relu({y})", prefix="e")])
    if after == "scale":
        return w.render([w.let(f"{y} * 2.0 + 1.0", prefix="e")])
    if after == "second":
        return w.render([y, w.let(f"{y}.amax(-1)", prefix="e")])
    return w.render([y])
