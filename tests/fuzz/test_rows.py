"""Differential fuzzing of softmax, log-softmax, norms and elementwise chains against torch
(see tests/fuzz/harness.py)."""

from hypothesis import given
from hypothesis import strategies as st

from .harness import check_kernel, fuzz_test
from .programs.rows import row_kernels


@fuzz_test("rows")
@given(source=row_kernels(), backward=st.booleans())
def test_rows_kernels_match_torch(source, backward):
    check_kernel("rows", source, backward)
