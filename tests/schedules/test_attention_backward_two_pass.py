"""The attention backward in two passes (transform_ext.fuse_attention_backward_two_pass, the
form the XeGPU target lowers: dQ over query blocks, dK and dV over key blocks), run on the
CPU target against torch: the numerics of the GPU's fused schedule, as the project checks
every XeGPU schedule (no Intel GPU here). The option `backward_tiles` of the kernel file's
LIGHTHOUSE dict selects it; the XeGPU target sets it itself."""

import re

import pytest
import torch

from lighthouse.compile import compile_kernel
from tests.transform_ext.helpers import check

KERNEL = """
import torch
import torch.nn.functional as F
LIGHTHOUSE = dict(backward_tiles={tiles})
class Model(torch.nn.Module):
    def forward(self, q, k, v{mask_arg}):
        o = F.scaled_dot_product_attention(q, k, v{kwargs})
        return {result}
def get_inputs():
    torch.manual_seed(0)
    return [torch.randn{q}.to(torch.{dtype}), torch.randn{kv}.to(torch.{dtype}),
            torch.randn{kv}.to(torch.{dtype}){mask}]
def get_init_inputs():
    return []
"""
TILES = (32, 16, 16, 32)


def _write(kernel_file, q, kv=None, dtype="float32", kwargs="", mask="", result="o",
           tiles=TILES):
    return kernel_file(KERNEL.format(q=q, kv=kv or q, dtype=dtype, kwargs=kwargs,
                                     mask_arg=", m" if mask else "",
                                     mask=f", {mask}" if mask else "", result=result,
                                     tiles=tiles))


def _check(compiled):
    assert compiled.family.name == "attention", compiled.notes
    assert "fuse_attention_backward_two_pass" in str(compiled.script.module)
    reports = compiled.check()
    assert len(reports) >= 4
    for r in reports:
        assert r.ok, str(r)
    return compiled


