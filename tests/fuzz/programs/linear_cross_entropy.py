"""Kernels of the linear cross-entropy family: the LM head and its loss,
`F.cross_entropy(F.linear(h, W[, b]), y)` or `nn.Linear` with `nn.CrossEntropyLoss`; N, D
and V odd or not dividing the tiles, 3-D hidden states flattened with view(-1, V), a bias,
class weights, ignore_index (default, -1, a real class), label smoothing, none/mean/sum,
all rows ignored, large logits, f32/f16/bf16 hidden states and weights in any layout."""

from __future__ import annotations

import hypothesis.strategies as st

from .writer import DTYPES, KernelWriter, layouts, randn, sizes

ROWS = sizes(small=(2, 3, 5, 8, 17, 33, 64), large=(130, 257, 300))
DEPTH = sizes(small=(1, 3, 8, 16, 24, 33), large=(64, 96, 128))
CLASSES = sizes(small=(2, 3, 7, 31, 64, 100, 257), large=(1000, 1001, 4099))
MAX_ELEMENTS = 400_000


@st.composite
def linear_cross_entropy_kernels(draw) -> str:
    w = KernelWriter(draw(st.sampled_from(DTYPES)))
    n, d, v = draw(ROWS), draw(DEPTH), draw(CLASSES)
    if n * v > MAX_ELEMENTS:
        v = MAX_ELEMENTS // n
    batch = draw(st.sampled_from((None, None, 2, 3)))  # [B, T, D] hidden states
    h_shape = (batch, n, d) if batch else (n, d)
    rows = (batch, n) if batch else (n,)
    scale = draw(st.sampled_from((None, 5.0, 300.0)))
    h = w.input(randn(h_shape, draw(layouts(h_shape)), scale=scale), prefix="h")
    bias = draw(st.booleans())
    form = draw(st.sampled_from(("functional", "module")))
    if form == "module":
        head = w.member(f"torch.nn.Linear({d}, {v}, bias={bias}, dtype=DTYPE)", prefix="head")
        logits = w.let(f"{head}({h})", prefix="s")
    else:
        weight = w.input(randn((v, d), draw(layouts((v, d))), scale=1 / max(d, 1) ** 0.5),
                         prefix="w")
        args = [h, weight]
        if bias:
            args.append(w.input(randn((v,), "contiguous"), prefix="b"))
        logits = w.let(f"F.linear({', '.join(args)})", prefix="s")
    ignore = draw(st.sampled_from(("default", "absent", "class", "minus_one", "all")))
    ignore_index = {"default": -100, "absent": -100, "minus_one": -1, "all": -100}.get(ignore)
    if ignore == "class":
        ignore_index = draw(st.integers(0, v - 1))
    every = draw(st.sampled_from((3, 2, 7)))
    setup = []
    if ignore == "all":
        setup.append(f"{{name}}.view(-1)[:] = {ignore_index}")
    elif ignore != "absent":
        setup.append(f"{{name}}.view(-1)[::{every}] = {ignore_index}")
    dims = ", ".join(map(str, rows))
    target = w.input(f"torch.randint(0, {v}, ({dims}{',' if len(rows) == 1 else ''}))", *setup,
                     prefix="t")
    if batch:
        logits = w.let(f"{logits}.view(-1, {v})", prefix="s")
        target = w.let(f"{target}.view(-1)", prefix="target")
    kwargs = []
    weight_kind = draw(st.sampled_from(("none", "input", "buffer")))
    if weight_kind == "input":
        kwargs.append(f"weight={w.input(f'torch.rand({v}, dtype=DTYPE) * 2', prefix='cw')}")
    elif weight_kind == "buffer":
        kwargs.append(f"weight={w.buffer(f'torch.rand({v}, dtype=DTYPE) * 2', prefix='cw')}")
    if ignore in ("class", "minus_one"):
        kwargs.append(f"ignore_index={ignore_index}")
    reduction = draw(st.sampled_from(("mean", "sum", "none")))
    if reduction != "mean":
        kwargs.append(f"reduction={reduction!r}")
    smoothing = draw(st.sampled_from((0.0, 0.1, 1.0)))
    if smoothing:
        kwargs.append(f"label_smoothing={smoothing}")
    loss = w.let(f"F.cross_entropy({', '.join([logits, target] + kwargs)})", prefix="loss")
    return w.render([loss])
