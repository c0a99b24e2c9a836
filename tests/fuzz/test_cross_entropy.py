"""Differential fuzzing of cross-entropy kernels against torch (see tests/fuzz/harness.py)."""

from hypothesis import given
from hypothesis import strategies as st

from .harness import check_kernel, fuzz_test
from .programs.cross_entropy import cross_entropy_kernels


@fuzz_test("cross_entropy")
@given(source=cross_entropy_kernels(), backward=st.booleans())
def test_cross_entropy_kernels_match_torch(source, backward):
    check_kernel("cross_entropy", source, backward)
