"""fuse_key_loops: each query block's max and E V become one loop over key tiles (the row
sum, returned on its own, stays outside the query blocks here) (FileCheck), with torch's
results for a key tile that leaves a remainder, and the rejection of a target that is not a
function."""

import torch

from schedules.attention import AttentionParams, AttentionPlan, find_attention
from schedules.attention.fuse import query_block_tiles, tile_query_blocks
from schedules.common import match
from transform_ext.fuse_key_loops import fuse_key_loops
from tests.transform_ext.attention_payloads import SHAPES, attention, torch_attention
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


def _query_blocks():
    """The attention payload tiled into query blocks of 2 rows by the attention schedule."""
    payload = parse(attention())
    params = AttentionParams(query_tile=2)
    sizes, query_tile, query_iv = query_block_tiles(find_attention(payload), params)
    plan = AttentionPlan(params, False, tuple(sizes), query_tile, query_iv, None, False)
    apply(payload, tile_query_blocks(plan))
    return payload


def test_one_loop_over_key_tiles_per_query_block():
    payload = _query_blocks()
    apply(payload, lambda root: fuse_key_loops(match(root, "func.func"), key_tile=4))
    check(payload, """
        CHECK: scf.forall
        CHECK: scf.for %{{.*}} = %c0 to %c8 step %c4 iter_args({{.*}}) -> (tensor<1x2xf32>, tensor<1x2x6xf32>)
        CHECK: linalg.generic {{.*}} ins(%{{.*}}, %{{.*}} : tensor<1x2x16xf32>, tensor<1x16x4xf32>) outs(%{{.*}} : tensor<1x2x4xf32>)
        CHECK: arith.maximumf
        CHECK: math.exp
        CHECK: scf.yield
        CHECK-NOT: scf.for {{.*}} iter_args
        CHECK: scf.forall.in_parallel
    """)


def test_fused_key_loops_compute_what_torch_does():
    b, l, s, d, e = (SHAPES[k] for k in "BLSDE")
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(b, l, d, generator=g), torch.randn(b, s, d, generator=g), \
        torch.randn(b, s, e, generator=g)
    payload = _query_blocks()
    apply(payload, lambda root: fuse_key_loops(match(root, "func.func"), key_tile=3))
    out, rows = run_module(payload, [q, k, v])
    want_out, want_rows = torch_attention(q, k, v)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-5)


def test_rejects_a_target_that_is_not_a_function():
    payload = _query_blocks()
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: fuse_key_loops(match(root, "scf.forall"), key_tile=4))
    assert "transform_ext.fuse_key_loops: scf.forall" in message
    assert "not a function" in message
    assert str(payload) == before
