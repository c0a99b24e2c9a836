"""The attention family on the joint forward+backward graph of SDPA (`--backward`): the
FlashAttention-2 backward fused into loops over query and key tiles
(transform_ext.fuse_attention_backward), its gradients against torch's, and the IR it leaves
(no L x S buffer after bufferization)."""

import re

import pytest
import torch

from lighthouse.compile import compile_kernel
from tests.transform_ext.helpers import check

KERNEL = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v{kwargs})
def get_inputs():
    torch.manual_seed(0)
    return {inputs}
def get_init_inputs():
    return []
"""


def _path(kernel_file, inputs, kwargs=""):
    return kernel_file(KERNEL.format(inputs=inputs, kwargs=kwargs))


def _check(compiled, family="attention"):
    assert compiled.family.name == family, compiled.notes
    reports = compiled.check()
    for r in reports:
        assert r.ok, str(r)
    assert len(reports) >= 4  # O, dQ, dK, dV (and an input without a gradient: zeros)
    return compiled


def _same(shape, dtype="float32", n=3):
    return f"[torch.randn({', '.join(map(str, shape))}, dtype=torch.{dtype}) for _ in range({n})]"


CASES = {
    # name: (inputs, SDPA keyword arguments)
    "square": (_same((1, 2, 128, 64)), ""),
    "batch_and_heads": (_same((2, 3, 64, 32)), ""),
    "causal": (_same((1, 2, 128, 64)), ", is_causal=True"),
    "explicit_scale": (_same((1, 2, 64, 16)), ", scale=0.3"),
    "causal_explicit_scale": (_same((1, 2, 64, 16)), ", is_causal=True, scale=1.7"),
    "tiles_that_do_not_divide": (_same((1, 2, 96, 16)), ""),
    "odd_length_causal": (_same((1, 2, 70, 8)), ", is_causal=True"),
    # prime lengths: padded to whole 64-row tiles (a padded key masked out)
    "prime_length_causal": (_same((1, 2, 131, 16)), ", is_causal=True"),
    "prime_queries_and_keys": ("[torch.randn(2, 2, 67, 16), torch.randn(2, 2, 131, 16), "
                               "torch.randn(2, 2, 131, 16)]", ""),
    "one_head": (_same((1, 1, 70, 8)), ", is_causal=True"),
    "3d_inputs": (_same((3, 48, 16)), ", is_causal=True"),
    "queries_shorter_than_keys": ("[torch.randn(1, 2, 48, 16), torch.randn(1, 2, 80, 16), "
                                  "torch.randn(1, 2, 80, 16)]", ""),
    "queries_longer_than_keys_causal": ("[torch.randn(1, 2, 80, 16), torch.randn(1, 2, 48, 16), "
                                        "torch.randn(1, 2, 48, 16)]", ", is_causal=True"),
    "huge_scores": ("[torch.randn(1, 2, 64, 16) * 30 for _ in range(3)]", ""),
    "bf16": (_same((1, 2, 64, 32), "bfloat16"), ""),
    "bf16_causal": (_same((1, 2, 64, 32), "bfloat16"), ", is_causal=True"),
    "f16": (_same((1, 2, 64, 32), "float16"), ""),
    # the widened Q read by the forward and the backward: fused into the query blocks twice
    # (two row maxima before transform_ext.deduplicate_generics merged the copies)
    "f16_gqa_causal_strided_v": ("[torch.randn(1, 3, 66, 32, dtype=torch.float16) * 0.13, "
                                 "torch.randn(1, 1, 66, 32, dtype=torch.float16), "
                                 "torch.randn(1, 1, 66, 64, dtype=torch.float16)[..., ::2]]",
                                 ", is_causal=True, scale=1.0, enable_gqa=True"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_torch(kernel_file, name):
    inputs, kwargs = CASES[name]
    _check(compile_kernel(_path(kernel_file, inputs, kwargs), backward=True, strict=True))


MASKED = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.register_buffer("bias", {buffer})
    def forward(self, q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask={mask})
def get_inputs():
    torch.manual_seed(0)
    return [torch.randn(2, 3, 40, 16), torch.randn(2, 3, 56, 16), torch.randn(2, 3, 56, 16), {m}]
def get_init_inputs():
    return []
"""

