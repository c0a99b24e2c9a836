"""fuse_dependent_reduction_ops: the online fusion of dependent reductions.

IR tests (FileCheck) on hand-written payloads and numeric tests against torch: softmax and
attention rows containing -inf, fully masked rows, logits around +-1000, bf16 data, tiles that
do not divide the axis, siblings (AND-reduction, target gather), and each rejection.
"""

import pytest
import torch
from torch_mlir import ir
from torch_mlir.dialects import transform

from transform_ext.fuse_dependent_reduction_ops import fuse_dependent_reduction_ops
from tests.transform_ext.helpers import (clear_tags, match_id, tag_ops,
                                         apply, apply_expect_failure, check, parse)
from tests.transform_ext.numeric import run_module


def _generics(payload):
    func = next(op for op in payload.body.operations if op.operation.name == "func.func")
    return [op.operation for op in func.regions[0].blocks[0].operations
            if op.operation.name == "linalg.generic"]


def fuse(payload, reduction, consumers, tile, producers=(), allow_remainder=True,
         yield_producers=False):
    """Tag the given generics (by position) and apply the op; returns nothing."""
    ops = _generics(payload)
    order = [reduction] + list(consumers) + list(producers)
    with payload.context:
        tag_ops([ops[i] for i in order])

    def body(root):
        cons = [match_id(root, 1 + i) for i in range(len(consumers))]
        handle = cons[0] if len(cons) == 1 else transform.merge_handles(cons)
        prods = [match_id(root, 1 + len(consumers) + i) for i in range(len(producers))]
        fuse_dependent_reduction_ops(match_id(root, 0), handle, tile, producers=prods,
                                     allow_remainder=allow_remainder,
                                     yield_producers=yield_producers)

    apply(payload, body)
    clear_tags(payload)


def fuse_failure(payload, reduction, consumers, tile, **kw):
    ops = _generics(payload)
    with payload.context:
        tag_ops([ops[i] for i in [reduction] + list(consumers)])
    before = str(payload)

    def body(root):
        cons = [match_id(root, 1 + i) for i in range(len(consumers))]
        handle = cons[0] if len(cons) == 1 else transform.merge_handles(cons)
        fuse_dependent_reduction_ops(match_id(root, 0), handle, tile, **kw)

    message = apply_expect_failure(payload, body)
    assert str(payload) == before, "a rejected fusion must leave the payload unchanged"
    return message


# --------------------------------------------------------------------------- softmax

