"""Kernels of the matmul family: matmul / bmm / broadcast batched matmul / linear layers,
operands as transposed or sliced views or transposed in the forward, followed by a chain of
epilogues (bias rows and columns, both GELUs and the tanh formula, integer and float powers,
tanh, residual adds of inputs or of earlier values), transposes, reshapes, further matmuls,
values read twice, sums, maxima and means over one of the last two dims, 1-D max and average
pools over the last dim, several results and a result returned twice."""

from __future__ import annotations

import hypothesis.strategies as st

from .writer import AVOID, DTYPES, KernelWriter, allowed, layouts, randn, scale_for, sizes

BATCH = st.sampled_from((1, 2, 3, 4, 5))
STEPS = ("bias", "gelu", "pow", "tanh", "unary", "residual", "transpose", "reshape", "matmul",
         "twice", "keep", "reduce", "pool")


def operand(draw, w: KernelWriter, shape: tuple[int, ...], scale: float | None = None) -> str:
    """An input of logical `shape`: passed in any layout, or stored transposed and
    transposed in the forward."""
    if len(shape) >= 2 and draw(st.booleans()):
        stored = shape[:-2] + (shape[-1], shape[-2])
        name = w.input(randn(stored, draw(layouts(stored)), scale=scale))
        return f"{name}.t()" if len(shape) == 2 else f"{name}.transpose(-2, -1)"
    return w.input(randn(shape, draw(layouts(shape)), scale=scale))


def contraction(draw, w: KernelWriter) -> tuple[str, tuple[int, ...]]:
    kind = draw(st.sampled_from(("mm", "bmm", "broadcast", "linear", "functional")))
    m, k, n = draw(sizes()), draw(sizes(large_weight=2)), draw(sizes())
    s = scale_for(k)
    if kind == "mm":
        a, b = operand(draw, w, (m, k)), operand(draw, w, (k, n), s)
        form = draw(st.sampled_from(("{a} @ {b}", "torch.matmul({a}, {b})", "torch.mm({a}, {b})")))
        return w.let(form.format(a=a, b=b)), (m, n)
    if kind == "bmm":
        batch = draw(BATCH)
        a, b = operand(draw, w, (batch, m, k)), operand(draw, w, (batch, k, n), s)
        form = draw(st.sampled_from(("{a} @ {b}", "torch.bmm({a}, {b})",
                                     "torch.einsum('bmk,bkn->bmn', {a}, {b})")))
        return w.let(form.format(a=a, b=b)), (batch, m, n)
    if kind == "broadcast":
        batch = draw(BATCH)
        shapes = draw(st.sampled_from((
            ((batch, m, k), (k, n), (batch, m, n)),
            ((m, k), (batch, k, n), (batch, m, n)),
            ((batch, 1, m, k), (2, k, n), (batch, 2, m, n)),
        )))
        a, b = operand(draw, w, shapes[0]), operand(draw, w, shapes[1], s)
        return w.let(f"{a} @ {b}"), shapes[2]
    lead = draw(st.sampled_from(((m,), (draw(BATCH), m))))
    x = operand(draw, w, lead + (k,))
    bias = draw(st.booleans())
    if kind == "linear":
        fc = w.member(f"torch.nn.Linear({k}, {n}, bias={bias}).to(DTYPE)")
        return w.let(f"{fc}({x})"), lead + (n,)
    weight = operand(draw, w, (n, k), s)
    b = w.input(randn((n,), draw(layouts((n,))))) if bias else "None"
    return w.let(f"F.linear({x}, {weight}, {b})"), lead + (n,)