MASKS = {
    # name: (the mask input m, the module's float buffer, the attn_mask expression)
    "bool_broadcast_over_heads": ("torch.rand(2, 1, 40, 56) > 0.3", "torch.zeros(1)", "m"),
    "bool_per_query_and_key": ("torch.rand(40, 56) > 0.3", "torch.zeros(1)", "m"),
    "key_padding": ("torch.arange(56)[None, None, None, :] < torch.tensor([50, 21])[:, None, None, None]",
                    "torch.zeros(1)", "m"),
    "fully_masked_rows": ("(torch.arange(40)[:, None] < 33) & (torch.rand(40, 56) > 0.5)",
                          "torch.zeros(1)", "m"),
    "float_buffer": ("torch.zeros(1)", "torch.randn(40, 56) * 3", "self.bias"),
    "float_buffer_with_inf_rows": ("torch.zeros(1)", "torch.where(torch.arange(40)[:, None] % 5 == 0, "
                                   "float('-inf'), torch.randn(40, 56))", "self.bias"),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masks_that_need_no_gradient(kernel_file, name):
    """Bool masks (torch adds them as 0 / -inf) and float masks without a gradient are read
    per tile; fully masked rows give O = 0 and zero gradients, as torch."""
    m, buffer, mask = MASKS[name]
    compiled = _check(compile_kernel(kernel_file(MASKED.format(m=m, buffer=buffer, mask=mask)),
                                     backward=True, strict=True))
    outs = compiled.run()
    assert all(not torch.isnan(t).any() for t in outs)
    if name == "fully_masked_rows":
        for t in outs[:2]:  # O and dQ of the masked rows
            assert torch.equal(t[:, :, 33:], torch.zeros_like(t[:, :, 33:]))


def test_transposed_view_inputs(kernel_file):
    """q, k, v given as [B, S, H, D].transpose(1, 2) views, as a model's projections make them."""
    inputs = "[torch.randn(1, 96, 2, 32).transpose(1, 2) for _ in range(3)]"
    _check(compile_kernel(_path(kernel_file, inputs), backward=True, strict=True))


@pytest.mark.parametrize("loss,q_shape,kv_shape", [
    ("(o + o * o).sum()", (1, 2, 64, 16), (1, 2, 64, 16)),
    ("o", (1, 4, 64, 16), (1, 2, 64, 16)),
    ("o", (2, 6, 48, 16), (2, 2, 48, 16)),
    ("(o * o).sum()", (1, 8, 40, 32), (1, 1, 40, 32))])
def test_neighbours(kernel_file, loss, q_shape, kv_shape):
    """A scalar loss reading O twice (dO computed from O; the loss's sum is not a second
    softmax row sum) and grouped-query attention (K and V read per kv head in place, dK and
    dV summed over each group's query heads in the kernel), causal."""
    path = kernel_file(f"""
        import torch
        import torch.nn.functional as F
        class Model(torch.nn.Module):
            def forward(self, q, k, v):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return {loss}
        def get_inputs():
            torch.manual_seed(0)
            return [torch.randn{q_shape}, torch.randn{kv_shape}, torch.randn{kv_shape}]
        def get_init_inputs():
            return []
    """)
    compiled = compile_kernel(path, backward=True, strict=True)
    for r in compiled.check():
        assert r.ok, str(r)


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    path = tmp_path_factory.mktemp("bwd") / "kernel.py"
    path.write_text(KERNEL.format(inputs=_same((1, 2, 256, 32)), kwargs=", is_causal=True"))
    return {stage: str(compile_kernel(path, backward=True, strict=True, stop_after=stage).module)
            for stage in ("fuse", "bufferize")}


def test_no_l_by_s_buffer_after_bufferization(stages):
    bufferized = stages["bufferize"]
    allocs = re.findall(r"memref\.alloca?\(\)[^\n]*?: memref<([0-9x]+)x\w+>", bufferized)
    assert allocs, "the fused loops hold tile buffers"
    for shape in allocs:
        dims = [int(d) for d in shape.split("x")]
        assert dims.count(256) < 2, f"an L x S buffer: {shape}"


def test_the_backward_runs_in_its_own_loops_over_query_and_key_tiles(stages):
    from tests.transform_ext.helpers import check

    # the forward's query blocks (computing lse = m + log l beside O), then the backward's
    # forall over heads reading that lse: per query block one key loop accumulating dQ, dK,
    # dV, no second softmax
    check(stages["fuse"], """
        CHECK: scf.forall
        CHECK:   math.log
        CHECK: scf.forall
        CHECK:   scf.for
        CHECK:     tensor.extract_slice %{{.*}}[%{{.*}}, %{{.*}}] [1, 64] [1, 1] : tensor<2x256xf32> to tensor<64xf32>
        CHECK:     scf.for
        CHECK:       math.exp
        CHECK-NOT:   math.log
        CHECK: lh.fused_kernel
    """)


def test_a_bf16_backward_computes_lse_in_a_first_key_loop(kernel_file):
    """O reaches the backward widened to f32, not as the forward's output: the kernel's
    first key loop recomputes lse (online max and sum)."""
    from tests.transform_ext.helpers import check

    path = _path(kernel_file, _same((1, 2, 128, 32), "bfloat16"))
    fused = str(compile_kernel(path, backward=True, strict=True, stop_after="fuse").module)
    kernel = fused.split("scf.forall", 2)[2]
    check(kernel, """
        CHECK: scf.for
        CHECK:   scf.for
        CHECK:     arith.maximumf
        CHECK:   math.log
        CHECK:   scf.for
        CHECK:     math.exp
    """)


MASK_WITH_GRADIENT = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m{kwargs})
def get_inputs():
    torch.manual_seed(0)
    q = torch.randn({q}, dtype=torch.{dtype})
    k, v = (torch.randn({kv}, dtype=torch.{dtype}) for _ in range(2))
    m = torch.randn({mask}, dtype=torch.{dtype})
    {edit}
    return [q, k, v, m]
