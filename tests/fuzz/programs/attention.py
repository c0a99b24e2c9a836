"""Kernels of the attention family: `F.scaled_dot_product_attention` and attention written
by hand (`softmax(q @ k^T * scale [+ mask | masked_fill]) @ v`, or ReLU instead of the
softmax; a causal mask also as MinGPT's buffer); S from 1, S_q != S_kv (odd),
D in {16, 64, 80, 128}, scales, boolean / float / broadcast masks including fully masked
rows, causal, grouped-query attention (enable_gqa, or K/V repeated by hand), q/k/v in
[B, H, S, D] or as [B, S, H, D].transpose(1, 2) views, the heads merged back after."""

from __future__ import annotations

import hypothesis.strategies as st

from .writer import DTYPES, KernelWriter, layouts, randn, sizes

SEQ = sizes(small=(1, 2, 3, 5, 7, 8, 16, 17, 31, 33, 63, 64, 65), large=(100, 129, 130, 257, 300))
HEAD_DIM = st.sampled_from((16, 64, 80, 128))
SCALES = st.sampled_from((None, 1.0, 0.125, 0.3, 2.0))
MAX_WORK = 12_000_000  # multiply-adds of Q K^T: [1, 1, 300, 300, 128] fits, [2, 4, 300, 257, 128] is halved


def qkv(draw, w: KernelWriter, b: int, h: int, s: int, d: int, scale: float | None = None) -> str:
    shape = (b, h, s, d)
    return w.input(randn(shape, draw(layouts(shape, weights=(3, 1, 3, 1, 1, 1))), scale=scale))


def query_scale(scale: float | None, d: int) -> float | None:
    """Queries shrunk so that scores stay of size ~1.5 whatever the scale (the rounding of
    f16/bf16 scores of size 20 would swamp the comparison with torch, which rounds them)."""
    if scale is None:
        return None
    factor = 1.5 / (scale * d ** 0.5)
    return float(f"{factor:.3g}") if factor < 1 else None


def mask_input(draw, w: KernelWriter, kind: str, b: int, h: int, sq: int, skv: int):
    """A boolean (True = attend) or float (added) mask of a shape broadcasting to
    [b, h, sq, skv], with fully masked query rows sometimes; returns its name."""
    shape = draw(st.sampled_from(((sq, skv), (b, 1, sq, skv), (1, h, sq, skv), (b, h, sq, skv),
                                  (1, 1, 1, skv), (b, 1, 1, skv), (sq, 1))))
    dims = ", ".join(map(str, shape))
    keep = draw(st.sampled_from((0.5, 0.9, 0.1)))
    setup = []
    if draw(st.booleans()) and shape[-2] > 1:
        row = draw(st.integers(0, shape[-2] - 1))
        masked = "False" if kind == "bool" else "float('-inf')"
        setup.append(f"{{name}}[..., {row}, :] = {masked}")
    if kind == "bool":
        return w.input(f"torch.rand({dims}) < {keep}", *setup, prefix="mask")
    form = draw(st.sampled_from(("randn", "where")))
    if form == "randn":
        expr = f"torch.randn({dims}, dtype=DTYPE)"
    else:
        expr = f"torch.zeros({dims}, dtype=DTYPE).masked_fill(torch.rand({dims}) >= {keep}, float('-inf'))"
    return w.input(expr, *setup, prefix="mask")


