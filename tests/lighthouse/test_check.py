"""The comparison against torch: tolerances on the result's scale, NaN/inf placement."""

import torch

from lighthouse.compile import compare


def test_rounding_of_a_long_reduction_passes_on_the_result_scale():
    g = torch.Generator().manual_seed(0)
    want = torch.randn(64, 64, generator=g) * 45          # a K = 2048 matmul's magnitude
    got = want + torch.randn(64, 64, generator=g) * 2e-4  # f32 reassociation noise
    got[0, 0] = want[0, 0] = 1e-3                         # an entry that cancelled to ~0
    got[0, 0] += 5e-4
    assert compare("out", got, want).ok


def test_a_one_percent_error_fails_on_results_of_size_one_and_up():
    g = torch.Generator().manual_seed(1)
    for scale in (1.0, 45.0, 1e4):
        want = torch.randn(32, 32, generator=g) * scale
        assert not compare("out", want * 1.01, want).ok


def test_small_results_keep_the_absolute_tolerance():
    want = torch.full((100,), 1e-3)
    assert compare("p", want + 1e-4, want).ok
    assert not compare("p", want + 3e-4, want).ok


def test_nan_and_inf_must_sit_where_torch_has_them():
    want = torch.tensor([1.0, float("nan"), float("-inf")])
    assert compare("x", want.clone(), want).ok
    assert not compare("x", torch.tensor([1.0, 0.0, float("-inf")]), want).ok
    assert not compare("x", torch.tensor([1.0, float("nan"), 0.0]), want).ok


LSE_KERNEL = """
import torch
import torch.nn.functional as F
LIGHTHOUSE = dict(return_lse=True, query_tile=16, key_tile=16)
class Model(torch.nn.Module):
    def forward(self, q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)
def get_inputs():
    m = torch.rand(40, 50) > 0.3
    m[3] = False                                   # a fully masked row: lse = -inf
    return [torch.randn(2, 3, 40, 16), torch.randn(2, 3, 50, 16), torch.randn(2, 3, 50, 16), m]
def get_init_inputs():
    return []
"""


def test_check_compares_the_schedules_lse_with_torch(kernel_file):
    from lighthouse.compile import compile_kernel

    compiled = compile_kernel(kernel_file(LSE_KERNEL))
    assert compiled.result_names == ["out0", "lse"]
    out, lse = compiled.run()
    reports = compiled.check((out, lse))
    assert [r.name for r in reports] == ["out0", "lse"]
    assert all(r.ok for r in reports), [str(r) for r in reports]
    assert torch.isinf(lse[:, :, 3]).all()
    shifted = compiled.check((out, lse + 1e-2))
    assert shifted[0].ok and not shifted[1].ok