def get_init_inputs():
    return []
"""

MASK_CASES = {
    # name: (q shape, k/v shape, mask shape, dtype, SDPA keywords, an edit of the mask)
    "2d_mask": ("1, 2, 32, 16", "1, 2, 32, 16", "32, 32", "float32", "", ""),
    "per_head": ("2, 2, 48, 16", "2, 2, 48, 16", "1, 2, 48, 48", "float32", "", ""),
    "key_bias": ("2, 2, 40, 16", "2, 2, 56, 16", "2, 1, 1, 56", "float32", "", ""),
    "full": ("2, 2, 32, 8", "2, 2, 32, 8", "2, 2, 32, 32", "float32", ", scale=0.3", ""),
    "fully_masked_rows": ("1, 2, 32, 16", "1, 2, 32, 16", "1, 2, 32, 32", "float32", "",
                          "m[:, :, 3] = float('-inf')"),
    "gqa": ("1, 4, 32, 16", "1, 2, 32, 16", "1, 4, 32, 32", "float32", ", enable_gqa=True", ""),
    "3d_inputs": ("3, 32, 16", "3, 32, 16", "32, 32", "float32", "", ""),
    "bf16": ("1, 2, 32, 32", "1, 2, 32, 32", "1, 1, 32, 32", "bfloat16", "", ""),
    # near-uniform weights over two keys: dP and D nearly cancel in dS = P (dP - D), and
    # D = rowsum(dO * O) from the rounded O was off by 0.19 (the fuzzer's find)
    "bf16_near_uniform_weights": ("2, 1, 16, 64", "2, 1, 2, 64", "2, 1, 16, 2", "bfloat16",
                                  ", scale=2.0", "q = q * 0.09"),
    "f16_odd_lengths_fully_masked_row": ("1, 2, 37, 32", "1, 2, 33, 32", "1, 2, 37, 33",
                                         "float16", "", "m[:, :, 5] = float('-inf')"),
    "prime_lengths": ("1, 2, 67, 16", "1, 2, 131, 16", "1, 2, 67, 131", "float32", "", ""),
}


@pytest.mark.parametrize("name", sorted(MASK_CASES))
def test_a_float_mask_gets_its_gradient(kernel_file, name):
    """A float mask that needs a gradient: torch would take its math backend (P kept,
    L x S); the fused backward also writes the mask's gradient, dS summed where the mask is
    broadcast (lighthouse::attention_masked)."""
    q, kv, mask, dtype, kwargs, edit = MASK_CASES[name]
    path = kernel_file(MASK_WITH_GRADIENT.format(q=q, kv=kv, mask=mask, dtype=dtype, kwargs=kwargs,
                                     edit=edit))
    compiled = _check(compile_kernel(path, backward=True, strict=True))
    assert "d_input3" in compiled.result_names


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_low_precision_mask_gradient_sums_d_from_p_and_dp(kernel_file, dtype):
    """With O rounded to bf16, D = rowsum(P dP) (torch's math backend) is summed in the
    first key loop beside the max and the sum (dP = dO V^T per key tile) and divided by the
    sum after it; an f32 backward keeps D = rowsum(dO O) and its two-row first loop."""
    path = kernel_file(MASK_WITH_GRADIENT.format(q="1, 2, 64, 16", kv="1, 2, 128, 16",
                                                 mask="1, 2, 64, 128", dtype=dtype, kwargs="",
                                                 edit=""))
    fused = str(compile_kernel(path, backward=True, strict=True, stop_after="fuse").module)
    if dtype == "float32":
        assert not re.search(r"scf\.for .*-> \(tensor<64xf32>, tensor<64xf32>, tensor<64xf32>\)",
                             fused)
        return
    check(fused, """
        CHECK:      scf.for {{.*}} -> (tensor<64xf32>, tensor<64xf32>, tensor<64xf32>)
        CHECK:        arith.maximumf
        CHECK:        iterator_types = ["parallel", "parallel", "reduction"]
        CHECK:        math.exp
        CHECK-NEXT:   arith.mulf
        CHECK:        scf.yield
        CHECK:      math.log
        CHECK:      arith.divf
    """)


HAND_BACKWARD = """
import torch
{options}
class Model(torch.nn.Module):
    def forward(self, q, k, v, do):
        p = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1)
        dp = do @ v.transpose(-1, -2)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        return (ds @ k) * 0.25, (ds.transpose(-1, -2) @ q) * 0.25, p.transpose(-1, -2) @ do