SOFTMAX = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<{N}x{C}x{T}>) -> tensor<{N}x{C}xf32> {{
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %e2 = tensor.empty() : tensor<{N}x{C}xf32>
  %xf = linalg.generic {{indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%x : tensor<{N}x{C}x{T}>) outs(%e2 : tensor<{N}x{C}xf32>) {{
  ^bb0(%a: {T}, %o: f32):
    %w = {WIDEN}
    linalg.yield %w : f32
  }} -> tensor<{N}x{C}xf32>
  %e1 = tensor.empty() : tensor<{N}xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<{N}xf32>) -> tensor<{N}xf32>
  %m = linalg.generic {{indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}}
      ins(%xf : tensor<{N}x{C}xf32>) outs(%m0 : tensor<{N}xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  }} -> tensor<{N}xf32>
  %e = linalg.generic {{indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%xf, %m : tensor<{N}x{C}xf32>, tensor<{N}xf32>) outs(%e2 : tensor<{N}x{C}xf32>) {{
  ^bb0(%a: f32, %b: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %r = math.exp %d : f32
    linalg.yield %r : f32
  }} -> tensor<{N}x{C}xf32>
  %l0 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<{N}xf32>) -> tensor<{N}xf32>
  %l = linalg.generic {{indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}}
      ins(%e : tensor<{N}x{C}xf32>) outs(%l0 : tensor<{N}xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  }} -> tensor<{N}xf32>
  %y = linalg.generic {{indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%e, %l : tensor<{N}x{C}xf32>, tensor<{N}xf32>) outs(%e2 : tensor<{N}x{C}xf32>) {{
  ^bb0(%a: f32, %b: f32, %o: f32):
    %r = arith.divf %a, %b : f32
    linalg.yield %r : f32
  }} -> tensor<{N}x{C}xf32>
  return %y : tensor<{N}x{C}xf32>
}}
"""


def softmax_payload(n, c, dtype="f32"):
    widen = "arith.addf %a, %zero : f32" if dtype == "f32" else f"arith.extf %a : {dtype} to f32"
    return parse(SOFTMAX.format(N=n, C=c, T=dtype, WIDEN=widen))


def test_softmax_ir_one_loop_with_stable_correction():
    payload = softmax_payload(8, 96)
    fuse(payload, reduction=1, consumers=[3], tile=32, producers=[0])
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK:      %[[LOOP:.*]]:2 = scf.for %[[J:.*]] = %{{.*}} to %{{.*}} step %{{.*}} iter_args(%[[M:.*]] = %{{.*}}, %[[L:.*]] = %{{.*}}) -> (tensor<8xf32>, tensor<8xf32>)
        CHECK:        tensor.extract_slice %{{.*}}[0, %[[J]]] [8, 32] [1, 1] : tensor<8x96xf32> to tensor<8x32xf32>
        CHECK:        %[[TILE:.*]] = linalg.generic {{.*}} iterator_types = ["parallel", "reduction"]
        CHECK:          arith.maximumf
        CHECK:        linalg.generic
        CHECK-SAME:     ins(%[[M]], %[[TILE]] : tensor<8xf32>, tensor<8xf32>)
        CHECK:          %[[NEW:.*]] = arith.maximumf %[[OLD:.*]], %{{.*}} : f32
        CHECK:          %[[IS:.*]] = arith.cmpf oeq, %[[OLD]], %{{.*}} : f32
        CHECK:          %[[D:.*]] = arith.subf %[[OLD]], %[[NEW]] : f32
        CHECK:          %[[X:.*]] = math.exp %[[D]] : f32
        CHECK:          arith.select %[[IS]], %{{.*}}, %[[X]] : f32
        CHECK:        linalg.generic {{.*}} ins(%[[TILE]] : tensor<8xf32>) outs(%[[M]] : tensor<8xf32>)
        CHECK:          arith.maximumf
        CHECK:        math.exp
        CHECK:        arith.mulf
        CHECK:        arith.addf
        CHECK:        scf.yield
        CHECK-NOT:  scf.for
        CHECK:      arith.divf
    """)
    text = str(payload)
    assert text.count("scf.for") == 1
    assert "arith.divf %cst" not in text  # no exp(-m_new) / exp(-m_old) form


