"""accumulate_in_unpacked_output: IR (FileCheck), numerics against torch of the rewritten
payload (C = A B, and C^T through an unpack with outer_dims_perm), rejections. The matmul
schedule's use of it (several k blocks in C) is checked in tests/schedules/test_matmul.py."""

import torch

from schedules.common import match
from transform_ext.accumulate_in_unpacked_output import accumulate_in_unpacked_output
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# C[16, 64] = A[16, 24] B[24, 64] packed as the matmul schedule packs it (the packs left to
# the caller): A_p[m1, k, m0], B_p[n1, k, n0], C_p[m1, n1, m0, n0] from a fill, unpacked into
# C (or C^T, through outer_dims_perm).
PACKED = """
#a = affine_map<(m1, n1, k, m0, n0) -> (m1, k, m0)>
#b = affine_map<(m1, n1, k, m0, n0) -> (n1, k, n0)>
#c = affine_map<(m1, n1, k, m0, n0) -> (m1, n1, m0, n0)>
func.func @main(%ap: tensor<2x24x8xf32>, %bp: tensor<2x24x32xf32>) -> tensor<{c_shape}xf32> {{
  %zero = arith.constant {start} : f32
  %ec = tensor.empty() : tensor<2x2x8x32xf32>
  %cp0 = linalg.fill ins(%zero : f32) outs(%ec : tensor<2x2x8x32xf32>) -> tensor<2x2x8x32xf32>
  %cp = linalg.generic {{indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction", "parallel", "parallel"], lh.mark = 7 : i64}}
      ins(%ap, %bp : tensor<2x24x8xf32>, tensor<2x24x32xf32>) outs(%cp0 : tensor<2x2x8x32xf32>) {{
  ^bb0(%x: f32, %y: f32, %acc: f32):
    %p = arith.mulf %x, %y : f32
    %s = arith.addf %acc, %p : f32
    linalg.yield %s : f32
  }} -> tensor<2x2x8x32xf32>
  %e = tensor.empty() : tensor<{c_shape}xf32>
  %c = linalg.unpack %cp {outer} inner_dims_pos = [{inner}] inner_tiles = [8, 32] into %e : tensor<2x2x8x32xf32> -> tensor<{c_shape}xf32>
  return %c : tensor<{c_shape}xf32>
}}
"""


def packed(transposed: bool = False, start: str = "0.0") -> str:
    if transposed:  # C^T[64, 16]: packed outer dim 0 (m1) lands on dim 1
        return PACKED.format(c_shape="64x16", outer="outer_dims_perm = [1, 0]", inner="1, 0", start=start)
    return PACKED.format(c_shape="16x64", outer="", inner="0, 1", start=start)


def rewrite(payload):
    apply(payload, lambda root: accumulate_in_unpacked_output(match(root, "linalg.unpack")))


def test_the_generic_writes_c_at_the_unpacked_positions():
    payload = parse(packed())
    rewrite(payload)
    check(str(payload), """
        CHECK: #[[MAP:.*]] = affine_map<(d0, d1, d2, d3, d4) -> (d0 * 8 + d3, d1 * 32 + d4)>
        CHECK: %[[E:.*]] = tensor.empty() : tensor<16x64xf32>
        CHECK: %[[C0:.*]] = linalg.fill ins(%{{.*}} : f32) outs(%[[E]] : tensor<16x64xf32>)
        CHECK: %[[C:.*]] = linalg.generic {{.*}}#[[MAP]]{{.*}} outs(%[[C0]] : tensor<16x64xf32>)
        CHECK-SAME: lh.mark = 7
        CHECK: return %[[C]]
    """)
    assert "linalg.unpack" not in str(payload)
    assert str(payload).count("linalg.fill") == 1


def test_the_rewritten_product_equals_torchs():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 24, generator=g), torch.randn(24, 64, generator=g)
    for transposed in (False, True):
        payload = parse(packed(transposed, start="1.5"))
        rewrite(payload)
        a_p = a.reshape(2, 8, 24).permute(0, 2, 1).contiguous()
        b_p = b.reshape(24, 2, 32).permute(1, 0, 2).contiguous()
        (got,) = run_module(payload, [a_p, b_p], cleanup=False)
        want = a @ b + 1.5
        torch.testing.assert_close(got, want.t() if transposed else want, rtol=1e-5, atol=1e-5)


def test_rejects_padding_a_shared_result_and_an_init_that_is_no_fill():
    cases = [
        (packed().replace("tensor<16x64xf32>", "tensor<13x64xf32>").replace("16x64", "13x64"),
         "it drops padding along dim 0 (16 packed, 13 unpacked)"),
        (packed()
                 .replace("return %c : tensor<16x64xf32>", "return %c, %cp : tensor<16x64xf32>, tensor<2x2x8x32xf32>")
                 .replace("-> tensor<16x64xf32> {", "-> (tensor<16x64xf32>, tensor<2x2x8x32xf32>) {"),
         "the packed result is read by another op too"),
        (packed().replace("outs(%cp0 : tensor<2x2x8x32xf32>) {", "outs(%ec : tensor<2x2x8x32xf32>) {"),
         "the generic's init is not a linalg.fill read by it alone"),
    ]
    for text, reason in cases:
        payload = parse(text)
        before = str(payload)
        message = apply_expect_failure(
            payload, lambda root: accumulate_in_unpacked_output(match(root, "linalg.unpack")))
        assert "transform_ext.accumulate_in_unpacked_output: linalg.unpack" in message
        assert reason in message
        assert str(payload) == before
    payload = parse(packed())
    message = apply_expect_failure(payload, lambda root: accumulate_in_unpacked_output(match(root, "linalg.fill")))
    assert "not a linalg.unpack" in message