def get_inputs():
    torch.manual_seed(0)
    return [torch.randn(1, 2, 72, 16) for _ in range(4)]
def get_init_inputs():
    return []
"""


def test_a_backward_written_by_hand_with_d_from_p_and_dp(kernel_file):
    """dQ, dK, dV written out with D = rowsum(P dP) and no O: the one-pass kernel sums D in
    its first key loop; the two-pass one (the GPU's, via backward_tiles) refuses, naming
    why, and the matmul schedule computes it."""
    path = kernel_file(HAND_BACKWARD.format(options=""))
    compiled = compile_kernel(path, strict=True)
    assert compiled.family.name == "attention", compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)
    fused = str(compile_kernel(path, strict=True, stop_after="fuse").module)
    assert re.search(r"scf\.for .*-> \((tensor<\d+xf32>), \1, \1\)", fused)
    two_pass = compile_kernel(kernel_file(HAND_BACKWARD.format(
        options="LIGHTHOUSE = dict(backward_tiles=(24, 24, 24, 24))")))
    assert any("D = rowsum(P dP) with no O to read" in n for n in two_pass.notes), two_pass.notes
    for r in two_pass.check():
        assert r.ok, str(r)


TRANSPOSED_QUERY_WITH_MASK_GRADIENT = """
import torch
import torch.nn.functional as F
class Model(torch.nn.Module):
    def forward(self, q, k, v, m):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=2.0)
        return o.transpose(1, 2).reshape(1, 2, 48)
def get_inputs():
    torch.manual_seed(0)
    q = (torch.randn(1, 2, 3, 16) * 0.2).transpose(1, 2)
    m = torch.zeros(1, 1, 1, 2).masked_fill(torch.tensor([True, False]), float('-inf'))
    return [q, torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16), m]
def get_init_inputs():
    return []