@st.composite
def attention_kernels(draw) -> str:
    w = KernelWriter(draw(st.sampled_from(DTYPES)))
    b, h = draw(st.sampled_from((1, 2, 3))), draw(st.sampled_from((1, 2, 4, 3)))
    h_kv = draw(st.sampled_from(sorted({h, 1} | ({h // 2} if h % 2 == 0 else set()))))
    sq, skv, d = draw(SEQ), draw(st.one_of(st.just(None), SEQ)), draw(HEAD_DIM)
    skv = sq if skv is None else skv
    while b * h * sq * skv * d > MAX_WORK and max(sq, skv) > 1:  # keep cases fast
        if sq >= skv:
            sq = (sq + 1) // 2
        else:
            skv = (skv + 1) // 2
    scale = draw(SCALES)
    q = qkv(draw, w, b, h, sq, d, query_scale(scale, d))
    k, v = qkv(draw, w, b, h_kv, skv, d), qkv(draw, w, b, h_kv, skv, d)
    mask = draw(st.sampled_from(("none", "causal", "bool", "float")))
    m = mask_input(draw, w, mask, b, h, sq, skv) if mask in ("bool", "float") else None
    if draw(st.booleans()):
        args = [q, k, v]
        if m is not None:
            args.append(f"attn_mask={m}")
        if mask == "causal":
            args.append("is_causal=True")
        if scale is not None:
            args.append(f"scale={scale}")
        if h_kv != h:
            args.append("enable_gqa=True")
        out = w.let(f"F.scaled_dot_product_attention({', '.join(args)})", prefix="o")
    else:
        out = by_hand(draw, w, q, k, v, m, mask, scale, h // h_kv, sq, skv, d)
    if draw(st.booleans()):  # merge the heads: [b, h, sq, d] -> [b, sq, h * d]
        out = w.let(f"{out}.transpose(1, 2).reshape({b}, {sq}, {h * d})", prefix="o")
    return w.render([out])


def by_hand(draw, w, q, k, v, m, mask, scale, groups, sq, skv, d) -> str:
    if groups > 1:
        k = w.let(f"{k}.repeat_interleave({groups}, dim=1)", prefix="k")
        v = w.let(f"{v}.repeat_interleave({groups}, dim=1)", prefix="v")
    product = draw(st.sampled_from(("{q} @ {k}.transpose(-2, -1)",
                                    "torch.matmul({q}, {k}.transpose(-1, -2))", "{q} @ {k}.mT")))
    if scale is None:
        expr = f"({product.format(q=q, k=k)}) / math.sqrt({d})"
    elif draw(st.booleans()):
        expr = f"({product.format(q=q, k=k)}) * {scale}"
    else:
        expr = product.format(q=f"({q} * {scale})", k=k)
    s = w.let(expr, prefix="s")
    if mask == "bool":
        s = w.let(draw(st.sampled_from((f"{s}.masked_fill(~{m}, float('-inf'))",
                                        f"{s}.masked_fill({m}.logical_not(), -torch.inf)",
                                        f"torch.where({m}, {s}, float('-inf'))"))), prefix="s")
    elif mask == "float":
        s = w.let(f"{s} + {m}", prefix="s")
    elif mask == "causal" and draw(st.booleans()):
        # MinGPT: a causal buffer of a longer sequence, sliced and compared
        n = max(sq, skv) + draw(st.sampled_from((0, 3)))
        bias = w.buffer(f"torch.tril(torch.ones({n}, {n})).view(1, 1, {n}, {n})", prefix="bias")
        s = w.let(f"{s}.masked_fill({bias}[:, :, :{sq}, :{skv}] == 0, float('-inf'))", prefix="s")
    elif mask == "causal":
        keep = f"torch.ones({sq}, {skv}, dtype=torch.bool).tril()"
        s = w.let(f"{s}.masked_fill(~{keep}, float('-inf'))", prefix="s")
    # a softmax, or an elementwise map without one (ReLU attention)
    softmax = draw(st.sampled_from(("torch.softmax({s}, dim=-1)", "{s}.softmax(-1)",
                                    "F.softmax({s}, dim=-1)",
                                    "torch.softmax({s}.float(), dim=-1).to({q}.dtype)",
                                    "F.relu({s})", "torch.relu({s}) * 0.5")))
    p = w.let(softmax.format(s=s, q=q), prefix="p")
    return w.let(f"{p} @ {v}", prefix="o")