def epilogue(draw, w: KernelWriter, step: str, y: str, shape: tuple[int, ...],
             history: list[tuple[str, tuple[int, ...]]], results: list[str], state: dict):
    """Apply one chain step to (y, shape); returns the new (y, shape). At most three
    contractions in all (`state["matmuls"]` counts them)."""
    rank = len(shape)
    if step == "bias":
        bshape = (shape[-2], 1) if rank >= 2 and draw(st.booleans()) else (shape[-1],)
        if draw(st.booleans()):
            b = w.member(f"torch.nn.Parameter(torch.randn({', '.join(map(str, bshape))}, "
                         f"dtype=DTYPE))", prefix="bias")
        else:
            b = w.input(randn(bshape, draw(layouts(bshape))))
        return w.let(f"{y} + {b}"), shape
    if step == "gelu":
        form = draw(st.sampled_from(allowed((
            "F.gelu({y})", "F.gelu({y}, approximate='tanh')",
            "0.5 * {y} * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * ({y} + 0.044715 * torch.pow({y}, 3.0))))",
            "0.5 * {y} * (1.0 + torch.tanh(0.7978845608 * ({y} + 0.044715 * {y} ** 3)))",
            "0.5 * {y} * (1.0 + torch.tanh(0.7978845608 * ({y} + 0.044715 * {y} * {y} * {y})))",
        ))))
        return w.let(form.format(y=y)), shape
    if step == "pow" and "int-pow" not in AVOID:
        form = draw(st.sampled_from(("{y} ** 2", "{y}.pow(3)", "torch.pow({y}, 2)",
                                     "torch.pow({y}, 3.0)", "{y} * {y} ** 2")))
        return w.let(form.format(y=y)), shape
    if step in ("tanh", "pow"):
        return w.let(f"torch.tanh({y})"), shape
    if step == "unary":
        form = draw(st.sampled_from(("F.relu({y})", "torch.sigmoid({y})", "F.silu({y})",
                                     "{y} * 0.5", "2.0 * {y} - 1.0", "{y} / 3.0")))
        return w.let(form.format(y=y)), shape
    if step == "residual":
        same = [name for name, s in history if s == shape and name != y]
        if same and draw(st.booleans()):
            r = draw(st.sampled_from(same))
        else:
            r = w.input(randn(shape, draw(layouts(shape))))
        return w.let(f"{y} + {r}"), shape
    if step == "transpose":
        if rank < 2:
            return y, shape
        if rank == 2:
            expr, new = f"{y}.t()", (shape[1], shape[0])
        else:
            dims = draw(st.sampled_from(((rank - 2, rank - 1), (0, 1), (rank - 3, rank - 1))))
            new = list(shape)
            new[dims[0]], new[dims[1]] = new[dims[1]], new[dims[0]]
            expr, new = f"{y}.transpose({dims[0]}, {dims[1]})", tuple(new)
        if draw(st.booleans()):
            expr += ".contiguous()"
        return w.let(expr), new
    if step == "reshape":
        if rank >= 3:
            if draw(st.booleans()):
                new = (shape[0] * shape[1],) + shape[2:]
            else:
                new = shape[:-2] + (shape[-2] * shape[-1],)
        elif rank == 2:
            factor = next((f for f in (2, 3, 5, 7) if shape[0] % f == 0 and shape[0] > f), None)
            new = (factor, shape[0] // factor, shape[1]) if factor else (shape[0] * shape[1],)
        else:
            new = (1, shape[0])
        return w.let(f"{y}.reshape({', '.join(map(str, new))})"), new
    if step == "matmul":
        if state["matmuls"] >= 3:
            return y, shape
        state["matmuls"] += 1
        n2 = draw(sizes())
        if rank == 2 and draw(st.booleans()):
            m2 = draw(sizes())
            a = operand(draw, w, (m2, shape[0]), scale_for(shape[0]))
            return w.let(f"{a} @ {y}"), (m2, shape[1])
        if draw(st.booleans()):
            fc = w.member(f"torch.nn.Linear({shape[-1]}, {n2}, bias={draw(st.booleans())}).to(DTYPE)")
            return w.let(f"{fc}({y})"), shape[:-1] + (n2,)
        b = operand(draw, w, (shape[-1], n2), scale_for(shape[-1]))
        return w.let(f"{y} @ {b}"), shape[:-1] + (n2,)
    if step == "twice":
        form = draw(st.sampled_from(("{y} * {y}", "{y} * torch.sigmoid({y})",
                                     "{y} + torch.tanh({y})", "({y} - {y}.mean()) * {y}")))
        return w.let(form.format(y=y)), shape
    if step == "keep":
        results.append(y)
        return y, shape
    if step == "pool":  # a 1-D max or average pool over the last dim (KernelBench 55, 98)
        windows = [k for k in (2, 3, 4, 16) if k <= shape[-1]]
        if rank > 3 or not windows:
            return y, shape
        k = draw(st.sampled_from(windows))
        stride = draw(st.sampled_from((k, max(1, k - 1))))
        pool = draw(st.sampled_from(("F.max_pool1d", "F.avg_pool1d")))
        x = f"{y}.unsqueeze(-2)" if rank < 3 else y
        expr = f"{pool}({x}, {k}, {stride})" + (".squeeze(-2)" if rank < 3 else "")
        return w.let(expr), shape[:-1] + ((shape[-1] - k) // stride + 1,)
    if step == "reduce":  # over one of the two last dims, at least one dim kept
        if rank < 2:
            return y, shape
        dim = draw(st.sampled_from((rank - 1, rank - 2)))
        keepdim = draw(st.booleans())
        form = draw(st.sampled_from(("{y}.sum(dim={d}, keepdim={k})",
                                     "torch.amax({y}, dim={d}, keepdim={k})",
                                     "{y}.mean(dim={d}, keepdim={k})")))
        new = shape[:dim] + ((1,) if keepdim else ()) + shape[dim + 1:]
        return w.let(form.format(y=y, d=dim, k=keepdim)), new
    raise ValueError(step)


@st.composite
def matmul_kernels(draw) -> str:
    w = KernelWriter(draw(st.sampled_from(DTYPES)))
    y, shape = contraction(draw, w)
    history = [(y, shape)]
    results: list[str] = []
    state = {"matmuls": 1}
    for step in draw(st.lists(st.sampled_from(STEPS), max_size=5)):
        y, shape = epilogue(draw, w, step, y, shape, history, results, state)
        history.append((y, shape))
    results.append(y)
    if "return-twice" in AVOID:
        results = list(dict.fromkeys(results))
    return w.render(results)
