"""forall_results_in_lane_form: a row-block forall's per-row results (an f32 row max, a bf16
row value) leave it as [N, 16] lane tiles and are read back by a max over the lanes
(FileCheck; the same numbers as torch on the CPU); a [N, 16] result stays; a shared output
the body reads (an accumulation into an argument) is refused with nothing rewritten; a forall without
per-row results is left alone."""

import torch

from schedules.common import match
from transform_ext.forall_results_in_lane_form import forall_results_in_lane_form
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

# rows of x [8, 4] in blocks of 4: the row max (f32), the row max rounded to bf16, and a
# [8, 16] tile; the readers after the forall: m + 1 and the bf16 value widened
ROW_BLOCKS = """
#id1 = affine_map<(d0) -> (d0)>
#red = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<8x4xf32>) -> (tensor<8xf32>, tensor<8xf32>, tensor<8x16xf32>) {
  %ninf = arith.constant 0xFF800000 : f32
  %e = tensor.empty() : tensor<8xf32>
  %eb = tensor.empty() : tensor<8xbf16>
  %et = tensor.empty() : tensor<8x16xf32>
  %r:3 = scf.forall (%i) in (2) shared_outs(%m = %e, %mb = %eb, %t = %et)
      -> (tensor<8xf32>, tensor<8xbf16>, tensor<8x16xf32>) {
    %off = affine.apply affine_map<(d0) -> (d0 * 4)>(%i)
    %xs = tensor.extract_slice %x[%off, 0] [4, 4] [1, 1] : tensor<8x4xf32> to tensor<4x4xf32>
    %ms = tensor.extract_slice %m[%off] [4] [1] : tensor<8xf32> to tensor<4xf32>
    %init = linalg.fill ins(%ninf : f32) outs(%ms : tensor<4xf32>) -> tensor<4xf32>
    %max = linalg.generic {indexing_maps = [#red, #row], iterator_types = ["parallel", "reduction"]}
        ins(%xs : tensor<4x4xf32>) outs(%init : tensor<4xf32>) {
    ^bb0(%a: f32, %acc: f32):
      %v = arith.maximumf %a, %acc : f32
      linalg.yield %v : f32
    } -> tensor<4xf32>
    %mbs = tensor.extract_slice %mb[%off] [4] [1] : tensor<8xbf16> to tensor<4xbf16>
    %rounded = linalg.generic {indexing_maps = [#id1, #id1], iterator_types = ["parallel"]}
        ins(%max : tensor<4xf32>) outs(%mbs : tensor<4xbf16>) {
    ^bb0(%a: f32, %o: bf16):
      %v = arith.truncf %a : f32 to bf16
      linalg.yield %v : bf16
    } -> tensor<4xbf16>
    %te = tensor.empty() : tensor<4x16xf32>
    %tile = linalg.generic {indexing_maps = [#row, #red], iterator_types = ["parallel", "parallel"]}
        ins(%max : tensor<4xf32>) outs(%te : tensor<4x16xf32>) {
    ^bb0(%a: f32, %o: f32):
      linalg.yield %a : f32
    } -> tensor<4x16xf32>
    scf.forall.in_parallel {
      tensor.parallel_insert_slice %max into %m[%off] [4] [1] : tensor<4xf32> into tensor<8xf32>
      tensor.parallel_insert_slice %rounded into %mb[%off] [4] [1] : tensor<4xbf16> into tensor<8xbf16>
      tensor.parallel_insert_slice %tile into %t[%off, 0] [4, 16] [1, 1] : tensor<4x16xf32> into tensor<8x16xf32>
    }
  } {lh.row_blocks}
  %one = arith.constant 1.0 : f32
  %plus = linalg.generic {indexing_maps = [#id1, #id1], iterator_types = ["parallel"]}
      ins(%r#0 : tensor<8xf32>) outs(%e : tensor<8xf32>) {
  ^bb0(%a: f32, %o: f32):
    %v = arith.addf %a, %one : f32
    linalg.yield %v : f32
  } -> tensor<8xf32>
  %wide = linalg.generic {indexing_maps = [#id1, #id1], iterator_types = ["parallel"]}
      ins(%r#1 : tensor<8xbf16>) outs(%e : tensor<8xf32>) {
  ^bb0(%a: bf16, %o: f32):
    %v = arith.extf %a : bf16 to f32
    linalg.yield %v : f32
  } -> tensor<8xf32>
  return %plus, %wide, %r#2 : tensor<8xf32>, tensor<8xf32>, tensor<8x16xf32>
}
"""


def _rewrite(root):
    forall_results_in_lane_form(match(root, "scf.forall"), 16)


