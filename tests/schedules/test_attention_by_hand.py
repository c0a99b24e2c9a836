"""Attention written by hand, as KernelBench's level 3 writes it: MinGPT's causal buffer
mask with the projections around the attention (43, 44), and ReLU attention (50: f(Q K^T) V
without a softmax). Numerics against torch, the fused loops and no L x S buffer."""

import re

import pytest
import torch

from lighthouse.compile import compile_kernel

MINGPT = """
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
B, T, C, H, MAX = 2, {T}, 32, 4, {MAX}
DTYPE = torch.{dtype}
LIGHTHOUSE = dict(query_tile=16, key_tile=16)
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        self.register_buffer("bias", ({mask}).view(1, 1, MAX, MAX))
        self.to(DTYPE)
    def forward(self, x):
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
        att = {activation}
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return {result}
def get_inputs():
    return [torch.rand(B, T, C, dtype=DTYPE)]
def get_init_inputs():
    return []
"""

TRIL = "torch.tril(torch.ones(MAX, MAX))"
SOFTMAX = "F.softmax(att, dim=-1)"
RELU = "F.relu(att)"


def _kernel(kernel_file, T=37, MAX=128, mask=TRIL, activation=SOFTMAX, result="self.c_proj(y)",
            dtype="float32"):
    return kernel_file(MINGPT.format(T=T, MAX=MAX, mask=mask, activation=activation,
                                     result=result, dtype=dtype))


def _check(compiled):
    assert compiled.family.name == "attention", compiled.notes
    for report in compiled.check():
        assert report.ok, str(report)
    return compiled


