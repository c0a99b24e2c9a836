"""drop_unit_result_dims: a keepdim reduction writes its result without the unit dims it
indexes by a constant, expanded back after it."""

import pytest
import torch

from schedules.common import match
from transform_ext.drop_unit_result_dims import drop_unit_result_dims
from tests.transform_ext.helpers import apply, check, parse
from tests.transform_ext.numeric import run_module

KEEPDIM_SUM = """
#x = affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>
#y = affine_map<(d0, d1, d2, d3) -> ({y})>
func.func @main(%x: tensor<3x5x4x7xf32>) -> tensor<{shape}xf32> {{
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{shape}xf32>
  %y0 = linalg.fill ins(%zero : f32) outs(%e : tensor<{shape}xf32>) -> tensor<{shape}xf32>
  %y = linalg.generic {{indexing_maps = [#x, #y], iterator_types = ["parallel", "parallel", "reduction", "reduction"]}}
      ins(%x : tensor<3x5x4x7xf32>) outs(%y0 : tensor<{shape}xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %t = math.tanh %a : f32
    %r = arith.addf %o, %t : f32
    linalg.yield %r : f32
  }} -> tensor<{shape}xf32>
  return %y : tensor<{shape}xf32>
}}
"""


def test_a_keepdim_sum_writes_its_kept_dims_then_expands():
    text = KEEPDIM_SUM.format(y="d0, d1, 0, 0", shape="3x5x1x1")
    payload = parse(text)
    apply(payload, lambda root: drop_unit_result_dims(match(root, "linalg.generic")))
    check(payload, """
        CHECK:      %[[I:.*]] = tensor.collapse_shape {{.*}} {{\\[}}[0], [1, 2, 3]] : tensor<3x5x1x1xf32> into tensor<3x5xf32>
        CHECK:      %[[Y:.*]] = linalg.generic {{.*}} outs(%[[I]] : tensor<3x5xf32>)
        CHECK:      tensor.expand_shape %[[Y]] {{\\[}}[0], [1, 2, 3]] output_shape [3, 5, 1, 1]
    """)
    x = torch.randn(3, 5, 4, 7, generator=torch.Generator().manual_seed(0))
    (after,) = run_module(payload, [x])
    (before,) = run_module(parse(text), [x])
    torch.testing.assert_close(after, torch.tanh(x).sum(dim=(2, 3), keepdim=True))
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_leading_unit_dims_join_the_first_kept_dim():
    text = KEEPDIM_SUM.format(y="0, d1, 0", shape="1x5x1").replace(
        '"parallel", "parallel", "reduction"', '"reduction", "parallel", "reduction"')
    payload = parse(text)
    apply(payload, lambda root: drop_unit_result_dims(match(root, "linalg.generic")))
    check(payload, """
        CHECK: tensor.collapse_shape {{.*}} {{\\[}}[0, 1, 2]] : tensor<1x5x1xf32> into tensor<5xf32>
    """)
    x = torch.randn(3, 5, 4, 7, generator=torch.Generator().manual_seed(1))
    (after,) = run_module(payload, [x])
    torch.testing.assert_close(after, torch.tanh(x).sum(dim=(0, 2, 3)).reshape(1, 5, 1))


def test_a_result_without_constant_indices_is_refused():
    payload = parse(KEEPDIM_SUM.format(y="d0, d1", shape="3x5"))
    with pytest.raises(Exception, match="writes no unit dim by a constant index"):
        apply(payload, lambda root: drop_unit_result_dims(match(root, "linalg.generic")))
