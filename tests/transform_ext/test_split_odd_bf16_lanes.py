"""split_odd_bf16_lanes: IR (FileCheck) of a bf16 row of 33 lanes split into 32 and 1, f32
and even rows left alone, rejection of a target that is not a function; numerics through
the generic schedule against torch (LLVM's x86 backend aborts on an odd bf16 vector)."""

import pytest
import torch

from schedules.common import match
from transform_ext.split_odd_bf16_lanes import split_odd_bf16_lanes
from tests.transform_ext.helpers import apply, apply_expect_failure, check, parse
from tests.transform_ext.numeric import run_module


def scale_rows(shape: str, element: str = "bf16") -> str:
    """y = 2 x on a tensor<shape x element>."""
    t = f"tensor<{shape}x{element}>"
    return f"""
    #id = affine_map<(d0, d1) -> (d0, d1)>
    func.func @main(%x: {t}) -> {t} {{
      %two = arith.constant 2.0 : {element}
      %e = tensor.empty() : {t}
      %r = linalg.generic {{indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}}
          ins(%x : {t}) outs(%e : {t}) {{
      ^bb0(%a: {element}, %out: {element}):
        %y = arith.mulf %a, %two : {element}
        linalg.yield %y : {element}
      }} -> {t}
      return %r : {t}
    }}
    """


def _split(root):
    split_odd_bf16_lanes(match(root, "func.func"))


def test_an_odd_bf16_row_is_split_into_an_even_part_and_one_lane():
    payload = parse(scale_rows("4x33"))
    apply(payload, _split)
    check(payload, """
        CHECK: func.func @main
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<4x32xbf16>) outs(%{{.*}} : tensor<4x32xbf16>)
        CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<4x1xbf16>) outs(%{{.*}} : tensor<4x1xbf16>)
        CHECK-NOT: linalg.generic
    """)


@pytest.mark.parametrize("shape, element", [("4x33", "f32"), ("4x34", "bf16"), ("4x1", "bf16")])
def test_f32_even_and_single_lanes_are_left_alone(shape, element):
    payload = parse(scale_rows(shape, element))
    before = str(payload)
    apply(payload, _split)
    assert str(payload) == before


def test_odd_bf16_rows_match_torch():
    x = torch.randn(5, 33, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = run_module(parse(scale_rows("5x33")), [x])[0]
    assert torch.equal(got, 2 * x)


def test_rejects_a_target_that_is_not_a_function():
    payload = parse(scale_rows("4x33"))
    before = str(payload)
    message = apply_expect_failure(
        payload, lambda root: split_odd_bf16_lanes(match(root, "linalg.generic")))
    assert "transform_ext.split_odd_bf16_lanes: linalg.generic at" in message
    assert "not a func.func" in message
    assert str(payload) == before
