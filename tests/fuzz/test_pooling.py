"""Differential fuzzing of poolings (the generic schedule's window rewrites: doubled stride-1
maxima, separated windows, strided taps as shuffles) against torch (see
tests/fuzz/harness.py). Forward only: the backward of a max pooling (its indices) is not a
pooling."""

from hypothesis import given

from .harness import check_kernel, fuzz_test
from .programs.pooling import pooling_kernels


@fuzz_test("pooling")
@given(source=pooling_kernels())
def test_pooling_kernels_match_torch(source):
    check_kernel("pooling", source, False)