def test_per_row_results_leave_in_lane_form_and_are_read_back_exactly():
    payload = parse(ROW_BLOCKS)
    apply(payload, _rewrite)
    text = str(payload)
    check(text, """
        CHECK: %[[R:[0-9]+]]:3 = scf.forall (%{{[a-z0-9_]+}}) in (2) shared_outs(%{{[a-z0-9_]+}} = %{{[0-9]+}}, %[[M:[a-z0-9_]+]] = %{{[0-9]+}}, %[[MB:[a-z0-9_]+]] = %{{[0-9]+}}) -> (tensor<8x16xf32>, tensor<8x16xf32>, tensor<8x16xf32>)
        CHECK:   %[[MAX:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel", "reduction"]}
        CHECK:   %[[ROUNDED:[0-9]+]] = linalg.generic {{.*}} ins(%[[MAX]] : tensor<4xf32>)
        CHECK:   linalg.generic {{.*}} ins(%[[MAX]] : tensor<4xf32>) outs(%{{.*}} : tensor<4x16xf32>)
        CHECK:   %[[LM:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel", "parallel"]} ins(%[[MAX]] : tensor<4xf32>) outs(%{{.*}} : tensor<4x16xf32>)
        CHECK:   %[[LB:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel", "parallel"]} ins(%[[ROUNDED]] : tensor<4xbf16>) outs(%{{.*}} : tensor<4x16xf32>)
        CHECK:     arith.extf %{{.*}} : bf16 to f32
        CHECK:   scf.forall.in_parallel
        CHECK:     tensor.parallel_insert_slice %{{.*}} into %{{.*}}[%{{.*}}, 0] [4, 16] [1, 1]
        CHECK:     tensor.parallel_insert_slice %[[LM]] into %[[M]][%{{.*}}, 0] [4, 16] [1, 1]
        CHECK:     tensor.parallel_insert_slice %[[LB]] into %[[MB]][%{{.*}}, 0] [4, 16] [1, 1]
        CHECK: } {lh.row_blocks}
        CHECK: %[[BACK:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel", "reduction"]} ins(%[[R]]#1 : tensor<8x16xf32>)
        CHECK:   arith.maximumf
        CHECK: linalg.generic {{.*}} iterator_types = ["parallel", "reduction"]} ins(%[[R]]#2 : tensor<8x16xf32>)
        CHECK: %[[NARROW:[0-9]+]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<8xbf16>)
        CHECK:   arith.truncf %{{.*}} : f32 to bf16
        CHECK: linalg.generic {{.*}} ins(%[[BACK]] : tensor<8xf32>)
        CHECK: linalg.generic {{.*}} ins(%[[NARROW]] : tensor<8xbf16>)
    """)
    assert "tensor<8xf32>, tensor<8xbf16>" not in text.split("scf.forall.in_parallel")[0]
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    x[5] = float("-inf")   # a row of -inf: its max is -inf in every lane
    plus, wide, tile = run_module(payload, [x])
    m = x.max(dim=1).values
    torch.testing.assert_close(plus, m + 1, rtol=0, atol=0)
    torch.testing.assert_close(wide, m.to(torch.bfloat16).float(), rtol=0, atol=0)
    torch.testing.assert_close(tile, m[:, None].expand(8, 16), rtol=0, atol=0)


def test_read_first_reads_lane_zero_by_a_gather():
    """read = "first": the readers read R[i, 0] (a gather at the row and lane 0, as a
    kernel reading a value per column of its tile does); the same numbers."""
    payload = parse(ROW_BLOCKS)
    apply(payload, lambda root: forall_results_in_lane_form(match(root, "scf.forall"), 16,
                                                            read="first"))
    text = str(payload)
    check(text, """
        CHECK: %[[R:[0-9]+]]:3 = scf.forall
        CHECK: } {lh.row_blocks}
        CHECK: %[[FIRST:[0-9]+]] = linalg.generic {{.*}} iterator_types = ["parallel"]} outs(%{{.*}} : tensor<8xf32>)
        CHECK:   %[[ROW:.*]] = linalg.index 0 : index
        CHECK:   tensor.extract %[[R]]#1[%[[ROW]], %{{.*}}] : tensor<8x16xf32>
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<8xf32>)
        CHECK:   tensor.extract %[[R]]#2[{{.*}}] : tensor<8x16xf32>
        CHECK: linalg.generic {{.*}} ins(%[[FIRST]] : tensor<8xf32>)
    """)
    assert "arith.maximumf" not in text.split("{lh.row_blocks}")[1]
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    plus, wide, _ = run_module(payload, [x])
    m = x.max(dim=1).values
    torch.testing.assert_close(plus, m + 1, rtol=0, atol=0)
    torch.testing.assert_close(wide, m.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_a_shared_output_the_body_reads_is_refused():
    accumulated = ROW_BLOCKS.replace(
        "%init = linalg.fill ins(%ninf : f32) outs(%ms : tensor<4xf32>) -> tensor<4xf32>",
        "%init = linalg.generic {indexing_maps = [#id1], iterator_types = [\"parallel\"]} "
        "outs(%ms : tensor<4xf32>) {\n    ^bb0(%o: f32):\n      %v = arith.maximumf %o, %ninf "
        ": f32\n      linalg.yield %v : f32\n    } -> tensor<4xf32>").replace(
        "shared_outs(%m = %e,", "shared_outs(%m = %m0,").replace(
        "@main(%x: tensor<8x4xf32>)", "@main(%x: tensor<8x4xf32>, %m0: tensor<8xf32>)")
    payload = parse(accumulated)
    before = str(payload)
    message = apply_expect_failure(payload, _rewrite)
    assert "forall_results_in_lane_form" in message
    assert "result 0's shared output is read in the body by tensor.extract_slice" in message
    assert str(payload) == before


def test_a_forall_without_per_row_results_is_left_alone():
    only_tiles = parse(ROW_BLOCKS)
    apply(only_tiles, _rewrite)
    again = str(only_tiles)
    apply(only_tiles, _rewrite)
    assert str(only_tiles) == again