"""


def test_a_mask_gradient_with_a_transposed_query_and_a_reshape_after(kernel_file):
    """torch lays the attention's output out like the transposed query; the traced op's
    is contiguous, as its fake says, so the reshape after it imports (it failed: "view size
    is not compatible", the fuzzer's find)."""
    compiled = compile_kernel(kernel_file(TRANSPOSED_QUERY_WITH_MASK_GRADIENT), backward=True,
                              strict=True)
    reports = compiled.check()
    assert [r.name for r in reports][-1] == "d_input3"
    for r in reports:
        assert r.ok, str(r)


def test_a_mask_gradient_holds_no_l_by_s_buffer_but_its_own(kernel_file):
    """The mask [1, 1, L, S]'s gradient is by definition L x S: the only such buffers are its
    per-split shares; dS and P stay tiles."""
    path = kernel_file(MASK_WITH_GRADIENT.format(q="2, 2, 128, 16", kv="2, 2, 128, 16", mask="1, 1, 128, 128",
                                     dtype="float32", kwargs="", edit=""))
    bufferized = str(compile_kernel(path, backward=True, strict=True, threads=2,
                                    stop_after="bufferize").module)
    allocs = re.findall(r"memref\.alloca?\(\)[^\n]*?: memref<([0-9x]+)x\w+>", bufferized)
    big = sorted({a for a in allocs if a.split("x").count("128") >= 2})
    assert big == ["2x128x128"], big  # two splits' shares of the mask's gradient


def test_the_printed_script_has_the_backward_step(kernel_file):
    from lighthouse.compile import compile_kernel as compile_

    path = _path(kernel_file, _same((1, 2, 64, 16)), ", is_causal=True")
    compiled = compile_(path, backward=True, strict=True, stop_after="fuse")
    script = str(compiled.script.module)
    assert "transform.named_sequence @fuse_backward" in script
    assert re.search(r"transform_ext\.fuse_attention_backward.*causal_delta = 0", script)


def test_the_printed_script_replays_and_edits(kernel_file, tmp_path):
    """--print-schedule's script replays to the same IR; editing the backward's key tile in
    it changes the kernel's key loops (and the gradients stay right)."""
    path = _path(kernel_file, _same((1, 2, 128, 16)), ", is_causal=True")
    own = compile_kernel(path, backward=True, strict=True, stop_after="bufferize")
    script = str(own.script.module)
    script_file = tmp_path / "schedule.mlir"
    script_file.write_text(script)
    replayed = compile_kernel(path, backward=True, schedule_file=str(script_file),
                              stop_after="bufferize")
    assert str(replayed.module) == str(own.module)
    edited = script.replace("key_tile = 64 : i64, query_tile = 64", "key_tile = 32 : i64, query_tile = 64")
    assert edited != script
    script_file.write_text(edited)
    fused = compile_kernel(path, backward=True, schedule_file=str(script_file), stop_after="fuse")
    assert "step %c32" in str(fused.module)
    for r in compile_kernel(path, backward=True, schedule_file=str(script_file)).check():
        assert r.ok, str(r)


HAND = """
import math
import torch
class Model(torch.nn.Module):
    def forward(self, q, k, v{extra}):
        s = {scores}
        {mask}
        return torch.softmax(s, dim=-1) @ v
def get_inputs():
    torch.manual_seed(0)
    return [torch.randn(2, 2, 64, 16), torch.randn(2, 2, 48, 16), torch.randn(2, 2, 48, 16){inputs}]
def get_init_inputs():
    return []
"""

HAND_FORMS = {
    # name: (scores, mask, extra args, extra inputs, fused)
    "scores_div": ("q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])", "", "", "", True),
    "scores_mul": ("(q @ k.transpose(-1, -2)) * 0.125", "", "", "", True),
    "unscaled": ("q @ k.transpose(-1, -2)", "", "", "", True),
    "causal_triu_fill": ("q @ k.transpose(-1, -2) / 4.0",
                         "s = s.masked_fill(torch.ones(64, 48, dtype=torch.bool).triu(1), float('-inf'))",
                         "", "", True),
    "q_scaled": ("(q * 0.3) @ k.transpose(-1, -2)", "", "", "", False),
    "bool_mask_with_fully_masked_rows": (
        "q @ k.transpose(-1, -2) / 4.0", "s = s.masked_fill(m, float('-inf'))", ", m",
        ", (torch.rand(2, 1, 64, 48) > 0.7) | (torch.arange(64)[:, None] > 60)", False),
}


@pytest.mark.parametrize("name", sorted(HAND_FORMS))
def test_attention_written_by_hand(kernel_file, name):
    """The math backend's autograd graph (P kept from the forward, dS = dP P - P rowsum(dP P),
    the scale applied to dS) is fused like the flash form; Q or K scaled before the scores,
    and tensor masks (torch's NaN on fully masked rows has a pattern of its own), are not:
    they fall back and must match torch, NaN for NaN."""
    scores, mask, extra, inputs, fused = HAND_FORMS[name]
    path = kernel_file(HAND.format(scores=scores, mask=mask, extra=extra, inputs=inputs))
    compiled = compile_kernel(path, backward=True)
    assert (compiled.family.name == "attention") == fused, compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)