# T = 37: neither the 16-row query blocks nor the 16-key tiles divide it. Each case: its
# kernel's settings, and whether the causal key loop is bounded at the diagonal
CASES = {
    "mingpt_causal": ({}, True),
    "mingpt_causal_bf16": ({"dtype": "bfloat16"}, True),
    "mingpt_buffer_not_causal": ({"mask": "(torch.arange(MAX)[:, None] + torch.arange(MAX)) % 3 > 0"},
                                 False),
    "mingpt_output_read_twice": ({"result": "self.c_proj(y) + y"}, True),
    "relu_causal": ({"activation": RELU, "result": "y", "T": 70}, True),
    "relu_causal_odd": ({"activation": RELU, "result": "self.c_proj(y) * y"}, True),
    # one key tile and a partial one: no loop to bound
    "relu_causal_short": ({"activation": RELU, "result": "y", "T": 23}, False),
    "relu_not_causal": ({"activation": RELU, "result": "y", "mask": "torch.ones(MAX, MAX)"}, False),
    "relu_bf16": ({"activation": RELU, "result": "y", "T": 40, "dtype": "bfloat16"}, True),
    # f(-inf) = 0.5: the masked keys count, no key tile may be skipped
    "relu_shifted_causal": ({"activation": "F.relu(att) + 0.5", "result": "y", "T": 48}, False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_torch(kernel_file, name):
    settings, bounded = CASES[name]
    compiled = _check(compile_kernel(_kernel(kernel_file, **settings)))
    script = compiled.schedule_text()
    assert ("bound_causal_key_loops" in script) == bounded
    assert ("match_key_loop_ops" in script) == name.startswith("relu")


@pytest.mark.parametrize("settings", [{}, {"activation": RELU, "result": "self.c_proj(y) * y"},
                                      {"dtype": "bfloat16"}])
def test_output_projection_over_the_heads_steps_by_outer_products(kernel_file, settings):
    """c_proj reads y = att @ v re-assembled from its heads: reshape propagation gives it two
    reduction loops (head, head dim), which tile_other_ops collapses into one. Left as two,
    its register tile's contract had no outer-product form and was lowered to one scalar
    FMA per lane (KernelBench level 3's 43 ran 0.98x torch eager instead of 2.8x)."""
    path = _kernel(kernel_file, **settings)
    for stage, op in (("fuse", "linalg.generic"), ("vectorize", "vector.contract")):
        ir_text = str(compile_kernel(path, stop_after=stage).module)
        kinds = re.findall(op + r" \{[^}]*iterator_types = \[([^\]]*)\]", ir_text)
        assert (kinds or stage == "vectorize") and all(k.count("reduction") <= 1 for k in kinds), \
            (stage, kinds)
    _check(compile_kernel(path))


@pytest.mark.parametrize("activation", [SOFTMAX, RELU])
def test_no_t_by_t_buffer_after_bufferization(kernel_file, activation):
    from tests.transform_ext.helpers import check

    path = _kernel(kernel_file, T=48, activation=activation)
    fused = str(compile_kernel(path, stop_after="fuse").module)
    # one loop over key tiles of 16 per query block; the scores exist one tile at a time
    check(fused, """
        CHECK: scf.forall
        CHECK:   scf.for
        CHECK:     tensor<1x1x16x16xf32>
        CHECK:   scf.yield
        CHECK:   scf.forall.in_parallel
    """)
    bufferized = str(compile_kernel(path, stop_after="bufferize").module)
    allocs = re.findall(r"memref\.alloca?\([^)]*\)[^:]*: memref<([0-9x]+)x\w+", bufferized)
    for shape in allocs:
        dims = [int(d) for d in shape.split("x")]
        assert dims.count(48) < 2, f"a T x T buffer: {shape}"


def test_causal_buffer_becomes_an_index_mask():
    from lighthouse.causal_masks import index_causal_masks

    class Masked(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.register_buffer("bias", mask)

        def forward(self, s):
            return s.masked_fill(self.bias[:, :, :5, :7] == 0, float("-inf"))

    s = torch.randn(2, 3, 5, 7)
    n = torch.arange(9)
    for mask, rewritten in ((torch.tril(torch.ones(9, 9)), 1),
                            (torch.tril(torch.ones(9, 9), diagonal=2), 1),
                            (torch.triu(torch.ones(9, 9)), 1),
                            ((n[:, None] - n[None, :]).abs() <= 1, 0),   # a band: two edges
                            (torch.ones(9, 9), 0)):
        model = Masked(mask.float().view(1, 1, 9, 9))
        program = torch.export.export(model, (s,), strict=False)
        assert index_causal_masks(program) == rewritten
        targets = {str(node.target) for node in program.graph.nodes}
        assert ("aten.arange.start_step" in targets) == bool(rewritten)
        assert torch.equal(program.module()(s), model(s))


def test_without_a_softmax_a_gpu_target_gets_the_reason(kernel_file):
    """ReLU attention is fused for the CPU only: on the XeGPU target the attention family
    refuses it naming why (a note, an error under strict)."""
    from lighthouse.compile import make_target
    from lighthouse.errors import ScheduleMismatch
    from lighthouse.families import choose_family
    from lighthouse.ingress import import_forward
    from lighthouse.kernel import load_kernel

    k = load_kernel(_kernel(kernel_file, activation=RELU, result="y", dtype="float16"), {})
    module = import_forward(k.model, k.inputs).module
    assert choose_family(module).name == "attention"
    notes = []
    choose_family(module, target=make_target("xegpu"), notes=notes)
    reason = "an attention without a softmax (f(Q K^T) V) has no GPU lowering yet"
    assert notes == [f"the attention schedule does not apply ({reason}); using the matmul schedule"]
    with pytest.raises(ScheduleMismatch, match=re.escape(reason)):
        choose_family(module, target=make_target("xegpu"), strict=True)


SCORES_AS_WIDE_AS_HEADS = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, q, k, v):
        k, v = k.repeat_interleave({groups}, dim=1), v.repeat_interleave({groups}, dim=1)
        return {activation}((q @ k.mT) * 0.125{softmax_dim}) @ v
def get_inputs():
    torch.manual_seed(0)
    return [torch.randn(1, 4, 64, 64), torch.randn(1, 4 // {groups}, 64, 64),
            torch.randn(1, 4 // {groups}, 64, 64)]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("activation", ["F.relu", "torch.softmax"])
def test_scores_as_wide_as_the_heads(kernel_file, activation, groups):
    """S = E: CSE merges the zero inits of the scores and of the output; each keeps its own
    when tiled (the output read its uninitialized tile: 1e20 off, the fuzzer's find)."""
    path = kernel_file(SCORES_AS_WIDE_AS_HEADS.format(
        activation=activation, groups=groups,
        softmax_dim=", -1" if activation == "torch.softmax" else ""))
    compiled = compile_kernel(path)
    assert compiled.family.name == "attention", compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)
