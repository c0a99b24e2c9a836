"""split_reduction_lanes: a max, its exp-sum and a gather's sum split into 16 lanes (FileCheck,
numbers against torch with all -inf lanes and rows), and the refusals (lanes that do not
divide the classes, a group without its max)."""

import torch
from torch_mlir.dialects import transform

from schedules.common import match
from transform_ext.split_reduction_lanes import split_reduction_lanes
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module

LOGSUMEXP = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @main(%x: tensor<3x{C}xf32>, %y: tensor<3xi64>) -> (tensor<3xf32>, tensor<3xf32>, tensor<3xf32>) {{
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %e1 = tensor.empty() : tensor<3xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e1 : tensor<3xf32>) -> tensor<3xf32>
  %m = linalg.generic {{indexing_maps = [#id, #row], iterator_types = ["parallel", "reduction"]}}
      ins(%x : tensor<3x{C}xf32>) outs(%m0 : tensor<3xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %o : f32
    linalg.yield %r : f32
  }} -> tensor<3xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e1 : tensor<3xf32>) -> tensor<3xf32>
  %l = linalg.generic {{indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}}
      ins(%x, %m : tensor<3x{C}xf32>, tensor<3xf32>) outs(%z : tensor<3xf32>) {{
  ^bb0(%a: f32, %b: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %t = math.exp %d : f32
    %r = arith.addf %t, %o : f32
    linalg.yield %r : f32
  }} -> tensor<3xf32>
  %g = linalg.generic {{indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}}
      ins(%x, %y : tensor<3x{C}xf32>, tensor<3xi64>) outs(%z : tensor<3xf32>) {{
  ^bb0(%a: f32, %t: i64, %o: f32):
    %j = linalg.index 1 : index
    %ji = arith.index_cast %j : index to i64
    %hit = arith.cmpi eq, %ji, %t : i64
    %v = arith.select %hit, %a, %zero : f32
    %r = arith.addf %v, %o : f32
    linalg.yield %r : f32
  }} -> tensor<3xf32>
  return %m, %l, %g : tensor<3xf32>, tensor<3xf32>, tensor<3xf32>
}}
"""


def _split(root, lanes):
    split_reduction_lanes(match(root, "linalg.generic"), lanes)


def test_one_max_and_sum_per_lane():
    """Per lane: m_l, l_l and the gather's partial sums; combined as max_l m_l,
    sum_l l_l exp(m_l - m) (0 for an all -inf lane) and sum_l g_l. Lane 5 of row 1 is all
    -inf, row 2 entirely -inf (its sum is 0, its max -inf, no NaN from the combine)."""
    c = 256
    payload = parse(LOGSUMEXP.format(C=c))
    apply(payload, lambda root: _split(root, 16))
    check(str(payload), """
        CHECK: tensor.expand_shape {{.*}} into tensor<3x16x16xf32>
        CHECK: iterator_types = ["parallel", "reduction", "parallel"]{{.*}} {lh.lane_dim = 2 : i64}
        CHECK: arith.maximumf
        CHECK: iterator_types = ["parallel", "reduction"]
        CHECK: iterator_types = ["parallel", "reduction", "parallel"]
        CHECK: linalg.index 1
        CHECK: linalg.index 2
        CHECK: arith.muli
    """)
    torch.manual_seed(0)
    x = torch.randn(3, c) * 30
    x[1, 5::16] = -float("inf")
    x[2] = -float("inf")
    y = torch.tensor([0, 200, 37])
    m, l, g = run_module(payload, [x, y])
    torch.testing.assert_close(m, x.amax(1))
    want_l = torch.exp(x[:2] - x[:2].amax(1, keepdim=True)).sum(1)
    torch.testing.assert_close(l[:2], want_l, rtol=1e-5, atol=1e-6)
    assert l[2].item() == 0.0
    torch.testing.assert_close(g, x.gather(1, y[:, None])[:, 0])


def test_lanes_that_do_not_divide_the_classes_are_refused():
    payload = parse(LOGSUMEXP.format(C=250))
    before = str(payload)
    message = apply_expect_failure(payload, lambda root: _split(root, 16))
    assert "transform_ext.split_reduction_lanes: linalg.generic at" in message
    assert "not in multiples of 16" in message
    assert str(payload) == before


def test_a_group_without_its_max_is_refused():
    payload = parse(LOGSUMEXP.format(C=256))
    before = str(payload)

    def body(root):
        sums = transform.SplitHandleOp([transform.AnyOpType.get()] * 3,
                                       match(root, "linalg.generic")).results[1:]
        split_reduction_lanes(transform.merge_handles(list(sums)), 16)

    message = apply_expect_failure(payload, body)
    assert "the group must hold one max reduction, it holds 0" in message
    assert str(payload) == before
