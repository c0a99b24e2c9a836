"""Differential fuzzing of the convolution family against torch (see tests/fuzz/harness.py).
Its cases compile slowly next to the other families' (a joint graph of three convolutions
and their phases), so `make test` runs a few; `make fuzz` runs the campaign."""

from hypothesis import given
from hypothesis import strategies as st

from .harness import check_kernel, fuzz_test
from .programs.convolution import convolution_kernels


@fuzz_test("convolution", examples={"ci": 8, "fuzz": 500})
@given(source=convolution_kernels(), backward=st.booleans())
def test_convolution_kernels_match_torch(source, backward):
    check_kernel("convolution", source, backward)