GIVEN_LSE = """
import torch
import torch.nn.functional as F
from lighthouse.extras import sdpa_log_sum_exp
from lighthouse.flash_decompositions import flash_backward_given_lse
class Model(torch.nn.Module):
    def forward(self, do, q, k, v, o, lse):
        return flash_backward_given_lse(do, q, k, v, o, lse, 0.0, {causal})
def get_inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 96, 32) for _ in range(3))
    k[..., 0, :] = 40.0  # one key dominating: P far from uniform
    o = F.scaled_dot_product_attention(q, k, v, is_causal={causal})
    return [torch.randn_like(o), q, k, v, o, sdpa_log_sum_exp(q, k, is_causal={causal})]
def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("causal", [False, True])
def test_the_backward_graph_alone_reads_the_given_lse(kernel_file, causal):
    """AOTAutograd's backward graph, as torch.compile's backend decomposes it in f32: the
    forward's lse is an input, which the kernel reads (no key loop recomputing it)."""
    from tests.transform_ext.helpers import check

    path = kernel_file(GIVEN_LSE.format(causal=causal))
    compiled = compile_kernel(path, strict=True)
    assert compiled.family.name == "attention"
    for r in compiled.check():
        assert r.ok, str(r)
    fused = str(compile_kernel(path, strict=True, stop_after="fuse").module)
    assert "arith.maximumf" not in fused
    check(fused, """
        CHECK: scf.forall
        CHECK:   scf.for
        CHECK:     tensor.extract_slice %{{.*}}[%{{.*}}, %{{.*}}] [1, 48] [1, 1] : tensor<4x96xf32> to tensor<48xf32>
        CHECK:     scf.for
        CHECK:       math.exp
        CHECK: lh.fused_kernel
    """)


@pytest.mark.parametrize("shape, causal, splits", [
    ((1, 1, 256, 32), True, "(2)"),   # one head: both threads share its query blocks
    ((1, 3, 96, 16), False, "(3, 2)"),   # three heads on two threads
])
def test_heads_that_do_not_divide_among_the_threads_share_their_query_blocks(
        kernel_file, shape, causal, splits):
    path = _path(kernel_file, _same(shape), ", is_causal=True" if causal else "")
    _check(compile_kernel(path, backward=True, strict=True, threads=2))
    fused = str(compile_kernel(path, backward=True, strict=True, threads=2, stop_after="fuse").module)
    kernel = fused[fused.index(f"in {splits}"):]
    from tests.transform_ext.helpers import check

    # each split accumulates dK, dV of its blocks apart; the shares are summed after it
    check(kernel, """
        CHECK: scf.for
        CHECK: lh.fused_kernel
        CHECK: iterator_types = ["reduction", "parallel", "parallel", "parallel"]
    """)


def test_query_splits():
    from transform_ext.fuse_attention_backward import query_splits

    assert query_splits(8, 16, 2) == 1
    assert query_splits(1, 16, 2) == 2
    assert query_splits(3, 16, 2) == 2
    assert query_splits(3, 16, 4) == 4
    assert query_splits(2, 16, 4) == 2
    assert query_splits(1, 1, 2) == 1


def test_a_prime_length_is_padded_to_whole_tiles(kernel_file):
    """L = S = 131 (prime): 64-row tiles over the rows padded to 192 (not 1-row tiles), the
    gradients sliced back."""
    from tests.transform_ext.helpers import check

    path = _path(kernel_file, _same((1, 2, 131, 16)), ", is_causal=True")
    fused = str(compile_kernel(path, backward=True, strict=True, stop_after="fuse").module)
    check(fused, """
        CHECK: tensor.insert_slice {{.*}} : tensor<2x131x16xf32> into tensor<2x192x16xf32>
        CHECK: scf.forall
        CHECK:   tensor.extract_slice {{.*}} [1, 64, 16] [1, 1, 1] : tensor<2x192x16xf32> to tensor<64x16xf32>
        CHECK: lh.fused_kernel
        CHECK: tensor.extract_slice {{.*}}[0, 0, 0] [2, 131, 16] [1, 1, 1] : tensor<2x192x16xf32> to tensor<2x131x16xf32>
    """)
