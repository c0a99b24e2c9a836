"""deduplicate_generics: IR (FileCheck), numerics before/after on the CPU, what it keeps."""

import torch

from schedules.common import apply_passes, match
from transform_ext.deduplicate_generics import deduplicate_generics
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

# The widening of x computed twice into different inits (as fuse_into_containing_op leaves a
# producer fused for a reader and for a yielded result), each read by its own row max; and
# a running sum reading its init, which is not a copy of anything.
PAYLOAD = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<4x16xf16>, %a: tensor<4x16xf32>, %b: tensor<4x16xf32>)
    -> (tensor<4xf32>, tensor<4xf32>, tensor<4x16xf32>, tensor<4x16xf32>) {
  %ninf = arith.constant 0xFF800000 : f32
  %e = tensor.empty() : tensor<4xf32>
  %init = linalg.fill ins(%ninf : f32) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %w1 = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<4x16xf16>) outs(%a : tensor<4x16xf32>) {
  ^bb0(%in: f16, %out: f32):
    %v = arith.extf %in : f16 to f32
    linalg.yield %v : f32
  } -> tensor<4x16xf32>
  %m1 = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%w1 : tensor<4x16xf32>) outs(%init : tensor<4xf32>) {
  ^bb0(%in: f32, %out: f32):
    %v = arith.maximumf %in, %out : f32
    linalg.yield %v : f32
  } -> tensor<4xf32>
  %w2 = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<4x16xf16>) outs(%b : tensor<4x16xf32>) {
  ^bb0(%in: f16, %out: f32):
    %v = arith.extf %in : f16 to f32
    linalg.yield %v : f32
  } -> tensor<4x16xf32>
  %m2 = linalg.generic {indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}
      ins(%w2 : tensor<4x16xf32>) outs(%init : tensor<4xf32>) {
  ^bb0(%in: f32, %out: f32):
    %v = arith.maximumf %in, %out : f32
    linalg.yield %v : f32
  } -> tensor<4xf32>
  %acc = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<4x16xf16>) outs(%b : tensor<4x16xf32>) {
  ^bb0(%in: f16, %out: f32):
    %v = arith.extf %in : f16 to f32
    %s = arith.addf %v, %out : f32
    linalg.yield %s : f32
  } -> tensor<4x16xf32>
  return %m1, %m2, %w2, %acc : tensor<4xf32>, tensor<4xf32>, tensor<4x16xf32>, tensor<4x16xf32>
}
"""


def _deduplicate(root):
    deduplicate_generics(match(root, "func.func"))
    return apply_passes(root, "cse")


def test_the_copy_is_merged_and_cse_merges_its_readers():
    payload = parse(PAYLOAD)
    apply(payload, _deduplicate)
    check(payload, """
        CHECK-LABEL: func.func @main
        CHECK:      %[[W:.*]] = linalg.generic
        CHECK:      arith.extf
        CHECK:      %[[M:.*]] = linalg.generic
        CHECK-SAME: ins(%[[W]]
        CHECK:      arith.maximumf
        CHECK-NOT:  arith.maximumf
        CHECK:      %[[ACC:.*]] = linalg.generic
        CHECK:      arith.addf
        CHECK:      return %[[M]], %[[M]], %[[W]], %[[ACC]]
    """)


def test_same_results_before_and_after():
    torch.manual_seed(0)
    x = torch.randn(4, 16).half()
    a, b = torch.randn(4, 16), torch.randn(4, 16)
    before = run_module(parse(PAYLOAD), [x, a, b])
    payload = parse(PAYLOAD)
    apply(payload, _deduplicate)
    after = run_module(payload, [x, a, b])
    for got, want in zip(after, before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(after[0], x.float().amax(1), rtol=0, atol=0)
    torch.testing.assert_close(after[3], x.float() + b, rtol=0, atol=0)


def test_generics_that_differ_stay_apart():
    text = PAYLOAD.replace("%v = arith.maximumf %in, %out : f32\n    linalg.yield %v : f32\n"
                           "  } -> tensor<4xf32>\n  %acc", "%v = arith.minimumf %in, %out : f32\n"
                           "    linalg.yield %v : f32\n  } -> tensor<4xf32>\n  %acc")
    assert "minimumf" in text
    payload = parse(text)
    apply(payload, _deduplicate)
    ir_text = str(payload)
    assert ir_text.count("arith.maximumf") == 1 and ir_text.count("arith.minimumf") == 1
    assert ir_text.count("arith.extf") == 2  # the widening once, the running sum's own