@pytest.mark.parametrize("n,c,tile", [(6, 100, 32), (4, 64, 64), (3, 50, 7)])
def test_softmax_numerics_with_inf_and_huge_logits(n, c, tile):
    torch.manual_seed(0)
    x = torch.randn(n, c) * 5
    x[0, : c // 2] = float("-inf")           # a -inf prefix longer than a tile
    x[1, :] = x[1, :] * 200                  # logits around +-1000
    x[2, 3] = 1000.0
    payload = softmax_payload(n, c)
    fuse(payload, reduction=1, consumers=[3], tile=tile, producers=[0])
    out = run_module(payload, [x])[0]
    torch.testing.assert_close(out, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
    assert not torch.isnan(out).any()


def test_softmax_fully_masked_row_matches_torch_nan():
    x = torch.randn(4, 40)
    x[2, :] = float("-inf")
    payload = softmax_payload(4, 40)
    fuse(payload, reduction=1, consumers=[3], tile=16, producers=[0])
    out = run_module(payload, [x])[0]
    ref = torch.softmax(x, -1)
    assert torch.isnan(ref[2]).all() and torch.isnan(out[2]).all()  # torch: 0/0 there too
    torch.testing.assert_close(out[[0, 1, 3]], ref[[0, 1, 3]], rtol=1e-5, atol=1e-6)


def test_softmax_bf16_data_f32_accumulation():
    torch.manual_seed(1)
    x = (torch.randn(5, 80) * 3).to(torch.bfloat16)
    payload = softmax_payload(5, 80, "bf16")
    fuse(payload, reduction=1, consumers=[3], tile=32, producers=[0])
    check(payload, """
        CHECK: scf.for
        CHECK: tensor.extract_slice %arg0{{.*}} : tensor<5x80xbf16> to tensor<5x32xbf16>
        CHECK: arith.extf %{{.*}} : bf16 to f32
        CHECK: iter_args
    """.replace("CHECK: iter_args\n", ""))
    out = run_module(payload, [x])[0]
    torch.testing.assert_close(out, torch.softmax(x.float(), -1), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- attention

ATTENTION = """
#qk_q = affine_map<(b, i, j, d) -> (b, i, d)>
#qk_k = affine_map<(b, i, j, d) -> (b, j, d)>
#qk_s = affine_map<(b, i, j, d) -> (b, i, j)>
#id3 = affine_map<(b, i, j) -> (b, i, j)>
#row3 = affine_map<(b, i, j) -> (b, i)>
#pv_p = affine_map<(b, i, d, j) -> (b, i, j)>
#pv_v = affine_map<(b, i, d, j) -> (b, j, d)>
#pv_o = affine_map<(b, i, d, j) -> (b, i, d)>
#id3o = affine_map<(b, i, d) -> (b, i, d)>
#row3o = affine_map<(b, i, d) -> (b, i)>
func.func @main(%q: tensor<2x16x8xf32>, %k: tensor<2x40x8xf32>, %v: tensor<2x40x8xf32>,
                %mask: tensor<2x16x40xf32>) -> tensor<2x16x8xf32> {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %true = arith.constant true
  %es = tensor.empty() : tensor<2x16x40xf32>
  %s0 = linalg.fill ins(%zero : f32) outs(%es : tensor<2x16x40xf32>) -> tensor<2x16x40xf32>
  %s = linalg.generic {indexing_maps = [#qk_q, #qk_k, #qk_s], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%q, %k : tensor<2x16x8xf32>, tensor<2x40x8xf32>) outs(%s0 : tensor<2x16x40xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %p = arith.mulf %a, %b : f32
    %r = arith.addf %c, %p : f32
    linalg.yield %r : f32
  } -> tensor<2x16x40xf32>
  %sm = linalg.generic {indexing_maps = [#id3, #id3, #id3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%s, %mask : tensor<2x16x40xf32>, tensor<2x16x40xf32>) outs(%es : tensor<2x16x40xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %r = arith.addf %a, %b : f32
    linalg.yield %r : f32
  } -> tensor<2x16x40xf32>
  %em = tensor.empty() : tensor<2x16xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%em : tensor<2x16xf32>) -> tensor<2x16xf32>
  %m = linalg.generic {indexing_maps = [#id3, #row3], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%sm : tensor<2x16x40xf32>) outs(%m0 : tensor<2x16xf32>) {
  ^bb0(%a: f32, %c: f32):
    %r = arith.maximumf %a, %c : f32
    linalg.yield %r : f32
  } -> tensor<2x16xf32>
  %e = linalg.generic {indexing_maps = [#id3, #row3, #id3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%sm, %m : tensor<2x16x40xf32>, tensor<2x16xf32>) outs(%es : tensor<2x16x40xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %d = arith.subf %a, %b : f32
    %r = math.exp %d : f32
    linalg.yield %r : f32
  } -> tensor<2x16x40xf32>
  %l0 = linalg.fill ins(%zero : f32) outs(%em : tensor<2x16xf32>) -> tensor<2x16xf32>
  %l = linalg.generic {indexing_maps = [#id3, #row3], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%e : tensor<2x16x40xf32>) outs(%l0 : tensor<2x16xf32>) {
  ^bb0(%a: f32, %c: f32):
    %r = arith.addf %a, %c : f32
    linalg.yield %r : f32
  } -> tensor<2x16xf32>
  %eb = tensor.empty() : tensor<2x16x40xi1>
  %isinf = linalg.generic {indexing_maps = [#id3, #id3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%sm : tensor<2x16x40xf32>) outs(%eb : tensor<2x16x40xi1>) {
  ^bb0(%a: f32, %c: i1):
    %r = arith.cmpf oeq, %a, %ninf : f32
    linalg.yield %r : i1
  } -> tensor<2x16x40xi1>
  %ebr = tensor.empty() : tensor<2x16xi1>
  %all0 = linalg.fill ins(%true : i1) outs(%ebr : tensor<2x16xi1>) -> tensor<2x16xi1>
  %rows = linalg.generic {indexing_maps = [#id3, #row3], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%isinf : tensor<2x16x40xi1>) outs(%all0 : tensor<2x16xi1>) {
  ^bb0(%a: i1, %c: i1):
    %r = arith.andi %a, %c : i1
    linalg.yield %r : i1
  } -> tensor<2x16xi1>
  %eo = tensor.empty() : tensor<2x16x8xf32>
  %o0 = linalg.fill ins(%zero : f32) outs(%eo : tensor<2x16x8xf32>) -> tensor<2x16x8xf32>
  %o = linalg.generic {indexing_maps = [#pv_p, #pv_v, #pv_o], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}
      ins(%e, %v : tensor<2x16x40xf32>, tensor<2x40x8xf32>) outs(%o0 : tensor<2x16x8xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32):
    %p = arith.mulf %a, %b : f32
    %r = arith.addf %c, %p : f32
    linalg.yield %r : f32
  } -> tensor<2x16x8xf32>
  %out = linalg.generic {indexing_maps = [#id3o, #row3o, #row3o, #id3o], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%o, %l, %rows : tensor<2x16x8xf32>, tensor<2x16xf32>, tensor<2x16xi1>) outs(%eo : tensor<2x16x8xf32>) {
  ^bb0(%a: f32, %b: f32, %r: i1, %c: f32):
    %d = arith.divf %a, %b : f32
    %z = arith.select %r, %zero, %d : f32
    linalg.yield %z : f32
  } -> tensor<2x16x8xf32>
  return %out : tensor<2x16x8xf32>
}
"""
# generics in order: 0 s, 1 sm, 2 m, 3 e, 4 l, 5 isinf, 6 rows, 7 o, 8 out


def _attention_inputs():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 16, 8), torch.randn(2, 40, 8), torch.randn(2, 40, 8)
    mask = torch.zeros(2, 16, 40)
    mask[0, 3, :] = float("-inf")       # fully masked row: torch's SDPA returns 0 there
    mask[1, 5, :25] = float("-inf")     # masked prefix longer than a tile
    mask[1, 7, 10:] = float("-inf")
    return q, k, v, mask


def _attention_reference(q, k, v, mask):
    s = q @ k.transpose(1, 2) + mask
    p = torch.softmax(s, -1)
    p = torch.where(torch.isinf(s).all(-1, keepdim=True), 0.0, p)
    return p @ v


@pytest.mark.parametrize("tile", [16, 7, 12])
def test_attention_chain_and_sibling_and_reduction_in_one_loop(tile):
    payload = parse(ATTENTION)
    fuse(payload, reduction=2, consumers=[4, 6, 7], tile=tile, producers=[0])
    text = str(payload)
    assert text.count("scf.for") == 1
    for line in text.splitlines():
        if "-> tensor<2x16x40x" in line or ("tensor.empty" in line and "2x16x40" in line):
            raise AssertionError(f"a full score tensor is still built: {line.strip()}")
    check(payload, """
        CHECK: scf.for {{.*}} iter_args({{.*}}) -> (tensor<2x16xf32>, tensor<2x16xf32>, tensor<2x16xi8>, tensor<2x16x8xf32>)
        CHECK:   arith.mulf
        CHECK:   arith.addf
        CHECK:   arith.maximumf
        CHECK:   math.exp
        CHECK:   arith.andi
        CHECK:   arith.mulf
        CHECK:   arith.addf
        CHECK: scf.yield
    """.replace("tensor<2x16xi8>", "tensor<2x16xi1>"))
    out = run_module(payload, list(_attention_inputs()))[0]
    ref = _attention_reference(*_attention_inputs())
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, 3], torch.zeros(8))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# the attention payload returning the scores too: S has a reader after the group
ATTENTION_AND_SCORES = ATTENTION.replace(
    "-> tensor<2x16x8xf32> {", "-> (tensor<2x16x8xf32>, tensor<2x16x40xf32>) {").replace(
    "return %out : tensor<2x16x8xf32>",
    "return %out, %s : tensor<2x16x8xf32>, tensor<2x16x40xf32>")