CASES = {
    # name: (q shape, k/v shape, dtype, SDPA keyword arguments)
    "f16": ((1, 2, 64, 32), None, "float16", ""),
    "f16_causal": ((1, 2, 64, 32), None, "float16", ", is_causal=True"),
    "bf16": ((2, 2, 64, 32), None, "bfloat16", ""),
    "bf16_causal": ((1, 2, 96, 32), None, "bfloat16", ", is_causal=True"),
    "queries_shorter_than_keys_causal": ((1, 2, 32, 16), (1, 2, 64, 16), "float32",
                                         ", is_causal=True"),
    "queries_longer_than_keys_causal": ((1, 2, 64, 16), (1, 2, 32, 16), "float32",
                                        ", is_causal=True"),
    "grouped_query_causal": ((1, 4, 64, 16), (1, 2, 64, 16), "float32",
                             ", is_causal=True, enable_gqa=True"),
    "explicit_scale": ((1, 2, 48, 16), None, "float32", ", scale=0.3"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradients_match_torch(kernel_file, name):
    q, kv, dtype, kwargs = CASES[name]
    _check(compile_kernel(_write(kernel_file, q, kv, dtype, kwargs), backward=True,
                          strict=True))


def test_a_bool_mask_with_fully_masked_rows(kernel_file):
    """Read per tile in both passes (transposed in the key-block pass); the fully masked
    rows get lse = -inf in lane form and zero gradients, as torch."""
    mask = "(torch.arange(64)[:, None] < 50) & (torch.rand(2, 1, 64, 64) > 0.5)"
    compiled = _check(compile_kernel(_write(kernel_file, (2, 2, 64, 16), dtype="float16",
                                            kwargs=", attn_mask=m", mask=mask),
                                     backward=True, strict=True))
    out, dq = compiled.run()[:2]
    for t in (out, dq):
        assert torch.equal(t[:, :, 50:], torch.zeros_like(t[:, :, 50:]))


def test_a_loss_reading_o_twice_and_huge_scores(kernel_file):
    """dO computed from O (not the seed's ones), scores of magnitude ~1000."""
    path = _write(kernel_file, (1, 2, 64, 16), result="(o + o * o).sum()")
    text = path.read_text().replace("torch.randn(1, 2, 64, 16).to", "(30 * torch.randn(1, 2, 64, 16)).to")
    path.write_text(text)
    _check(compile_kernel(path, backward=True, strict=True))


GIVEN_LSE = """
import torch
import torch.nn.functional as F
from lighthouse.extras import sdpa_log_sum_exp
from lighthouse.flash_decompositions import flash_backward_given_lse
LIGHTHOUSE = dict(backward_tiles=(32, 16, 16, 32))
class Model(torch.nn.Module):
    def forward(self, do, q, k, v, o, lse):
        return flash_backward_given_lse(do, q, k, v, o, lse, 0.0, True)
def get_inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return [torch.randn_like(o), q, k, v, o, sdpa_log_sum_exp(q, k, is_causal=True)]
def get_init_inputs():
    return []
"""


def test_the_backward_alone_reads_the_given_lse(kernel_file):
    """AOTAutograd's backward graph: the forward's lse is an input; pass 1 copies it into
    lane form for pass 2 and never recomputes it (no max over the scores)."""
    compiled = compile_kernel(kernel_file(GIVEN_LSE), strict=True)
    assert "fuse_attention_backward_two_pass" in str(compiled.script.module)
    for r in compiled.check():
        assert r.ok, str(r)
    fused = str(compile_kernel(kernel_file(GIVEN_LSE), strict=True, stop_after="fuse").module)
    assert "arith.maximumf %in" not in fused.split("lh.backward_pass = 1")[0].split("scf.forall")[-1]


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    path = tmp_path_factory.mktemp("two_pass") / "kernel.py"
    path.write_text(KERNEL.format(q=(1, 2, 128, 32), kv=(1, 2, 128, 32), dtype="float16",
                                  kwargs=", is_causal=True", mask_arg="", mask="", result="o",
                                  tiles=(64, 32, 32, 16)))
    return {stage: str(compile_kernel(path, backward=True, strict=True, stop_after=stage).module)
            for stage in ("fuse", "bufferize")}


def test_the_passes_are_two_foralls_bounded_by_the_diagonal(fused):
    """Pass 1 over (heads, query blocks of 64): lse loops and dQ loops over key tiles of 32,
    the tiles wholly left of the diagonal first (no mask), then those it crosses (masked by
    position) up to it; D and lse written in lane form; pass 2 over (heads, key blocks of
    32): loops over query tiles of 16 from the diagonal, the crossed tiles (masked) first,
    reading lse and D from pass 1 and accumulating dK and dV; f16 tiles widened as read,
    the gradients written in f16."""
    check(fused["fuse"], """
        CHECK: scf.forall (%{{.*}}, %{{.*}}) in (2, 2)
        CHECK:   %[[END:.*]] = affine.min
        CHECK:   %[[FREE:.*]] = affine.min
        CHECK:   scf.for %{{.*}} = %c0 to %[[FREE]] step %c32
        CHECK-NOT: linalg.index
        CHECK:     arith.maximumf
        CHECK:   scf.for %{{.*}} = %[[FREE]] to %[[END]] step %c32
        CHECK:     linalg.index
        CHECK:     arith.maximumf
        CHECK:   math.log
        CHECK:   scf.for %{{.*}} = %c0 to %[[FREE]] step %c32
        CHECK-NOT: linalg.index
        CHECK:     math.exp
        CHECK:   scf.for %{{.*}} = %[[FREE]] to %[[END]] step %c32
        CHECK:     linalg.index
        CHECK:     math.exp
        CHECK:   tensor.parallel_insert_slice %{{.*}} : tensor<64x32xf16> into tensor<2x128x32xf16>
        CHECK:   tensor.parallel_insert_slice %{{.*}} : tensor<64x16xf32> into tensor<2x128x16xf32>
        CHECK:   tensor.parallel_insert_slice %{{.*}} : tensor<64x16xf32> into tensor<2x128x16xf32>
        CHECK: lh.backward_pass = 1
        CHECK: scf.forall (%{{.*}}, %{{.*}}) in (2, 4)
        CHECK:   %[[START:.*]] = affine.max
        CHECK:   %[[BELOW:.*]] = affine.min
        CHECK:   scf.for %{{.*}} = %[[START]] to %[[BELOW]] step %c16
        CHECK:     tensor.extract_slice %{{.*}} [1, 16, 8] [1, 1, 1] : tensor<2x128x16xf32> to tensor<16x8xf32>
        CHECK:     linalg.index
        CHECK:     math.exp
        CHECK:   scf.for %{{.*}} = %[[BELOW]] to %c128 step %c16
        CHECK-NOT: linalg.index
        CHECK:     math.exp
        CHECK:   tensor.parallel_insert_slice %{{.*}} : tensor<32x32xf16> into tensor<2x128x32xf16>
        CHECK:   tensor.parallel_insert_slice %{{.*}} : tensor<32x32xf16> into tensor<2x128x32xf16>
        CHECK: lh.backward_pass = 2
    """)


def test_no_l_by_s_buffer_after_bufferization(fused):
    allocs = re.findall(r"memref\.alloca?\(\)[^\n]*?: memref<([0-9x]+)x\w+>", fused["bufferize"])
    assert allocs
    for shape in allocs:
        assert [int(d) for d in shape.split("x")].count(128) < 2, f"an L x S buffer: {shape}"


def test_refused_tiles_name_the_reason(kernel_file):
    from schedules.attention.fuse import AttentionParams

    with pytest.raises(ValueError, match="backward_tiles must be four sizes >= 1"):
        AttentionParams(backward_tiles=(32, 16, 0, 32))


def test_the_printed_script_replays(kernel_file, tmp_path):
    path = _write(kernel_file, (1, 2, 64, 16), kwargs=", is_causal=True")
    own = compile_kernel(path, backward=True, strict=True, stop_after="bufferize")
    script_file = tmp_path / "schedule.mlir"
    script_file.write_text(str(own.script.module))
    assert re.search(r"transform_ext\.fuse_attention_backward_two_pass.*causal_delta = 0.*"
                     r"dkv_tiles = \[16, 32\], dq_tiles = \[32, 16\]", str(own.script.module))
    replayed = compile_kernel(path, backward=True, schedule_file=str(script_file),
                              stop_after="bufferize")
    assert str(replayed.module) == str(own.module)


def test_transposed_view_inputs_and_heads_of_odd_length(kernel_file):
    """q, k, v given as [B, S, H, D].transpose(1, 2) views (read through their transposes),
    S = 72: the tiles clamp to its divisors (24 rows, 12 keys)."""
    path = kernel_file(KERNEL.format(q=(1, 2, 72, 16), kv=(1, 2, 72, 16), dtype="bfloat16",
                                     kwargs=", is_causal=True", mask_arg="", mask="",
                                     result="o", tiles=TILES).replace(
        "torch.randn(1, 2, 72, 16)", "torch.randn(1, 72, 2, 16).transpose(1, 2)"))
    _check(compile_kernel(path, backward=True, strict=True))
