"""unmask_extremum_reductions: IR (FileCheck) and the fuzzer's finding it fixes (a max
pooling over a convolution's output one lane wide, all its values negative)."""

import pytest

from lighthouse.compile import compile_kernel
from schedules.common import match
from transform_ext.unmask_extremum_reductions import unmask_extremum_reductions
from tests.transform_ext.helpers import apply, check, parse

MASKED = """
func.func @main(%v: vector<2x16xf32>, %acc: vector<2xf32>, %w: vector<16xf32>, %s: vector<2x16xf32>) -> (vector<2xf32>, vector<2xf32>, f32) {
  %m = vector.constant_mask [2, 3] : vector<2x16xi1>
  %max = vector.mask %m { vector.multi_reduction <maximumf>, %v, %acc [1] : vector<2x16xf32> to vector<2xf32> } : vector<2x16xi1> -> vector<2xf32>
  %sum = vector.mask %m { vector.multi_reduction <add>, %s, %acc [1] : vector<2x16xf32> to vector<2xf32> } : vector<2x16xi1> -> vector<2xf32>
  %m1 = vector.constant_mask [5] : vector<16xi1>
  %zero = arith.constant 0.0 : f32
  %min = vector.mask %m1 { vector.multi_reduction <minnumf>, %w, %zero [0] : vector<16xf32> to f32 } : vector<16xi1> -> f32
  return %max, %sum, %min : vector<2xf32>, vector<2xf32>, f32
}
"""


def test_max_and_min_reductions_lose_their_masks():
    payload = parse(MASKED)
    apply(payload, lambda root: unmask_extremum_reductions(match(root, "func.func")))
    check(str(payload), """
        CHECK: %[[M:.*]] = vector.constant_mask [2, 3] : vector<2x16xi1>
        CHECK: %[[NEG:.*]] = arith.constant dense<0xFF800000> : vector<2x16xf32>
        CHECK: %[[KEPT:.*]] = arith.select %[[M]], %arg0, %[[NEG]] : vector<2x16xi1>, vector<2x16xf32>
        CHECK: vector.multi_reduction <maximumf>, %[[KEPT]], %arg1 [1]
        CHECK: vector.mask %[[M]] { vector.multi_reduction <add>
        CHECK: %[[POS:.*]] = arith.constant dense<0x7F800000> : vector<16xf32>
        CHECK: %[[KEPT1:.*]] = arith.select %{{.*}}, %arg2, %[[POS]]
        CHECK: vector.multi_reduction <minnumf>, %[[KEPT1]], %{{.*}} [0]
    """)


POOLED = """
import torch
DTYPE = torch.{dtype}

class Model(torch.nn.Module):
    def forward(self, x, w):
        y = torch.nn.functional.conv2d(x, w)
        return {pooled}

def get_inputs():  # after torch.manual_seed(0): y = -1.19
    return [torch.randn(1, 1, 4, 3).to(DTYPE), (torch.randn(1, 1, 4, 3) * 0.707).to(DTYPE)]

def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("pooled", ["torch.amax(y, dim=(2, 3))", "torch.amin(-y, dim=(2, 3))"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pooling_over_one_lane(kernel_file, dtype, pooled):
    """The fuzzer (convolution_f393ffce57): the convolution's output is 1 x 1, the pooling
    fused after it vectorized 16 lanes wide; its masked max of a negative value returned
    -1.4e-45 (bf16: 0) instead of it; a min as its neighbour."""
    compiled = compile_kernel(kernel_file(POOLED.format(dtype=dtype, pooled=pooled)))
    assert not compiled.notes, compiled.notes
    for r in compiled.check():
        assert r.ok, str(r)
