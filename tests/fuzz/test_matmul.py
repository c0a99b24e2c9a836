"""Differential fuzzing of the matmul family against torch (see tests/fuzz/harness.py)."""

from hypothesis import given
from hypothesis import strategies as st

from .harness import check_kernel, fuzz_test
from .programs.matmul import matmul_kernels


@fuzz_test("matmul")
@given(source=matmul_kernels(), backward=st.booleans())
def test_matmul_kernels_match_torch(source, backward):
    check_kernel("matmul", source, backward)