@pytest.mark.parametrize("tile", [16, 7])
def test_a_producer_read_after_the_group_is_yielded_tile_by_tile(tile):
    """yield_producers: the scores S, also returned, are computed once per tile in the loop
    and each tile is written into S's full value the loop carries (the remainder tile after
    the loop too); S's own fill goes: every tile overwrites its part. Without it S stays
    whole before the loop for its other reader."""
    payload = parse(ATTENTION_AND_SCORES)
    fuse(payload, reduction=2, consumers=[4, 6, 7], tile=tile, producers=[0], yield_producers=True)
    text = str(payload)
    assert text.count("scf.for") == 1
    assert text.count("linalg.fill ins(%cst_0 : f32) outs(%0 : tensor<2x16x40xf32>)") == 0
    check(payload, """
        CHECK: %[[EMPTY:.*]] = tensor.empty() : tensor<2x16x40xf32>
        CHECK-NOT: -> tensor<2x16x40xf32>
        CHECK: scf.for {{.*}} iter_args({{.*}}, %{{.*}} = %[[EMPTY]]) -> ({{.*}}, tensor<2x16x40xf32>)
        CHECK:   linalg.generic {{.*}} outs(%{{.*}} : tensor<2x16x{{7|16}}xf32>)
        CHECK:   tensor.insert_slice {{.*}} into %{{.*}}[0, 0, %{{.*}}] [2, 16, {{7|16}}]
        CHECK: scf.yield
    """)
    q, k, v, mask = _attention_inputs()
    out, scores = run_module(payload, [q, k, v, mask])
    torch.testing.assert_close(scores, q @ k.transpose(1, 2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _attention_reference(q, k, v, mask), rtol=1e-5, atol=1e-5)

    kept = parse(ATTENTION_AND_SCORES)
    fuse(kept, reduction=2, consumers=[4, 6, 7], tile=tile, producers=[0])
    check(kept, """
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<2x16x40xf32>)
        CHECK: scf.for {{.*}} -> (tensor<2x16xf32>, tensor<2x16xf32>, tensor<2x16xi1>, tensor<2x16x8xf32>)
    """)


# --------------------------------------------------------------------------- cross-entropy

CROSS_ENTROPY = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<6x50xf32>, %y: tensor<6xi64>) -> (tensor<6xf32>, tensor<6xf32>, tensor<6xf32>) {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %e1 = tensor.empty() : tensor<6xf32>
  %e2 = tensor.empty() : tensor<6x50xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<6xf32>) -> tensor<6xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<6x50xf32>) outs(%m0 : tensor<6xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<6xf32>
  %e = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<6x50xf32>, tensor<6xf32>) outs(%e2 : tensor<6x50xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %r = math.exp %d : f32
    linalg.yield %r : f32
  } -> tensor<6x50xf32>
  %l0 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<6xf32>) -> tensor<6xf32>
  %l = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%e : tensor<6x50xf32>) outs(%l0 : tensor<6xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<6xf32>
  %g = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x, %y : tensor<6x50xf32>, tensor<6xi64>) outs(%l0 : tensor<6xf32>) {
  ^bb0(%a: f32, %t: i64, %o: f32):
    %j = linalg.index 1 : index
    %ji = arith.index_cast %j : index to i64
    %hit = arith.cmpi eq, %ji, %t : i64
    %v = arith.select %hit, %a, %zero : f32
    %r = arith.addf %v, %o : f32
    linalg.yield %r : f32
  } -> tensor<6xf32>
  return %m, %l, %g : tensor<6xf32>, tensor<6xf32>, tensor<6xf32>
}
"""


def test_sibling_gather_joins_the_loop_with_the_tile_offset():
    payload = parse(CROSS_ENTROPY)
    fuse(payload, reduction=0, consumers=[2, 3], tile=16)
    assert str(payload).count("scf.for") == 1
    check(payload, """
        CHECK: scf.for %[[J:.*]] = {{.*}} iter_args
        CHECK:   linalg.index 1
        CHECK:   arith.addi %{{.*}}, %[[J]] : index
        CHECK:   arith.cmpi eq
    """)
    torch.manual_seed(2)
    x = torch.randn(6, 50) * 30
    y = torch.tensor([0, 49, 17, 16, 33, 48])
    m, l, g = run_module(payload, [x, y])
    torch.testing.assert_close(m, x.amax(1))
    torch.testing.assert_close(l, torch.exp(x - x.amax(1, keepdim=True)).sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g, x.gather(1, y[:, None])[:, 0])
    lse = m + torch.log(l)
    torch.testing.assert_close(lse - g, torch.nn.functional.cross_entropy(x, y, reduction="none"),
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- rejections

def _variant(old, new, text=SOFTMAX.format(N=4, C=64, T="f32", WIDEN="arith.addf %a, %zero : f32")):
    assert old in text
    return parse(text.replace(old, new))


def test_rejects_non_separable_e():
    payload = _variant("    %r = math.exp %d : f32\n    linalg.yield %r : f32\n  }} -> tensor<4x64xf32>".replace("}}", "}"),
                       "    %r = arith.mulf %d, %d : f32\n    linalg.yield %r : f32\n  } -> tensor<4x64xf32>")
    message = fuse_failure(payload, 1, [3], 16)
    assert "not separable" in message and "arith.mulf" in message


def test_rejects_nonzero_consumer_init():
    payload = _variant("%l0 = linalg.fill ins(%zero : f32)", "%l0 = linalg.fill ins(%ninf : f32)")
    message = fuse_failure(payload, 1, [3], 16)
    assert "init is not provably zero" in message


def test_rejects_min_with_an_exponent_that_grows():
    payload = _variant("%r = arith.maximumf %a, %o : f32", "%r = arith.minimumf %a, %o : f32")
    message = fuse_failure(payload, 1, [3], 16)
    assert "running min" in message and "amplify" in message


M_THROUGH_REDUCTION = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#all = affine_map<(d0, d1) -> ()>
func.func @main(%x: tensor<4x64xf32>) -> tensor<4xf32> {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %e1 = tensor.empty() : tensor<4xf32>
  %e2 = tensor.empty() : tensor<4x64xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %m = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x64xf32>) outs(%m0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  %es = tensor.empty() : tensor<f32>
  %t0 = linalg.fill ins(%zero : f32) outs(%es : tensor<f32>) -> tensor<f32>
  %t = linalg.generic {indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> ()>], iterator_types = ["reduction"]}
      ins(%m : tensor<4xf32>) outs(%t0 : tensor<f32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<f32>
  %e = linalg.generic {indexing_maps = [#id, #row, #all, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m, %t : tensor<4x64xf32>, tensor<4xf32>, tensor<f32>) outs(%e2 : tensor<4x64xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %d2 = arith.subf %d, %c : f32
    %r = math.exp %d2 : f32
    linalg.yield %r : f32
  } -> tensor<4x64xf32>
  %l0 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<4xf32>) -> tensor<4xf32>
  %l = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%e : tensor<4x64xf32>) outs(%l0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %l : tensor<4xf32>
}
"""


def test_rejects_m_reaching_the_consumer_through_a_reduction():
    message = fuse_failure(parse(M_THROUGH_REDUCTION), 0, [3], 16)
    assert "cannot join the loop" in message


def test_rejects_a_consumer_reading_another_consumer():
    """sum_c y_c with y = e / l (a softmax backward's sum_c g_c s_c) reads the exp-sum l,
    which the fused loop holds only as a running partial sum: refused, not fused (fused, it
    divided the earlier tiles by their partial l: wrong whenever the tile leaves a
    remainder)."""
    payload = _variant("  return %y : tensor<4x64xf32>", """  %s = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%y : tensor<4x64xf32>) outs(%l0 : tensor<4xf32>) {
  ^bb0(%a: f32, %o: f32):
    %r = arith.addf %a, %o : f32
    linalg.yield %r : f32
  } -> tensor<4xf32>
  return %y : tensor<4x64xf32>""")
    message = fuse_failure(payload, 1, [3, 5], 16)
    assert "reads another reduction of the group" in message


def test_rejects_a_tile_that_does_not_divide_without_remainder_handling():
    payload = softmax_payload(4, 50)
    message = fuse_failure(payload, 1, [3], 16, allow_remainder=False)
    assert "does not divide the reduced extent 50" in message
