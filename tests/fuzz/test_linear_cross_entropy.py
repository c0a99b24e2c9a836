"""Differential fuzzing of linear cross-entropy kernels (the LM head and its loss) against
torch (see tests/fuzz/harness.py)."""

from hypothesis import given
from hypothesis import strategies as st

from .harness import check_kernel, fuzz_test
from .programs.linear_cross_entropy import linear_cross_entropy_kernels


@fuzz_test("linear_cross_entropy")
@given(source=linear_cross_entropy_kernels(), backward=st.booleans())
def test_linear_cross_entropy_kernels_match_torch(source, backward):
    check_kernel("linear_cross_entropy", source, backward)
