"""Differential fuzzing of attention kernels against torch (see tests/fuzz/harness.py)."""

from hypothesis import given
from hypothesis import strategies as st

from .harness import check_kernel, fuzz_test
from .programs.attention import attention_kernels


@fuzz_test("attention")
@given(source=attention_kernels(), backward=st.booleans())
def test_attention_kernels_match_torch(source, backward):
    check_kernel("attention", source, backward)
