"""Kernels of the cross-entropy family: `F.cross_entropy`, `nn.CrossEntropyLoss`, and
`F.nll_loss(F.log_softmax(x, 1), t)`; N from 0, C from 1 to odd and large, class weights
(an input, a frozen buffer, the module's own), ignore_index (the default -100, -1, or a real
class), label smoothing, probability targets, none/mean/sum, N-D and unbatched inputs, the
[B, T, C] -> [B*T, C] flattening of language models, logits upcast with `.float()`, NaN and
infinities in live and in ignored rows, f32/f16/bf16 logits in any layout."""

from __future__ import annotations

import hypothesis.strategies as st

from .writer import AVOID, DTYPES, KernelWriter, layouts, randn, sizes

ROWS = st.sampled_from((1, 2, 3, 5, 8, 17, 0, 33, 64, 130) if "zero-size" not in AVOID else
                       (1, 2, 3, 5, 8, 17, 33, 64, 130))
CLASSES = sizes(small=(1, 2, 3, 5, 7, 16, 31, 100, 257), large=(1000, 1001, 4099, 32003))
MAX_ELEMENTS = 300_000


def _index(flat: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        flat, r = divmod(flat, d)
        out.append(r)
    return tuple(reversed(out))


@st.composite
def cross_entropy_kernels(draw) -> str:
    w = KernelWriter(draw(st.sampled_from(DTYPES)))
    c = draw(CLASSES)
    n = draw(ROWS)
    shape_kind = draw(st.sampled_from(("rows", "rows", "nd", "flatten", "unbatched")))
    spatial = draw(st.sampled_from(((3,), (2, 5)))) if shape_kind == "nd" else ()
    if shape_kind == "flatten":
        batch = (draw(st.sampled_from((1, 2, 3))), n)  # [B, T, C] logits, [B, T] targets
        samples = batch
    elif shape_kind == "unbatched":
        samples = ()
    else:
        samples = (n,) + spatial
    count = 1
    for d in samples:
        count *= d
    if count * c > MAX_ELEMENTS:
        c = max(1, MAX_ELEMENTS // max(count, 1) // 2 * 2 + 1)
    if shape_kind == "flatten":
        logits_shape = samples + (c,)
    elif shape_kind == "unbatched":
        logits_shape = (c,)
    else:
        logits_shape = (n, c) + spatial
    probabilities = draw(st.integers(0, 3)) == 0
    form = draw(st.sampled_from(("functional", "module", "nll")))
    reduction = draw(st.sampled_from(("mean", "sum", "none")))
    smoothing = 0.0 if form == "nll" else draw(st.sampled_from((0.0, 0.1, 0.3, 1.0)))
    if probabilities:
        form = "functional" if form == "nll" else form
        ignore = "absent"
    else:
        ignore = draw(st.sampled_from(("default", "absent", "class", "minus_one")))
    ignore_index = {"default": -100, "absent": -100, "minus_one": -1}.get(ignore)
    if ignore == "class":
        ignore_index = draw(st.integers(0, c - 1))
    every = draw(st.sampled_from((3, 2, 7, 1)))  # every k-th sample is ignored

    # the logits and their non-finite entries, in live and in ignored samples
    setup = []
    for kind, where in draw(st.lists(st.tuples(st.sampled_from(("nan", "inf", "-inf")),
                                               st.sampled_from(("live", "ignored"))), max_size=2)):
        if count == 0:
            break
        flat = 0 if where == "ignored" or every == 1 else min(1, count - 1)
        if "nonfinite-ignored" in AVOID and ignore != "absent" and flat % every == 0:
            continue  # sample `flat` is ignored (every k-th one, from 0, is)
        sample = _index(flat, samples)
        cls = draw(st.integers(0, c - 1))
        position = sample[:1] + (cls,) + sample[1:] if shape_kind not in ("flatten", "unbatched") \
            else sample + (cls,)
        setup.append(f"{{name}}[{', '.join(map(str, position))}] = float({kind!r})")
    scale = draw(st.sampled_from((None, 4.0, 30.0)))
    layout = draw(layouts(logits_shape).filter(lambda name: not setup or name != "expanded"))
    x = w.input(randn(logits_shape, layout, scale=scale), *setup)

    # the targets
    if probabilities:
        t_shape = logits_shape
        target = w.input(f"torch.softmax({randn(t_shape, draw(layouts(t_shape)))}, dim={0 if shape_kind == 'unbatched' else (-1 if shape_kind == 'flatten' else 1)})"
                         if draw(st.booleans()) else f"torch.rand({', '.join(map(str, t_shape))}, dtype=DTYPE)",
                         prefix="t")
    else:
        dims = ", ".join(map(str, samples))
        t_setup = []
        if ignore in ("default", "minus_one"):
            t_setup.append(f"{{name}}.view(-1)[::{every}] = {ignore_index}")
        elif ignore == "class":
            t_setup.append(f"{{name}}.view(-1)[::{every}] = {ignore_index}")
        target = w.input(f"torch.randint(0, {c}, ({dims}{',' if len(samples) == 1 else ''}))"
                         if samples else f"torch.tensor({draw(st.integers(0, c - 1))})",
                         *([] if not samples else t_setup), prefix="t")

    # class weights; the logits upcast with .float() (then the weights too)
    upcast = w.dtype != "float32" and draw(st.booleans())
    weight_kind = draw(st.sampled_from(("none", "input", "buffer")))
    weight_expr = f"torch.rand({c}, dtype={'torch.float32' if upcast else 'DTYPE'}) * 2"
    weight = None
    if weight_kind == "input":
        weight = w.input(f"torch.rand({c}, dtype=DTYPE) * 2", prefix="weight")
    elif weight_kind == "buffer" and form != "module":
        weight = w.buffer(weight_expr, prefix="class_weight")

    x_used = x
    if shape_kind == "flatten":
        x_used = w.let(f"{x}.reshape(-1, {c})", prefix="z")
        target = w.let(f"{target}.reshape(-1{', ' + str(c) if probabilities else ''})", prefix="target")
    if upcast:
        x_used = w.let(f"{x_used}.float()", prefix="z")
        if probabilities:
            target = w.let(f"{target}.float()", prefix="target")
        if weight_kind == "input":
            weight = w.let(f"{weight}.float()", prefix="wf")

    kwargs = []
    if weight is not None:
        kwargs.append(f"weight={weight}")
    if ignore in ("class", "minus_one"):
        kwargs.append(f"ignore_index={ignore_index}")
    if reduction != "mean":
        kwargs.append(f"reduction={reduction!r}")
    if smoothing:
        kwargs.append(f"label_smoothing={smoothing}")
    if form == "module" and weight_kind != "input":
        module_kwargs = list(kwargs)
        if weight_kind == "buffer":
            module_kwargs.insert(0, f"weight={weight_expr}")
        loss_fn = w.member(f"torch.nn.CrossEntropyLoss({', '.join(module_kwargs)})", prefix="loss")
        loss = w.let(f"{loss_fn}({x_used}, {target})", prefix="loss")
    elif form == "nll":
        dim = 0 if shape_kind == "unbatched" else 1
        logp = w.let(f"F.log_softmax({x_used}, dim={dim})", prefix="logp")
        loss = w.let(f"F.nll_loss({', '.join([logp, target] + kwargs)})", prefix="loss")
    else:
        loss = w.let(f"F.cross_entropy({', '.join([x_used, target] + kwargs)})", prefix="loss")
    return w.render([loss])
