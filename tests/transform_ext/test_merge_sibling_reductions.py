"""merge_sibling_reductions: the sums of x and x^2 (a one-pass variance) become one op that
reads x once (FileCheck, numbers against torch); reductions that must stay apart stay."""

import torch

from schedules.common import match
from transform_ext.merge_sibling_reductions import merge_sibling_reductions
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

SUMS = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<5x37xf32>) -> (tensor<5xf64>, tensor<5xf64>) {
  %zero = arith.constant 0.0 : f64
  %e = tensor.empty() : tensor<5xf64>
  %init = linalg.fill ins(%zero : f64) outs(%e : tensor<5xf64>) -> tensor<5xf64>
  %s1 = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<5x37xf32>) outs(%init : tensor<5xf64>) {
  ^bb0(%a: f32, %acc: f64):
    %w = arith.extf %a : f32 to f64
    %s = arith.addf %w, %acc : f64
    linalg.yield %s : f64
  } -> tensor<5xf64>
  %s2 = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<5x37xf32>) outs(%init : tensor<5xf64>) {
  ^bb0(%a: f32, %acc: f64):
    %w = arith.extf %a : f32 to f64
    %q = arith.mulf %w, %w : f64
    %s = arith.addf %q, %acc : f64
    linalg.yield %s : f64
  } -> tensor<5xf64>
  return %s1, %s2 : tensor<5xf64>, tensor<5xf64>
}
"""


def _merge(root):
    merge_sibling_reductions(match(root, "func.func"))


def test_sums_of_x_and_its_square_read_x_once():
    payload = parse(SUMS)
    apply(payload, _merge)
    check(str(payload), """
        CHECK: %[[R:.*]]:2 = linalg.generic {{.*}} iterator_types = ["parallel", "reduction"]
        CHECK-SAME: ins(%arg0 : tensor<5x37xf32>)
        CHECK:   ^bb0(%[[A:.*]]: f32, %[[ACC1:.*]]: f64, %[[ACC2:.*]]: f64):
        CHECK:   arith.addf %{{.*}}, %[[ACC1]]
        CHECK:   arith.mulf
        CHECK:   arith.addf %{{.*}}, %[[ACC2]]
        CHECK: return %[[R]]#0, %[[R]]#1
    """)
    assert str(payload).count("linalg.generic") == 1
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(0)) + 3
    s1, s2 = run_module(payload, [x])
    torch.testing.assert_close(s1, x.double().sum(1))
    torch.testing.assert_close(s2, (x.double() ** 2).sum(1))


def test_a_reduction_reading_the_others_result_stays_apart():
    """sum((x - s1)^2) reads s1 (the two-pass variance): it cannot share s1's sweep."""
    text = SUMS.replace("""      ins(%x : tensor<5x37xf32>) outs(%init : tensor<5xf64>) {
  ^bb0(%a: f32, %acc: f64):
    %w = arith.extf %a : f32 to f64
    %q = arith.mulf %w, %w : f64""", """      ins(%x, %s1 : tensor<5x37xf32>, tensor<5xf64>) outs(%init : tensor<5xf64>) {
  ^bb0(%a: f32, %m: f64, %acc: f64):
    %w0 = arith.extf %a : f32 to f64
    %w = arith.subf %w0, %m : f64
    %q = arith.mulf %w, %w : f64""").replace(
        '%s2 = linalg.generic {indexing_maps = [#id, #row], iterator_types',
        '%s2 = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types')
    payload = parse(text)
    apply(payload, _merge)
    assert str(payload).count("linalg.generic") == 2
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(1))
    s1, s2 = run_module(payload, [x])
    torch.testing.assert_close(s2, ((x.double() - x.double().sum(1, keepdim=True)) ** 2).sum(1))


def test_a_reader_between_them_keeps_them_apart():
    """A use of s1 before s2 would see s1 computed after it if they merged at s2's place."""
    text = SUMS.replace("""  %s2 = linalg.generic""", """  %t = tensor.empty() : tensor<5xf64>
  %twice = linalg.generic {indexing_maps = [affine_map<(d0) -> (d0)>, affine_map<(d0) -> (d0)>],
      iterator_types = ["parallel"]} ins(%s1 : tensor<5xf64>) outs(%t : tensor<5xf64>) {
  ^bb0(%a: f64, %o: f64):
    %d = arith.addf %a, %a : f64
    linalg.yield %d : f64
  } -> tensor<5xf64>
  %s2 = linalg.generic""").replace("return %s1, %s2", "return %twice, %s2")
    payload = parse(text)
    apply(payload, _merge)
    assert str(payload).count("linalg.generic") == 3
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(2))
    twice, s2 = run_module(payload, [x])
    torch.testing.assert_close(twice, 2 * x.double().sum(1))
    torch.testing.assert_close(s2, (x.double() ** 2).sum(1))


def test_reductions_over_other_loops_stay_apart():
    """A column sum of the same x has other loops (iterator types): it is no sibling."""
    text = SUMS.replace("""%s2 = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<5x37xf32>) outs(%init : tensor<5xf64>) {""",
                        """%e2 = tensor.empty() : tensor<37xf64>
  %init2 = linalg.fill ins(%zero : f64) outs(%e2 : tensor<37xf64>) -> tensor<37xf64>
  %s2 = linalg.generic {indexing_maps = [#id, affine_map<(d0, d1) -> (d1)>], iterator_types = ["reduction", "parallel"]}
      ins(%x : tensor<5x37xf32>) outs(%init2 : tensor<37xf64>) {""").replace(
        "} -> tensor<5xf64>\n  return", "} -> tensor<37xf64>\n  return").replace(
        "-> (tensor<5xf64>, tensor<5xf64>)", "-> (tensor<5xf64>, tensor<37xf64>)").replace(
        "return %s1, %s2 : tensor<5xf64>, tensor<5xf64>", "return %s1, %s2 : tensor<5xf64>, tensor<37xf64>")
    payload = parse(text)
    apply(payload, _merge)
    assert str(payload).count("linalg.generic") == 2


def test_a_target_that_is_no_function_is_refused():
    payload = parse(SUMS)
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: merge_sibling_reductions(match(root, "linalg.generic")))
    assert "transform_ext.merge_sibling_reductions: linalg.generic at" in message
    assert "not a func.func" in message
    assert str(payload) == before


def test_a_reduction_that_uses_no_element_of_the_shared_input_stays_apart():
    """sum_c (-1) reads x only for its loop bounds: merged, its constant term was added once
    per vector (-1 instead of -40); alone, read_reduction_constants handles it."""
    text = SUMS.replace("""    %w = arith.extf %a : f32 to f64
    %s = arith.addf %w, %acc : f64""", """    %minus = arith.constant -1.0 : f64
    %s = arith.addf %acc, %minus : f64""")
    payload = parse(text)
    apply(payload, _merge)
    assert str(payload).count("linalg.generic") == 2
    check(str(payload), """
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<5xf64>)
        CHECK:   arith.addf %{{.*}}, %{{.*}} : f64
        CHECK: linalg.generic {{.*}} outs(%{{.*}} : tensor<5xf64>)
        CHECK:   arith.mulf
    """)
